"""specjax: exact speculative decoding for Llama-family models in JAX/Flax."""

__version__ = "0.1.0"
