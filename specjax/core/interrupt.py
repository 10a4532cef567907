"""The command line's Ctrl+C (SIGINT): flush, one line, exit status 130 at once.

Imports only the standard library, so the top-level package can install it before jax loads (importing
jax takes seconds; a KeyboardInterrupt raised there was a traceback, or was swallowed by a JAX gc
callback and the run went on).
"""

import os
import signal
import sys


def interrupted_exit(signum=None, frame=None):
    """Keep what was written (flush), say ``specjax: interrupted``, end with status 130 at once
    (:func:`os._exit`: no interpreter shutdown under running XLA threads, and no KeyboardInterrupt for
    JAX's callbacks to swallow). A SIGINT handler: ``(signum, frame)`` as :func:`signal.signal` passes."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # a closed pipe, or a write the signal interrupted
            pass
    try:
        os.write(2, b"specjax: interrupted\n")
    except OSError:
        pass
    os._exit(130)


def install() -> bool:
    """Make Ctrl+C :func:`interrupted_exit` when the interpreter's default handler is in place (an
    ignored SIGINT stays ignored, a handler someone installed stays) and this is the main thread.
    Returns whether it was installed."""
    import threading
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, interrupted_exit)
    return True
