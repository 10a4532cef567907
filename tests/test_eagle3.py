"""EAGLE-3-style drafters: fused target features, training-time test, and the decode loop with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from specjax.drafters import eagle
from specjax.models import llama


def _drafter(target, feature_layers=(0, 1), copy_ngram=0, seed=3):
    cfg = eagle.EagleConfig.for_target(target.config, 64, 96, copy_ngram=copy_ngram, feature_layers=feature_layers)
    tp = eagle.init_params(cfg, seed)
    tp = jax.tree_util.tree_map(lambda a: a, tp)
    if copy_ngram:  # non-zero copy term, so it matters
        tp["copy_w"] = 0.1 * jnp.ones_like(tp["copy_w"])
        tp["copy_b"] = jnp.arange(1.0, copy_ngram + 1.0)
    params = {"train": tp, "frozen": eagle.frozen_params(target, np.arange(64))}
    return cfg, params


def test_target_features_are_unit_rms_block_outputs():
    target = tiny_model(seed=1)
    cfg = target.config
    toks = jnp.asarray([[3, 5, 7, 9, 11]], jnp.int32)
    pos = jnp.arange(5)[None]
    cache = llama.KVCache.create(cfg, 1, 8, jnp.float32)
    plain = llama.apply(target.graphdef, target.params, toks, pos, cache, cfg, return_hidden=True)
    fused = llama.apply(target.graphdef, target.params, toks, pos, cache, cfg, return_hidden=True,
                        feature_layers=(0, 1))
    assert fused.hidden.shape == (1, 5, 2 * cfg.hidden_size)
    np.testing.assert_array_equal(plain.logits, fused.logits)  # the logits do not change
    rms = jnp.sqrt(jnp.mean(fused.hidden.reshape(1, 5, 2, -1) ** 2, axis=-1))
    assert float(rms.min()) > 0.95 and float(rms.max()) <= 1.0  # unit RMS up to the norm's epsilon
    # the last block's output, normalized, is the final hidden state up to the final norm's weight
    h, _, _ = llama.run_blocks(target.graphdef, target.params, toks, pos, cache, cfg, feature_layers=(1,))
    w = target.params["final_norm"][...]
    np.testing.assert_allclose(fused.hidden[..., cfg.hidden_size:] * w, h, atol=1e-5)


def test_resolve_feature_layers():
    target = tiny_model()
    assert eagle.resolve_feature_layers(None, target.config) == ()
    assert eagle.resolve_feature_layers("0,1", target.config) == (0, 1)
    assert eagle.resolve_feature_layers("eagle3", target.config) == (0, 1)
    with pytest.raises(ValueError, match="not blocks of a 2-block model"):
        eagle.resolve_feature_layers("0,5", target.config)
    with pytest.raises(ValueError, match="comma-separated"):
        eagle.resolve_feature_layers("low,high", target.config)


def test_ttt_step0_is_the_causal_forward():
    target = tiny_model(seed=2)
    cfg, params = _drafter(target)
    rng = np.random.default_rng(0)
    w = 12
    feats = jnp.asarray(rng.standard_normal((2, w, cfg.hidden_size)), jnp.float32)
    toks = jnp.asarray(rng.integers(0, 128, (2, w)), jnp.int32)
    f_ref, _ = eagle.forward(cfg, params, feats, toks, jnp.broadcast_to(jnp.arange(w), (2, w)),
                             eagle.new_cache(cfg, 2, 16))
    (f0,) = eagle.ttt_forward(cfg, params, feats, toks, 1)
    np.testing.assert_allclose(f0, f_ref, atol=2e-5)


def test_ttt_steps_are_the_decode_loops_drafts():
    """Step k at position s equals the (k+1)-th draft of a round: the cache written over true
    features up to s - k, then k one-token calls on the drafter's own features (tokens = the
    true ones), as EagleDrafter.propose runs them."""
    target = tiny_model(seed=2)
    cfg, params = _drafter(target)
    rng = np.random.default_rng(1)
    w, steps = 10, 3
    feats = jnp.asarray(rng.standard_normal((1, w, cfg.hidden_size)), jnp.float32)
    toks = jnp.asarray(rng.integers(0, 128, (1, w)), jnp.int32)
    outs = eagle.ttt_forward(cfg, params, feats, toks, steps)
    fwd = jax.jit(eagle.forward, static_argnums=0)
    for s in (steps, w // 2 + 1, w - 1):
        for k in range(1, steps):
            r = s - k  # position of the round's first draft input (true feature)
            cache = eagle.new_cache(cfg, 1, 16)
            f, cache = fwd(cfg, params, feats[:, : r + 1], toks[:, : r + 1], jnp.arange(r + 1)[None], cache)
            own = f[:, r]
            for i in range(1, k + 1):
                fo, cache = fwd(cfg, params, own[:, None], toks[:, r + i: r + i + 1], jnp.asarray([[r + i]]), cache)
                own = fo[:, 0]
            np.testing.assert_allclose(outs[k][:, s], own, atol=3e-5, err_msg=f"step {k} position {s}")


def _copy_eagle3(target, fmt):
    """A fused-feature drafter with a strong copy term (drafts accepted on repeated text)."""
    cfg = eagle.EagleConfig.for_target(target.config, 64, 32, copy_ngram=3, feature_layers=(0, 1))
    tp = eagle.init_params(cfg, 7)
    tp["copy_b"] = jnp.asarray([6.0, 8.0, 10.0], jnp.float32)
    params = {"train": tp, "frozen": eagle.frozen_params(target, np.arange(0, 128, 2, dtype=np.int32))}
    if fmt == "int8":
        params = eagle.quantize_params(params)
    return eagle.EagleDrafter(cfg, params, name=f"eagle3-{fmt}")


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_greedy_speculative_equals_autoregressive_fused_features(fmt):
    """Greedy decoding with a fused-feature drafter (chains γ 1 and 3, an EAGLE-2 tree) gives the
    autoregressive tokens, with drafts accepted (the copy term on a repeating prompt)."""
    from specjax.runtime.decoder import Decoder
    from test_formats import convert

    target = tiny_model(seed=0, scale=6.0)
    if fmt != "float32":
        target = convert(target, fmt)
    drafter = _copy_eagle3(target, fmt)
    rng = np.random.default_rng(4)
    base = rng.integers(2, 128, 7).tolist()
    prompts = [base * 3, rng.integers(2, 128, 11).tolist(), base * 2 + [5]]
    ref = Decoder(target).generate(prompts, max_new_tokens=24, eos_ids=[]).tokens
    accepted = 0
    for kw in (dict(gamma=1), dict(gamma=3), dict(tree_nodes=6, tree_depth=3, tree_topk=2)):
        res = Decoder(target, drafter, **kw).generate(prompts, max_new_tokens=24, eos_ids=[])
        assert res.tokens == ref, f"{fmt} {kw}: speculative ≠ autoregressive"
        accepted += sum(s["accepted_tokens"] for s in res.stats)
    assert accepted > 10, "the drafts must be accepted sometimes for the test to mean anything"


def test_saved_fused_drafter_round_trips(tmp_path):
    """save_drafter / load_drafter keep the feature layers and the fused projection; a
    directory whose weights lack ``fuse`` is refused in one line."""
    from specjax.models.config import CheckpointError

    target = tiny_model(seed=0)
    cfg, params = _drafter(target, copy_ngram=3)
    eagle.save_drafter(str(tmp_path / "d"), cfg, params["train"], np.arange(64), target)
    d = eagle.load_drafter(str(tmp_path / "d"), target)
    assert d.config.feature_layers == (0, 1) and d.config.feature_size == 2 * target.config.hidden_size
    for k in ("fuse", "fc", "copy_w"):
        np.testing.assert_array_equal(d.params["train"][k], params["train"][k])
    from safetensors.numpy import load_file, save_file

    t = load_file(str(tmp_path / "d" / "model.safetensors"))
    del t["fuse"]
    save_file(t, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no 'fuse'"):
        eagle.load_drafter(str(tmp_path / "d"), target)


def test_analysis_measures_a_fused_feature_drafter():
    """`specjax analyze`'s measurements take the fused features a drafter reads: α (teacher-forced,
    per-position proposals) and the costs (draft call, target call, tree proposal)."""
    from specjax.core.drafting import TreeShape
    from specjax.eval import measure

    target = tiny_model(seed=0, scale=6.0)
    drafter = _copy_eagle3(target, "float32")
    rng = np.random.default_rng(0)
    base = rng.integers(2, 128, 6).tolist()
    recs = measure.prompt_records([{"ids": base * 2, "category": "a"}, {"ids": base + [9], "category": "b"}])
    conts = [base * 2, base[:5]]
    al = measure.measure_alpha(target, drafter, recs, conts, temperature=0.7)
    assert al["positions"] == 17 and 0 < al["alpha"] < 1 and set(al["by_category"]) == {"a", "b"}
    costs = measure.measure_costs(target, drafter, [2], prompt_len=16, max_new_tokens=16, repeats=1, warmup=1,
                                  trees=[TreeShape(6, 3, 2)])
    assert costs["c"][0] > 0 and costs["trees"]["6x3x2"]["c_tree"] > 0, costs
