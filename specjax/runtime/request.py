"""The decoding request, declared once (issue 50): :class:`Request`.

A request is a prompt, its :class:`~specjax.core.sampling.Sampling` and the request-level fields
declared here with :func:`~specjax.core.settings.knob` — each with its default, its valid range and
the words for it, its help line. Everything that takes a request derives from this declaration:

* the command line: one flag per field that is a flag (:func:`specjax.cli.flags.add_knob_args`),
  read into the resolved settings by :func:`specjax.cli.flags.resolve`;
* the pair config: one key per field that is a config key (:func:`specjax.api.load_pair_config`);
* Python: :func:`specjax.api.generate_text` takes a ``request=`` or the fields as keywords;
* HTTP: :mod:`specjax.serve.protocol` reads each field from the body under its HTTP name
  (``Knob.http``, else its own) and the server's defaults are a :class:`Request`;
* the executors: :class:`~specjax.runtime.engine.Engine` takes a :class:`Request` whose prompt is
  token ids, the CLI's and Python's :class:`~specjax.runtime.settings.DecodeSettings` is a
  :class:`Request` with a batch size;
* bench JSON: :func:`as_json` (every field at the ``config`` section's top level).

Cross-field rules are part of the declaration (:meth:`Request.__post_init__`): ``min_tokens`` may
not exceed ``max_new_tokens`` (vLLM refuses it too).

Errors are :class:`~specjax.core.settings.SettingError` naming the field (``e.name``), so the CLI
says ``--max-new-tokens …``, a pair config ``config X: max_new_tokens …`` and the server
``'max_tokens' …``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.core import sampling as sampling_mod
from specjax.core.drafting import MAX_NEW_TOKENS
from specjax.core.sampling import SamplingParams
from specjax.core.settings import SettingError, is_int, knob, knobs, validate
from specjax.runtime.batch import SEED_LIMIT

MAX_STOP = 16  # stop strings per request


def _stops_ok(v) -> bool:
    return len(v) <= MAX_STOP and all(isinstance(s, str) and s for s in v)


def _ids_ok(v) -> bool:
    return all(is_int(t) and 0 <= t < 2 ** 31 for t in v)


@dataclasses.dataclass(frozen=True, init=False)
class Request:
    """One decoding request (frozen, hashable).

    prompt: the prompt — token ids (a tuple of ints: what the :class:`~specjax.runtime.engine.Engine`
      takes), a text, or ``None`` where the prompts travel beside the request (``generate_text``'s
      list of texts, the CLI's prompts: one request for all of them).
    sampling: a :class:`~specjax.core.sampling.Sampling` (default greedy); its fields may also be
      given as keywords (``Request(max_new_tokens=64, temperature=0.7)``) and read as attributes
      (``request.temperature``).
    max_new_tokens: new tokens, ≥ 1 (capped per row to the context).
    ignore_eos: decode exactly ``max_new_tokens`` (fixed-length benchmarks).
    seed: an integer in [0, 2**64), or ``None`` (the engine draws one and reports it); prompt i of a
      request decoded as a batch uses ``fold_in(seed_key(seed), i)``.
    stop: stop strings (the text is cut before the first; at most :data:`MAX_STOP`).
    stop_token_ids: more ids that end the request (``finish_reason`` ``"stop"``).
    logprobs: ``None`` (off) or N ≥ 0: each token's log-probability and its top N alternatives.
    speculative: ``False`` decodes the request without the drafter (the engine's per-request switch).
    n: choices per request (1; room for several choices sharing one prefill).

    Raises (on construction):
      SettingError: a field out of its declared range, or ``min_tokens > max_new_tokens``, naming
        the field and the range.
      TypeError: an unknown keyword.
    """

    prompt: Any = None
    sampling: sampling_mod.Sampling = None  # (set by __init__: a Sampling, default greedy)
    max_new_tokens: int = knob(128, kind=int, check=lambda v: 1 <= v <= MAX_NEW_TOKENS,
                               expect="an integer >= 1 (at most 2**31 - 1; the context caps it far below)",
                               help="new tokens per prompt", http="max_tokens")
    ignore_eos: bool = knob(False, kind=bool, check=lambda v: True, expect="true or false",
                            help="do not stop at EOS (fixed-length benchmarks)")
    seed: int | None = knob(0, kind=int, check=lambda v: 0 <= v < SEED_LIMIT, expect="an integer in [0, 2**64)",
                            optional=True,
                            help="request seed, an integer in [0, 2**64) (prompt i uses fold_in(key(seed), i))")
    stop: tuple = knob((), kind=tuple, check=_stops_ok, expect=f"non-empty strings (at most {MAX_STOP})",
                       flag=("generate",), metavar="STR",
                       help="stop when the text contains STR (cut before it; repeatable; \\n and \\t are newline "
                            "and tab); finish_reason 'stop'")
    stop_token_ids: tuple = knob((), kind=tuple, check=_ids_ok, expect="token ids (integers >= 0)", flag=False,
                                 help="more token ids that end the request")
    logprobs: int | None = knob(None, kind=int, check=lambda v: v >= 0, expect="an integer >= 0 (top alternatives "
                                "per token)", optional=True, flag=("generate",), metavar="N",
                                help="log-probability of every emitted token and its top-N alternatives (JSON "
                                     "field 'logprobs')")
    speculative: bool = knob(True, kind=bool, check=lambda v: True, expect="true or false", flag=False,
                             config=False, help="false: decode this request without the drafter")
    n: int = knob(1, kind=int, check=lambda v: v == 1, expect="1 (one choice per request; send n separate "
                  "requests)", flag=False, config=False, help="choices per request")

    def __init__(self, prompt=None, sampling: sampling_mod.Sampling | None = None, **fields):
        own = field_names(type(self))
        sampling_names = {n for n, _, _ in knobs(sampling_mod.Sampling)}
        unknown = sorted(set(fields) - own - sampling_names)
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unknown keyword(s) {unknown}; request fields: "
                            f"{sorted(own)}; sampling settings: {sorted(sampling_names)}")
        s_fields = {k: v for k, v in fields.items() if k in sampling_names}
        if sampling is None:
            sampling = sampling_mod.Sampling(**s_fields)
        elif s_fields:
            sampling = dataclasses.replace(sampling, **s_fields)
        object.__setattr__(self, "prompt", tuple(int(t) for t in prompt) if _is_ids(prompt) else prompt)
        object.__setattr__(self, "sampling", sampling)
        for name, _, default in knobs(type(self)):
            v = fields.get(name, default)
            if isinstance(v, list):
                v = tuple(v)
            object.__setattr__(self, name, v)
        self.__post_init__()

    def __post_init__(self):
        if not isinstance(self.sampling, sampling_mod.Sampling):
            raise SettingError("sampling", f"sampling must be a specjax Sampling (specjax.Sampling), got "
                                           f"{type(self.sampling).__name__}")
        validate(self)
        if self.sampling.min_tokens > self.max_new_tokens:
            raise SettingError("min_tokens", f"min_tokens must be at most max_new_tokens ({self.max_new_tokens}), "
                                             f"got {self.sampling.min_tokens}")

    def __getattr__(self, name):
        if name != "sampling" and name in {n for n, _, _ in knobs(sampling_mod.Sampling)}:
            return getattr(self.sampling, name)
        raise AttributeError(name)

    @classmethod
    def create(cls, **kw) -> "Request":
        """``cls(**kw)``: the declared fields and any :class:`Sampling` field as keywords."""
        return cls(**kw)

    def replace(self, **kw) -> "Request":
        """A copy with ``kw`` changed (declared fields, ``prompt``, ``sampling`` or sampling fields)."""
        cur = {n: getattr(self, n) for n in field_names(type(self))}
        if "sampling" not in kw:
            cur["sampling"] = self.sampling
        cur["prompt"] = self.prompt
        cur.update(kw)
        return type(self)(**cur)

    def params(self, batch: int) -> SamplingParams:
        """Per-row :class:`SamplingParams` for ``batch`` rows (every row this request's sampling)."""
        return SamplingParams.from_rows([self.sampling] * batch)

    def eos_ids(self):
        """``Decoder.generate``'s ``eos_ids``: ``[]`` when EOS is ignored, else the model's (``None``)."""
        return [] if self.ignore_eos else None


def _is_ids(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt)


def request_class():
    """THE declaration of a request's fields (:class:`Request`, looked up when used: a test may add
    a field by replacing it), as :func:`specjax.cli.flags.sampling_class` is for sampling."""
    return globals()["Request"]


def field_names(cls=None) -> set[str]:
    """The declared fields of the request (``cls``: default :func:`request_class`)."""
    return {n for n, _, _ in knobs(cls or request_class())}


def declared(cls=None) -> list:
    """``(name, knob, default)`` of every declared request field (``cls``: default :func:`request_class`)."""
    return knobs(cls or request_class())


def as_json(req) -> dict:
    """The declared request fields of ``req`` as JSON-ready values (tuples as lists)."""
    return {n: list(getattr(req, n)) if isinstance(getattr(req, n), tuple) else getattr(req, n)
            for n, _, _ in knobs(request_class()) if hasattr(req, n)}


def config_key_ok(k, v) -> bool:
    """Whether a pair-config value has the field's kind (a TOML list for a tuple field)."""
    from specjax.core.settings import of_kind

    if k.kind is tuple:
        return isinstance(v, list)
    return of_kind(k.kind, v)
