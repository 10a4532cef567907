"""One settings object for a decoding request: :class:`DecodeSettings` (the limits — length,
seed, batching, EOS — and the :class:`~specjax.core.sampling.Sampling` settings), validated once
and passed whole instead of repeated keyword lists."""

from __future__ import annotations

import dataclasses

from specjax.core import sampling as sampling_mod
from specjax.core.sampling import SamplingParams
from specjax.core.settings import knobs
from specjax.runtime.decoder import SEED_LIMIT


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """How to decode (frozen, hashable).

    max_new_tokens: new tokens per prompt, ≥ 1 (capped per row to the context).
    sampling: a :class:`~specjax.core.sampling.Sampling` (temperature, top-k, top-p, min-p, the
      penalties, ``min_tokens``, ``logit_bias``; default greedy). Its fields also read as
      attributes of the settings (``settings.temperature``).
    seed: integer in [0, 2**64); prompt i of a request uses ``fold_in(seed_key(seed), i)``.
    batch_size: prompts decoded together (``None``: all at once).
    ignore_eos: decode exactly ``max_new_tokens`` (fixed-length benchmarks).

    Build with :meth:`create` to give sampling fields as keywords
    (``DecodeSettings.create(max_new_tokens=64, temperature=0.7, min_p=0.05)``).

    Raises (on construction):
      ValueError: a value out of its range, naming it and the range.
    """

    max_new_tokens: int = 128
    sampling: sampling_mod.Sampling = dataclasses.field(default_factory=lambda: sampling_mod.Sampling())
    seed: int = 0
    batch_size: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or int(self.max_new_tokens) != self.max_new_tokens \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.sampling, sampling_mod.Sampling):
            raise ValueError(f"sampling must be a specjax.Sampling, got {type(self.sampling).__name__}")
        if isinstance(self.seed, bool) or int(self.seed) != self.seed or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.batch_size is not None and (int(self.batch_size) != self.batch_size or self.batch_size < 1):
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")

    @classmethod
    def create(cls, **kw) -> "DecodeSettings":
        """Settings from keywords: this class's fields and any :class:`Sampling` field.

        Raises ValueError (a :class:`~specjax.core.settings.SettingError` for sampling fields)
        naming the value out of range; TypeError for an unknown keyword."""
        names = {n for n, _, _ in knobs(sampling_mod.Sampling)}
        samp = {k: kw.pop(k) for k in list(kw) if k in names}
        base = kw.pop("sampling", None)
        if base is not None and samp:
            base = dataclasses.replace(base, **samp)
        return cls(sampling=base or sampling_mod.Sampling(**samp), **kw)

    def __getattr__(self, name):
        if name != "sampling" and name in {n for n, _, _ in knobs(sampling_mod.Sampling)}:
            return getattr(self.sampling, name)
        raise AttributeError(name)

    def params(self, batch: int) -> SamplingParams:
        """Per-row :class:`SamplingParams` for ``batch`` rows (every row the same settings)."""
        return SamplingParams.from_rows([self.sampling] * batch)

    def eos_ids(self):
        """``Decoder.generate``'s ``eos_ids``: ``[]`` when EOS is ignored, else the model's (``None``)."""
        return [] if self.ignore_eos else None

    def batches(self, n: int) -> list[range]:
        """Row ranges of ``n`` prompts in batches of ``batch_size``."""
        bs = self.batch_size or max(n, 1)
        return [range(i, min(i + bs, n)) for i in range(0, n, bs)]
