"""The command line's one-line messages (part of :mod:`specjax.cli.common`, which re-exports
them): :class:`UsageError`, the parser whose errors are one line, ``specjax: note:`` lines, the
one-line text of every user error (:func:`describe_error`; a bad environment variable is one:
:class:`specjax.core.env.EnvError`) and of a backend that ``JAX_PLATFORMS`` names but JAX cannot
start here (:func:`backend_error`)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import traceback

from specjax.core import env
from specjax.core.env import EnvError
from specjax.core.notes import note  # noqa: F401  (re-exported: one stderr line ``specjax: note: …``)
from specjax.models.config import CheckpointError


class UsageError(ValueError):
    """A bad command-line value (reported as one line, exit status 2)."""


class Parser(argparse.ArgumentParser):
    """argparse errors as one line ``specjax: error: …`` (exit status 2) naming the command and
    pointing at ``--help``, instead of a usage block (subparsers inherit this class). A flag
    whose value starts with ``-`` (``--device-memory -5GiB``: argparse takes the value for a flag)
    gets the hint to write ``--flag=VALUE``, and what the flag's ``check`` (an attribute a command
    may set on the argument: a function raising ValueError) says of that value."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message):
        self.exit(2, f"specjax: error: {message}{self._dash_value_hint(message)} (see `{self.prog} --help`)\n")

    def _dash_value_hint(self, message: str) -> str:
        m = re.fullmatch(r"argument (\S+): expected one argument", message)
        argv = getattr(self, "_argv", [])
        if not m:
            return ""
        for flag in m.group(1).split("/"):
            i = argv.index(flag) if flag in argv else -1
            if 0 <= i < len(argv) - 1 and argv[i + 1].startswith("-"):
                value = argv[i + 1]
                hint = f"; a value starting with '-' must be written {flag}={value}"
                check = getattr(self._option_string_actions.get(flag), "check", None)
                try:
                    if check is not None:
                        check(value)
                except ValueError as e:
                    hint += f", but that value is refused too: {e}"
                return hint
        return ""


def describe_error(e: BaseException) -> str:
    """The one-line text of a user-facing error: OS errors name the path and say what to do;
    file-format errors (not UTF-8, bad TOML/JSON, a corrupt safetensors file) name the file
    where the raiser did not."""
    import tomllib

    if isinstance(e, OSError) and e.filename is not None and not isinstance(e, FileNotFoundError):
        path = e.filename
        fix = {
            IsADirectoryError: "it is a directory; give a file",
            NotADirectoryError: "a part of the path is a file, not a directory; choose another path",
            PermissionError: "permission denied; choose a path you may read/write or fix its permissions",
            FileExistsError: "it already exists; choose another path",
        }.get(type(e), f"{e.strerror or e}")
        return f"{path}: {fix}"
    if isinstance(e, FileNotFoundError) and e.filename is not None:
        return f"{e.filename}: no such file or directory; check the path"
    if isinstance(e, UnicodeDecodeError):
        return f"input is not valid UTF-8 ({e.reason} at byte {e.start}); save it as UTF-8"
    if isinstance(e, tomllib.TOMLDecodeError):
        return f"not valid TOML ({e}); fix the syntax"
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix the syntax"
    if type(e).__name__ == "SafetensorError":
        return f"a safetensors file is truncated or corrupt ({e}); re-download or re-save the checkpoint"
    return str(e)


def user_errors() -> tuple:
    """Exception types ``main()`` reports as one line: usage, environment-variable, checkpoint and
    file-format errors (all ValueError subclasses: JSON, TOML, UnicodeDecodeError), OS errors,
    SafetensorError."""
    types = [UsageError, EnvError, ValueError, CheckpointError, OSError]
    try:
        from safetensors import SafetensorError

        types.append(SafetensorError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


_JAX_INIT = re.compile(r"Unable to initialize backend '([^']+)': (.*?)(?: \(set JAX_PLATFORMS=.*\))?\s*$", re.S)
_INSTALL = {"cuda": "install jax[cuda12]", "rocm": "install jax[rocm]", "tpu": "install jax[tpu]"}


def _cuda_missing() -> str:
    """Why JAX has no CUDA backend here: no NVIDIA GPU visible and/or no CUDA plugin installed."""
    from importlib import metadata

    why = []
    try:
        from jax._src import hardware_utils

        if not hardware_utils.has_visible_nvidia_gpu():
            why.append("no NVIDIA GPU is visible")
    except (ImportError, AttributeError, OSError):  # another jax: say only what is known
        pass
    plugins = []
    for dist in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        try:
            metadata.version(dist)
            plugins.append(dist)
        except metadata.PackageNotFoundError:
            pass
    if not plugins:
        why.append("no jax CUDA plugin is installed")
    return " and ".join(why) or "JAX found no CUDA device"


def backend_error(e: BaseException) -> str | None:
    """The one line for JAX failing to start a backend that ``JAX_PLATFORMS`` names (``cuda`` on a
    host without CUDA: JAX skips it and fails a bare ``assert``; ``tpu`` without libtpu: a
    RuntimeError), naming the variable, the cause and the fix; None when ``e`` is not that."""
    platforms = (env.get("JAX_PLATFORMS") or "").strip()
    if not platforms:
        return None
    if isinstance(e, AssertionError):
        frames = traceback.extract_tb(e.__traceback__)
        if not frames or not frames[-1].filename.replace("\\", "/").endswith("jax/_src/xla_bridge.py"):
            return None
        names = [p.strip().lower() for p in platforms.split(",") if p.strip()]
        if any(n in ("cuda", "gpu") for n in names):
            return (f"JAX_PLATFORMS={platforms} but no CUDA backend is available here ({_cuda_missing()}); "
                    "unset JAX_PLATFORMS (or set JAX_PLATFORMS=cpu) or install jax[cuda12] on a host with an NVIDIA GPU")
        return (f"JAX_PLATFORMS={platforms} but JAX started none of its backends here; "
                "unset JAX_PLATFORMS or set JAX_PLATFORMS=cpu")
    if isinstance(e, RuntimeError):
        m = _JAX_INIT.search(str(e))
        if m is None:
            return None
        name, cause = m.group(1), " ".join(m.group(2).split())
        fix = _INSTALL.get(name, "name a backend this jax has")
        if "gpu" in [p.strip().lower() for p in platforms.split(",")]:  # jax reads gpu as cuda, then rocm
            fix = "install jax[cuda12] (NVIDIA) or jax[rocm] (AMD)"
        return (f"JAX_PLATFORMS={platforms} but JAX cannot start the {name} backend here ({cause}); "
                f"unset JAX_PLATFORMS (or set JAX_PLATFORMS=cpu) or {fix}")
    return None
