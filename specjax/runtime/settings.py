"""One settings object for a decoding request: :class:`DecodeSettings` (sampling, length,
seed, batching, EOS), validated once and passed whole instead of repeated keyword lists."""

from __future__ import annotations

import dataclasses

from specjax.core.sampling import SamplingParams
from specjax.runtime.decoder import SEED_LIMIT


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """How to decode (frozen, hashable).

    max_new_tokens: new tokens per prompt, ≥ 1 (capped per row to the context).
    temperature: ≥ 0, 0 = greedy. top_k: ≥ 0, 0 = off. top_p: in (0, 1], 1 = off.
    seed: integer in [0, 2**64); prompt i of a request uses ``fold_in(seed_key(seed), i)``.
    batch_size: prompts decoded together (``None``: all at once).
    ignore_eos: decode exactly ``max_new_tokens`` (fixed-length benchmarks).

    Raises (on construction):
      ValueError: a value out of its range, naming it and the range.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or int(self.max_new_tokens) != self.max_new_tokens \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        self.sampling(1)  # the sampling ranges, defined once (SamplingParams.create)
        if isinstance(self.seed, bool) or int(self.seed) != self.seed or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.batch_size is not None and (int(self.batch_size) != self.batch_size or self.batch_size < 1):
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")

    def sampling(self, batch: int) -> SamplingParams:
        """Per-row :class:`SamplingParams` for ``batch`` rows."""
        return SamplingParams.create(batch, self.temperature, self.top_k, self.top_p)

    def eos_ids(self):
        """``Decoder.generate``'s ``eos_ids``: ``[]`` when EOS is ignored, else the model's (``None``)."""
        return [] if self.ignore_eos else None

    def batches(self, n: int) -> list[range]:
        """Row ranges of ``n`` prompts in batches of ``batch_size``."""
        bs = self.batch_size or max(n, 1)
        return [range(i, min(i + bs, n)) for i in range(0, n, bs)]
