"""Every environment variable specjax reads, declared once: a :class:`Var` per name with its kind,
default and one-line help, and :func:`get`, the one way to read one.

Kinds: ``flag`` (``1/true/yes/on`` or ``0/false/no/off``, any case; empty = unset), ``int`` (an
integer in a range), ``choice`` (one of a set, any case), ``path`` (``~`` expanded) and ``str``. A
value a variable does not accept raises :class:`EnvError`, one line naming the variable, the value
and what it accepts (the command line prints it as ``specjax: error: …``, exit status 2, and checks
every declared variable that is set before a command runs: :func:`check_all`). An empty value is
unset everywhere, so ``SPECJAX_NO_CACHE=`` and ``SPECJAX_NO_CACHE=0`` both leave the caches on.

Variables read by the C++ kernels (``kernel``: ``q8block.cc``, ``attention.cc`` through
``cpu_pool.h``'s ``env_int``) and by JAX (``jax``) are declared here too, so the README's table
(:func:`markdown_table`) lists everything a user may set; the command line checks their values, the
kernels read them with ``atoi`` themselves.

A bottom-layer module (standard library only).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_INT_MAX = 2**31 - 1  # the C++ kernels read their knobs into an int


class EnvError(ValueError):
    """A declared environment variable set to a value it does not accept. The message is one line:
    the variable, the value, what it accepts and the fix. ``name``/``value``: the variable and its value."""

    def __init__(self, name: str, value: str, message: str):
        super().__init__(message)
        self.name, self.value = name, value


@dataclasses.dataclass(frozen=True)
class Var:
    """One environment variable.

    kind: ``flag``, ``int``, ``choice``, ``path`` or ``str``. default: the value when it is unset or
    empty (what :func:`get` returns then). help: one line for the README. minimum/maximum: an
    ``int``'s range (None: open). choices: a ``choice``'s values (lower case). example: a good value,
    for the fix in an error (``give {noun} like NAME=example``). read_by: ``python`` (:func:`get`),
    ``kernel`` (the C++ kernels) or ``jax``. shown: the default in words for the README, where it
    is not :attr:`default` itself (None: computed by the reader)."""

    name: str
    kind: str
    default: Any
    help: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()
    example: str = ""
    noun: str = "one"
    read_by: str = "python"
    shown: str = ""

    def accepts(self) -> str:
        """What the variable accepts, in words (the errors and the README say it)."""
        if self.kind == "flag":
            return "1/0 (also true/false, yes/no, on/off)"
        if self.kind == "int":
            if self.minimum is not None and self.maximum is not None:
                return f"an integer in [{self.minimum}, {self.maximum}]"
            if self.minimum is not None:
                return f"an integer >= {self.minimum}"
            return "an integer"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "path":
            return "a path"
        return "any text"

    def _refuse(self, raw: str, what: str, fix: str) -> EnvError:
        return EnvError(self.name, raw, f"{self.name}={raw!r} is not {what}; unset it or {fix}")

    def parse(self, raw: str | None) -> Any:
        """The value of ``raw`` (the variable's text; None or blank: :attr:`default`); raises
        :class:`EnvError` for a value the variable does not accept."""
        if raw is None or not raw.strip():
            return self.default
        text = raw.strip()
        if self.kind == "flag":
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise self._refuse(raw, "a flag (1/0, true/false, yes/no, on/off)",
                               f"set {self.name}=1 (on) or {self.name}=0 (off)")
        if self.kind == "int":
            example = self.example or str(self.minimum if self.minimum is not None else 0)
            fix = f"give {self.noun} like {self.name}={example}"
            try:
                value = int(text, 10)
            except ValueError:
                raise self._refuse(raw, self.accepts(), fix) from None
            if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
                raise self._refuse(raw, self.accepts(), fix)
            return value
        if self.kind == "choice":
            low = text.lower()
            if low not in self.choices:
                raise self._refuse(raw, self.accepts(), "set " + " or ".join(f"{self.name}={c}" for c in self.choices))
            return low
        if self.kind == "path":
            return os.path.expanduser(text)
        return raw


def _vars(*vs: Var) -> dict[str, Var]:
    return {v.name: v for v in vs}


VARS: dict[str, Var] = _vars(
    # ---- caches
    Var("SPECJAX_NO_CACHE", "flag", False,
        "1: no JAX compilation cache, exported programs, measurement or conversion cache (the built CPU kernels are kept)"),
    Var("SPECJAX_NO_PROGRAM_CACHE", "flag", False,
        "1: no exported programs (a warm start traces the decode loop again); the compilation cache stays on"),
    Var("SPECJAX_NO_PREFETCH", "flag", False,
        "1: do not read the last run's programs back on background threads while the weights load"),
    Var("SPECJAX_CACHE", "path", None,
        "the JAX compilation cache directory (exported programs go under specjax-programs/ there)",
        shown="~/.cache/specjax/jax"),
    Var("SPECJAX_CACHE_DIR", "path", None,
        "the base of specjax's own caches: converted/ weights, measured/ costs, kernels/ built",
        shown="$XDG_CACHE_HOME/specjax, else ~/.cache/specjax"),
    Var("XDG_CACHE_HOME", "path", None,
        "the base of SPECJAX_CACHE_DIR's default (XDG convention)"),
    # ---- the command line
    Var("SPECJAX_DEBUG", "flag", False, "1: a user error raises with its traceback instead of one line"),
    Var("SPECJAX_NO_PROGRESS", "flag", False, "1: no progress lines on stderr (phases, distill's bar)"),
    Var("SPECJAX_API_KEY", "str", None, "the default of `specjax serve --api-key` (unset: no key, open)"),
    # ---- the CPU kernels (Python side)
    Var("SPECJAX_ATTENTION", "choice", "auto",
        "xla: the blocked jnp attention on CPU too (auto: the C++ kernel where it builds)",
        choices=("auto", "xla")),
    Var("SPECJAX_Q8_THREADS", "int", None, "threads of the int8 matmul and attention kernels per call",
        minimum=1, example="2", noun="a thread count", shown="the cores this process may use, at most 8"),
    Var("CXX", "str", None, "the C++ compiler that builds the CPU kernels", shown="g++, else c++"),
    # ---- the CPU kernels' tuning knobs (read by the C++ sources; none changes a result)
    Var("SPECJAX_Q8_MIN_PAR_ROWS", "int", 64, "int8 matmul calls of fewer rows run on one thread",
        minimum=0, maximum=_INT_MAX, example="64", read_by="kernel"),
    Var("SPECJAX_Q8_SPIN_US", "int", 0, "microseconds a kernel helper thread spins before it sleeps",
        minimum=0, maximum=_INT_MAX, example="100", read_by="kernel"),
    Var("SPECJAX_Q8_PFLIN", "int", 1, "int8 KN (VNNI): prefetch the next block's rows (0: off)",
        minimum=0, maximum=1, example="1", read_by="kernel"),
    Var("SPECJAX_Q8_PFS", "int", 1, "int8 KN (VNNI): prefetch the next block's scales (0: off)",
        minimum=0, maximum=1, example="1", read_by="kernel"),
    Var("SPECJAX_Q8_PF", "int", 4, "int8 KN (VNNI): prefetch distance in tiles (0: off)",
        minimum=0, maximum=_INT_MAX, example="4", read_by="kernel"),
    Var("SPECJAX_Q8_YBUDGET", "int", 256 << 10, "int8 KN (VNNI): bytes of a chunk's permuted output",
        minimum=1, maximum=_INT_MAX, example=str(256 << 10), read_by="kernel"),
    Var("SPECJAX_Q8_PFG", "int", 1, "int8 NK (VNNI): prefetch distance in groups of 16 rows",
        minimum=0, maximum=_INT_MAX, example="1", read_by="kernel"),
    Var("SPECJAX_Q8_PFG_T1", "int", 0, "int8 NK (VNNI): 1 prefetches into L2 instead of L1",
        minimum=0, maximum=1, example="1", read_by="kernel"),
    Var("SPECJAX_Q8_PFB", "int", 2, "int8 (AVX2): prefetch distance in blocks (0: off)",
        minimum=0, maximum=_INT_MAX, example="2", read_by="kernel"),
    Var("SPECJAX_ATTN_MIN_PAR_WORK", "int", 1 << 23, "attention calls of fewer multiply-adds run on one thread",
        minimum=0, maximum=_INT_MAX, example=str(1 << 23), read_by="kernel"),
    Var("SPECJAX_ATTN_GENERIC", "int", 0, "attention: 1 runs the generic path instead of AVX-512 (same bits)",
        minimum=0, maximum=1, example="1", read_by="kernel"),
    # ---- JAX
    Var("JAX_PLATFORMS", "str", None, "JAX's backends (cpu, cuda, tpu); one not available here is one error line",
        read_by="jax", shown="unset: JAX picks"),
    Var("XLA_FLAGS", "str", None, "XLA's flags (part of the measurement cache's host key)", read_by="jax"),
)


def declared(name: str) -> Var:
    """The declaration of ``name``; KeyError for a variable not declared here (a programming error)."""
    try:
        return VARS[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in specjax.core.env.VARS") from None


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text of declared variable ``name`` (None: unset)."""
    declared(name)
    return (os.environ if environ is None else environ).get(name)


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of declared variable ``name`` (its default when unset or empty); raises
    :class:`EnvError` for a value it does not accept."""
    return declared(name).parse(raw(name, environ))


def check_all(environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`EnvError` for the first declared variable that is set to a value it does not
    accept (the command line calls this before a command runs)."""
    env = os.environ if environ is None else environ
    for name, var in VARS.items():
        if name in env:
            var.parse(env[name])


def markdown_table() -> str:
    """The README's table of the variables: name, what it accepts, default, help."""
    rows = ["| Variable | Accepts | Default | What it does |", "|---|---|---|---|"]
    for v in VARS.values():
        default = v.shown or ("1" if v.default is True else "0" if v.default is False
                              else "unset" if v.default is None else f"`{v.default}`")
        by = {"kernel": " (read by the C++ kernels)", "jax": " (read by JAX)"}.get(v.read_by, "")
        rows.append(f"| `{v.name}` | {v.accepts()} | {default} | {v.help}{by} |")
    return "\n".join(rows)
