"""Llama-family model and weight loaders."""
