"""Settings declared once: a :class:`Knob` per field of a frozen settings dataclass.

A knob states a field's default, its valid range (a check and the words for it), its one-line
help and whether it is a command-line flag. Everything else is derived from the declaration:
the CLI flags (:func:`specjax.cli.common.add_knob_args`), the pair-config validation
(:func:`specjax.api.load_pair_config`), the Python keywords, the device-side per-row arrays
(:class:`specjax.core.sampling.SamplingParams`), measurement cache keys and bench JSON
(:func:`as_dict`). Adding a sampling parameter therefore touches only its declaration in
:class:`specjax.core.sampling.Sampling` and the sampling math.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np


class SettingError(ValueError):
    """A setting out of its range. ``name`` is the field (``min_p``), so a caller can say
    ``--min-p`` (a flag) or ``config X: min_p`` (a config key)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


@dataclasses.dataclass(frozen=True)
class Knob:
    """The declaration of one settings field.

    kind: ``float``, ``int``, ``bool`` or ``str`` (the CLI flag's type and the config key's type).
    check: ``check(value) -> bool``, the valid range. expect: the range in words, used in errors
    ("a number in [0, 1] (0 = off)"). help: the flag's one-line help. flag: whether it is a
    command-line flag (``--name-with-dashes``). device: a per-row traced value of
    :class:`~specjax.core.sampling.SamplingParams` (``dtype``: its array dtype)."""

    kind: type
    check: Callable[[Any], bool]
    expect: str
    help: str
    flag: bool | tuple = True
    device: bool = True
    dtype: str = "float32"
    optional: bool = False
    http: str | None = None
    config: bool = True
    metavar: str | None = None

    def flag_for(self, command: str | None) -> bool:
        """Whether the field is a flag of ``command`` (``flag``: ``True`` for every decoding command,
        a tuple of command names, or ``False``)."""
        return self.flag is True or (isinstance(self.flag, tuple) and (command is None or command in self.flag))


def knob(default, *, kind: type, check: Callable[[Any], bool], expect: str, help: str, flag: bool | tuple = True,
         device: bool = True, optional: bool = False, http: str | None = None, config: bool = True,
         metavar: str | None = None) -> Any:
    """A dataclass field carrying its :class:`Knob` (use as ``name: T = knob(...)``).

    optional: ``None`` is a valid value (off / not given). http: the field's name in an HTTP
    request body when it differs (``max_new_tokens`` is OpenAI's ``max_tokens``); config: a
    pair-config key; metavar: the flag's placeholder."""
    dtype = "int32" if kind is int else "float32"
    return dataclasses.field(default=default, metadata={"knob": Knob(kind, check, expect, help, flag, device, dtype,
                                                                     optional, http, config, metavar)})


def knobs(cls) -> list[tuple[str, Knob, Any]]:
    """``(name, knob, default)`` of every declared field of a settings class, in order."""
    return [(f.name, f.metadata["knob"], f.default) for f in dataclasses.fields(cls) if "knob" in f.metadata]


def is_number(v) -> bool:
    """A finite real number (Python or NumPy; not a bool)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) \
        and math.isfinite(v)


def is_int(v) -> bool:
    """An integer (Python or NumPy; not a bool)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def of_kind(kind: type, v) -> bool:
    """Whether ``v`` has the declared kind (an int is a float; a bool is neither)."""
    if kind is float:
        return is_number(v)
    if kind is int:
        return is_int(v)
    return isinstance(v, kind)


def validate(obj) -> None:
    """Check every knob of a settings dataclass instance. Raises :class:`SettingError`
    ``"NAME must be EXPECT, got VALUE"`` for the first field out of range."""
    for name, k, _ in knobs(type(obj)):
        v = getattr(obj, name)
        if v is None and k.optional:
            continue
        if not (of_kind(k.kind, v) and k.check(v)):
            raise SettingError(name, f"{name} must be {k.expect}, got {v!r}")


def as_dict(obj) -> dict[str, Any]:
    """The declared fields of a settings instance as a JSON-ready dict (tuples as lists)."""
    out = {}
    for name, _, _ in knobs(type(obj)):
        v = getattr(obj, name)
        out[name] = [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
    return out


def non_default(obj) -> dict[str, Any]:
    """The declared fields of ``obj`` whose value differs from the declared default."""
    return {n: getattr(obj, n) for n, _, d in knobs(type(obj)) if getattr(obj, n) != d}
