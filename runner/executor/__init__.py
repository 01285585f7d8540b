"""Step execution: model runner, CUDA graphs, attention backends, KV cache, sampling."""
