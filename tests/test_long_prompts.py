"""Long prompts (issue 29): a prompt longer than ``PREFILL_CHUNK`` is prefilled in chunks (memory linear
in the prompt). The chunked prefill gives the full forward's cache and hidden states (float32, ≤ 1e-5),
and greedy speculative decoding equals autoregressive decoding after it, chains and trees, a row alone
equal to the same row in a batch (prompts of 100 and 3,000+ tokens)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from specjax.drafters.ngram import NgramDrafter
from specjax.models import llama
from specjax.runtime import prefill as prefill_mod
from specjax.runtime.decoder import Decoder

LONG = 3100


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, scale=8.0, max_position_embeddings=4096)


def _prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    base = rng.integers(3, 128, size=40).tolist()
    return (base * (n // 40 + 1))[:n]  # repeats: prompt lookup finds n-grams


def test_chunked_prefill_is_the_full_forward(model):
    """The chunks (each writing its K/V before the next attends to them) give the one-call forward's
    hidden states and K/V; the prompt is really chunked (its bucket is a multiple of the chunk)."""
    cfg = model.config
    p = 2048
    assert p > prefill_mod.PREFILL_CHUNK and p % prefill_mod.PREFILL_CHUNK == 0
    toks = jnp.asarray([_prompt(p, 1)], jnp.int32)
    prog = Decoder(model).program(p - 100, 64)  # a prompt of the 2048 bucket
    n = prog.buffer_len
    pos = jnp.arange(p, dtype=jnp.int32)[None]
    want_h, want_cache = llama.forward(model.graphdef, model.params, toks, pos, llama.KVCache.create(cfg, 1, n), cfg)
    got_h, got_cache = prefill_mod.prompt_forward(prog, model.params, toks, llama.KVCache.create(cfg, 1, n))
    np.testing.assert_allclose(np.asarray(got_h), np.asarray(want_h), atol=1e-5)
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        np.testing.assert_allclose(np.asarray(a[:, :, :p]), np.asarray(b[:, :, :p]), atol=1e-5)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("tree", [None, (6, 3, 2)], ids=["chain", "tree"])
def test_long_prompt_speculative_equals_autoregressive_and_batch_invariant(model, tree, fmt):
    """Every weight format (the gate: every offered format, chain and tree, prompts of 100 and 3,000+
    tokens): greedy speculative == autoregressive, a row alone == the same row in the batch."""
    from specjax.io.loading import convert_model

    model = model if fmt == "float32" else convert_model(model, fmt)
    prompts = [_prompt(LONG, 2), _prompt(100, 3), _prompt(LONG + 40, 4)]
    ar = Decoder(model).generate(prompts, max_new_tokens=24, eos_ids=[]).tokens
    kw = {} if tree is None else dict(tree_nodes=tree[0], tree_depth=tree[1], tree_topk=tree[2])
    dec = Decoder(model, NgramDrafter(3), 3, **kw)
    res = dec.generate(prompts, max_new_tokens=24, eos_ids=[])
    assert res.tokens == ar
    assert sum(s["accepted_tokens"] for s in res.stats) > 0
    assert dec.generate([prompts[0]], max_new_tokens=24, eos_ids=[]).tokens[0] == res.tokens[0]
