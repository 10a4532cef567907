"""specjax: exact speculative decoding for Llama-family models in JAX/Flax.

Main entry points::

    target = specjax.load_model()                    # embedded SmolLM2-135M-Instruct (GGUF)
    drafter = specjax.load_drafter("ngram:3", target)
    outs = specjax.generate_text(target, ["Hello"], drafter=drafter, gamma=4, chat=True)

Lower level: :mod:`specjax.decode` (token ids in, token ids out), :mod:`specjax.speculative`
(the acceptance step), :mod:`specjax.analysis` (theory: α, E(N), speedup).
"""

__version__ = "0.1.0"

from specjax.config import CheckpointError, ModelConfig, UnsupportedModelError  # noqa: E402
from specjax.loading import Model, load_model  # noqa: E402
from specjax.sampling import SamplingParams  # noqa: E402
from specjax.decode import Decoder, GenerationResult, generate, speculative_generate  # noqa: E402
from specjax.api import encode_prompts, generate_text, load_drafter, read_prompts  # noqa: E402
