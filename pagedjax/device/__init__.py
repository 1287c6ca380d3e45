"""Device side of pagedjax: pure JAX functions over pytrees (KV cache, page state, attention, sampling)."""
