"""The Llama family and its relatives (Mistral, Qwen2/3, Gemma 2/3 text): configs, the weight
table, the block, attention over the KV cache, the weight formats' matmuls (int8:
:mod:`~specjax.models.q8`) and the CPU kernels' one build and load path
(:mod:`~specjax.models.kernels`). Imports only :mod:`specjax.core`."""
