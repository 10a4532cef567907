"""``specjax`` command line: one module per command (:mod:`~specjax.cli.generate`,
:mod:`~specjax.cli.bench`, :mod:`~specjax.cli.analyze`, :mod:`~specjax.cli.distill`,
:mod:`~specjax.cli.serve`, :mod:`~specjax.cli.plan`), shared
argument handling in :mod:`~specjax.cli.common`. Nothing outside this package imports it.

Errors in the user's input print one line ``specjax: error: …`` (what was wrong and
how to fix it) and exit with status 2, without a traceback.
"""

from __future__ import annotations

import os
import sys

from specjax.core import env, interrupt
from specjax.cli import analyze, bench, distill, generate, plan, serve
from specjax.cli.common import (  # noqa: F401  (the shared helpers, for scripts and tests)
    UsageError, Parser, user_errors, add_model_args, collect_prompts, describe_error, enable_compilation_cache,
    load_target_and_drafter, note, parse_gamma, resolve,
)
from specjax.cli.errors import backend_error
from specjax.cli.generate import unescape  # noqa: F401

COMMANDS = (generate, bench, analyze, distill, serve, plan)


def build_parser() -> Parser:
    """The ``specjax`` parser with every command's subparser."""
    parser = Parser(prog="specjax", description="Exact speculative decoding in JAX.")
    from importlib import metadata

    try:
        version = metadata.version("specjax")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    parser.add_argument("--version", action="version", version=f"specjax {version}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register_cli(sub)
    return parser


def main(argv=None) -> int:
    """Run the command line; a user error is one line ``specjax: error: …`` and exit status 2
    (``SPECJAX_DEBUG=1`` re-raises it with its traceback). Before the command runs, every declared
    environment variable that is set is checked (:func:`specjax.core.env.check_all`: a bad value is
    such a line); a backend that ``JAX_PLATFORMS`` names but JAX cannot start is one too
    (:func:`specjax.cli.errors.backend_error`).

    Ctrl+C (SIGINT) prints ``specjax: interrupted``, keeps the text already streamed (stdout is
    flushed) and exits with status 130. Run as the ``specjax`` command (``argv is None``), the
    process then ends at once with :func:`os._exit`: a compilation or computation XLA is still
    running on its own threads would otherwise crash the interpreter's shutdown (SIGSEGV).
    """
    if argv is None:
        interrupt.install()  # Ctrl+C: exit 130 at once, wherever it lands
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            hint = ""
            if args.command == "generate" and not any(x.startswith("-") for x in extra):
                hint = '; a prompt of several words needs quotes: specjax generate "Write a haiku"'
            parser.exit(2, f"specjax: error: unrecognized arguments: {' '.join(extra)}{hint} "
                           f"(see `specjax {args.command} --help`)\n")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    from specjax.runtime import programs

    try:
        env.check_all()
        if not env.get("SPECJAX_NO_CACHE") and enable_compilation_cache():
            programs.enable()  # exported programs next to the compilation cache: warm starts skip tracing
        return args.func(args) or 0
    except BrokenPipeError:  # the reader of stdout went away (`specjax generate … | head`): stop quietly
        _silence_stdout()
        return 141  # 128 + SIGPIPE, as a Unix tool killed by it
    except user_errors() as e:
        if _debug():
            raise
        msg = " ".join(describe_error(e).split())  # one line, whatever the raiser wrote
        print(f"specjax: error: {msg}", file=sys.stderr)
        return 2
    except (AssertionError, RuntimeError) as e:  # JAX could not start the backend JAX_PLATFORMS names
        line = backend_error(e)
        if line is None or _debug():
            raise
        print(f"specjax: error: {' '.join(line.split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specjax: interrupted", file=sys.stderr)
        if argv is None:
            _exit_now(130)
        return 130
    finally:
        programs.disable()
        for kernel in ("specjax.models.q8", "specjax.models.cpu_attention"):
            if kernel in sys.modules:
                sys.modules[kernel].join_build()


def _debug() -> bool:
    """``SPECJAX_DEBUG`` is on (a value it does not accept counts as off: that error is the one shown)."""
    try:
        return bool(env.get("SPECJAX_DEBUG"))
    except env.EnvError:
        return False


def _exit_now(status: int) -> None:
    """Flush what was written and end the process without the interpreter's shutdown (which
    tears down JAX while XLA threads may still run)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be kept
            pass
    os._exit(status)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush of text still buffered
    for a closed pipe raises nothing (Python docs, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # a stdout without a file descriptor (tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
