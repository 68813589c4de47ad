"""The model and its executor: everything that imports torch (Llama layers, loader, model runner,
KV cache, sampler)."""
