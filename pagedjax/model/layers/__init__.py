"""Model building blocks: linears (float and weight-quantized), mixture-of-experts, rotary embeddings."""
