"""The command line's one-line messages (part of :mod:`specjax.cli.common`, which re-exports
them): :class:`UsageError`, the parser whose errors are one line, ``specjax: note:`` lines, and
the one-line text of every user error (:func:`describe_error`)."""

from __future__ import annotations

import argparse
import json
import re
import sys

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
    """Exception types ``main()`` reports as one line: usage, checkpoint and file-format errors
    (all ValueError subclasses: JSON, TOML, UnicodeDecodeError), OS errors, SafetensorError."""
    types = [UsageError, ValueError, CheckpointError, OSError]
    try:
        from safetensors import SafetensorError

        types.append(SafetensorError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)
