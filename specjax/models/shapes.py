"""Published model shapes, declared once: the ``config.json`` values of the models that specjax
plans for and benchmarks without their weights (``specjax plan --model llama-3.1-8b``,
``benchmarks/device.py``'s random-weight targets).

Each entry is the Hugging Face ``config.json`` of the repository named in its ``source`` (the
fields :meth:`specjax.models.config.ModelConfig.from_hf_config` reads); :func:`shape_config` turns
a name into a :class:`~specjax.models.config.ModelConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from specjax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class PublishedShape:
    """A published model's shape: ``source`` (the repository whose ``config.json`` it is) and
    ``hf_config`` (those values, a Hugging Face ``config.json`` dict)."""

    source: str
    hf_config: Mapping[str, Any]

    def config(self) -> ModelConfig:
        """The :class:`ModelConfig` of these values."""
        return ModelConfig.from_hf_config(dict(self.hf_config))


_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
_LLAMA3 = dict(model_type="llama", rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
               bos_token_id=128000, eos_token_id=128001, vocab_size=128256, num_key_value_heads=8)

# Published config.json values (the Hugging Face model repositories named in "source").
SHAPES: dict[str, PublishedShape] = {
    "smollm2-135m": PublishedShape("HuggingFaceTB/SmolLM2-135M-Instruct config.json", dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0, rope_scaling=None,
        tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)),
    "llama-3.2-1b": PublishedShape("meta-llama/Llama-3.2-1B config.json", dict(
        _LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, head_dim=64,
        tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0))),
    "llama-3.1-8b": PublishedShape("meta-llama/Llama-3.1-8B config.json", dict(
        _LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        head_dim=128, tie_word_embeddings=False, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0))),
    "llama-3.1-70b": PublishedShape("meta-llama/Llama-3.1-70B config.json", dict(
        _LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        head_dim=128, tie_word_embeddings=False, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0))),
}

DEFAULT_SHAPE = "smollm2-135m"  # the shape of the default model (SmolLM2-135M-Instruct, shipped as a GGUF)


def shape_config(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of the published shape ``name`` (a key of :data:`SHAPES`).

    Raises:
      KeyError: an unknown name.
    """
    return SHAPES[name].config()
