"""Host side of pagedjax: block pool, KV cache manager, scheduler. Plain Python + numpy, no JAX."""
