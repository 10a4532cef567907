"""specjax: exact speculative decoding for Llama-family models in JAX/Flax.

Main entry points::

    target = specjax.load_model()                    # embedded SmolLM2-135M-Instruct (GGUF)
    drafter = specjax.load_drafter("ngram:3", target)
    outs = specjax.generate_text(target, ["Hello"], drafter=drafter, gamma=4, chat=True)

Lower level: :mod:`specjax.runtime.decoder` (token ids in, token ids out), :mod:`specjax.core.acceptance`
(the acceptance step), :mod:`specjax.eval.theory` (theory: α, E(N), speedup).
"""

import os as _os
import signal as _signal
import sys as _sys


def _interrupted_exit(signum=None, frame=None):
    """The command line's Ctrl+C: keep what was written (flush), say ``specjax: interrupted``, end
    with status 130 at once (:func:`os._exit`: no interpreter shutdown under running XLA threads,
    and no KeyboardInterrupt for JAX's callbacks to swallow)."""
    for stream in (_sys.stdout, _sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # a closed pipe, or a write the signal interrupted
            pass
    try:
        _os.write(2, b"specjax: interrupted\n")
    except OSError:
        pass
    _os._exit(130)


# Run as the `specjax` command, Ctrl+C ends the process from the first import on (importing jax takes
# seconds; a KeyboardInterrupt raised there was a traceback, or was swallowed by a JAX gc callback and
# the run went on). A library import keeps the interpreter's handler; an ignored SIGINT stays ignored.
if _os.path.basename(_sys.argv[0] if _sys.argv else "") == "specjax" \
        and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    _signal.signal(_signal.SIGINT, _interrupted_exit)

from importlib import metadata as _metadata  # noqa: E402

try:  # one source: pyproject.toml's version, as installed
    __version__ = _metadata.version("specjax")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

from specjax.models.config import CheckpointError, ModelConfig, UnsupportedModelError  # noqa: E402
from specjax.io.loading import Model, load_model  # noqa: E402
from specjax.core.sampling import Sampling, SamplingParams  # noqa: E402
from specjax.runtime.decoder import Decoder, GenerationResult, RowStats, generate, speculative_generate  # noqa: E402
from specjax.api import encode_prompts, generate_text, load_drafter  # noqa: E402
from specjax.io.prompts import read_prompts  # noqa: E402
