"""One settings object for a decoding request: :class:`DecodeSettings` (the limits — length,
seed, batching, EOS — and the :class:`~specjax.core.sampling.Sampling` settings), validated once
and passed whole instead of repeated keyword lists."""

from __future__ import annotations

import dataclasses

from specjax.core import sampling as sampling_mod
from specjax.core.sampling import SamplingParams
from specjax.core.settings import knobs
from specjax.runtime.decoder import SEED_LIMIT


@dataclasses.dataclass(frozen=True, init=False)
class DecodeSettings:
    """How to decode (frozen, hashable).

    max_new_tokens: new tokens per prompt, ≥ 1 (capped per row to the context).
    sampling: a :class:`~specjax.core.sampling.Sampling` (temperature, top-k, top-p, min-p, the
      penalties, ``min_tokens``, ``logit_bias``; default greedy). Its fields also read as
      attributes of the settings (``settings.temperature``).
    seed: integer in [0, 2**64); prompt i of a request uses ``fold_in(seed_key(seed), i)``.
    batch_size: prompts decoded together (``None``: all at once).
    ignore_eos: decode exactly ``max_new_tokens`` (fixed-length benchmarks).

    Sampling fields may also be given as keywords (``DecodeSettings(max_new_tokens=64,
    temperature=0.7, min_p=0.05)``); with ``sampling=`` they replace its fields.

    Raises (on construction):
      ValueError: a value out of its range, naming it and the range.
    """

    max_new_tokens: int = 128
    sampling: sampling_mod.Sampling = None  # (set by __init__: a Sampling, default greedy)
    seed: int = 0
    batch_size: int | None = None
    ignore_eos: bool = False

    def __init__(self, max_new_tokens: int = 128, sampling: sampling_mod.Sampling | None = None, seed: int = 0,
                 batch_size: int | None = None, ignore_eos: bool = False, **sampling_fields):
        names = {n for n, _, _ in knobs(sampling_mod.Sampling)}
        unknown = sorted(set(sampling_fields) - names)
        if unknown:
            raise TypeError(f"DecodeSettings() got unknown keyword(s) {unknown}; sampling settings: {sorted(names)}")
        if sampling is None:
            sampling = sampling_mod.Sampling(**sampling_fields)
        elif sampling_fields:
            sampling = dataclasses.replace(sampling, **sampling_fields)
        for name, value in (("max_new_tokens", max_new_tokens), ("sampling", sampling), ("seed", seed),
                            ("batch_size", batch_size), ("ignore_eos", ignore_eos)):
            object.__setattr__(self, name, value)
        self.__post_init__()

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
        """``DecodeSettings(**kw)``: this class's fields and any :class:`Sampling` field as keywords.

        Raises ValueError (a :class:`~specjax.core.settings.SettingError` for sampling fields)
        naming the value out of range; TypeError for an unknown keyword."""
        return cls(**kw)

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
