"""The settings of a decoding run over a list of prompts: :class:`DecodeSettings`, a
:class:`~specjax.runtime.request.Request` (the declared request fields and the
:class:`~specjax.core.sampling.Sampling` settings, validated once) with a batch size."""

from __future__ import annotations

import dataclasses

from specjax.core.settings import SettingError
from specjax.runtime.request import Request, request_class


@dataclasses.dataclass(frozen=True, init=False)
class DecodeSettings:
    """How to decode a list of prompts (frozen, hashable): a :class:`~specjax.runtime.request.Request`
    whose prompts travel beside it (its declared fields — ``max_new_tokens``, ``ignore_eos``, ``seed``,
    ``stop``, ``logprobs``, … — and its :class:`~specjax.core.sampling.Sampling`, default greedy) plus
    how many prompts are decoded together. The request's fields, sampling fields and methods read as
    attributes (``DecodeSettings(max_new_tokens=64, temperature=0.7).temperature``).

    request: the :class:`Request` (or give its fields as keywords: ``DecodeSettings(max_new_tokens=64,
      temperature=0.7, min_p=0.05)``; with ``request=`` they replace its fields). Its seed is an
      integer here (not ``None``): prompt i of the list uses ``fold_in(seed_key(seed), i)``.
    batch_size: prompts decoded together (``None``: all at once).

    Raises (on construction):
      ValueError: a value out of its range, naming it and the range (a
        :class:`~specjax.core.settings.SettingError` for declared fields).
      TypeError: an unknown keyword.
    """

    request: Request = None  # (set by __init__)
    batch_size: int | None = None

    def __init__(self, batch_size: int | None = None, request: Request | None = None, **fields):
        if request is None:
            request = request_class()(**fields)  # the declaration as it is now (a test may extend it)
        elif fields:
            request = request.replace(**fields)
        object.__setattr__(self, "request", request)
        object.__setattr__(self, "batch_size", batch_size)
        if self.request.seed is None:
            raise SettingError("seed", "seed must be an integer in [0, 2**64), got None")
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or int(self.batch_size) != self.batch_size
                                            or self.batch_size < 1):
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")

    @classmethod
    def create(cls, **kw) -> "DecodeSettings":
        """``DecodeSettings(**kw)``: the request's declared fields, any :class:`Sampling` field and
        ``batch_size`` as keywords. Raises as the constructor."""
        return cls(**kw)

    def __getattr__(self, name):
        if name in ("request", "batch_size") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.request, name)

    def batches(self, n: int) -> list[range]:
        """Row ranges of ``n`` prompts in batches of ``batch_size``."""
        bs = self.batch_size or max(n, 1)
        return [range(i, min(i + bs, n)) for i in range(0, n, bs)]
