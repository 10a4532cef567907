"""specjax: exact speculative decoding for Llama-family models in JAX/Flax.

Main entry points::

    target = specjax.load_model()                    # embedded SmolLM2-135M-Instruct (GGUF)
    drafter = specjax.load_drafter("ngram:3", target)
    outs = specjax.generate_text(target, ["Hello"], drafter=drafter, gamma=4, chat=True)

Lower level: :mod:`specjax.runtime.decoder` (token ids in, token ids out), :mod:`specjax.core.acceptance`
(the acceptance step), :mod:`specjax.eval.theory` (theory: α, E(N), speedup).
"""

import os as _os
import sys as _sys

from specjax.core import interrupt as _interrupt

# Run as the `specjax` command, Ctrl+C ends the process from the first import on (importing jax takes
# seconds). A library import keeps the interpreter's handler; an ignored SIGINT stays ignored.
if _os.path.basename(_sys.argv[0] if _sys.argv else "") == "specjax":
    _interrupt.install()

from importlib import metadata as _metadata  # noqa: E402

try:  # one source: pyproject.toml's version, as installed
    __version__ = _metadata.version("specjax")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

from specjax.models.config import CheckpointError, ModelConfig, UnsupportedModelError  # noqa: E402
from specjax.io.loading import Model, load_model  # noqa: E402
from specjax.core.sampling import Sampling, SamplingParams  # noqa: E402
from specjax.runtime.decoder import Decoder, GenerationResult, RowStats, generate, speculative_generate  # noqa: E402
from specjax.runtime.request import Request  # noqa: E402
from specjax.api import encode_prompts, generate_text, load_drafter  # noqa: E402
from specjax.io.prompts import read_prompts  # noqa: E402
