"""Weights in and out: orbax checkpoints, Hugging Face folders (configs, safetensors, pre-quantized tensors), and
the one entry point an engine loads through (`loader`)."""
