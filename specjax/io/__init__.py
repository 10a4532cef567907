"""Files and assets: checkpoints (Hugging Face safetensors, GGUF), tokenizers, prompts, the
shipped pairs and drafters, the converted-weights cache and :func:`~specjax.io.loading.load_model`."""
