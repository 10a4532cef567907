"""Published EAGLE-3 heads (EAGLE authors / SpecForge / AngelSlim layout) as specjax drafters
(:mod:`specjax.drafters.eagle3_head`): a PyTorch reference forward written here from the published
structure gives the drafter's q over the target vocabulary; greedy speculative decoding with the
head equals autoregressive decoding (chain and tree); bad heads are one-line errors."""

from __future__ import annotations

import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import tiny_model
from safetensors.torch import save_file

from specjax import api, cli
from specjax.core.drafting import DraftContext
from specjax.core.sampling import SamplingParams
from specjax.drafters import registry
from specjax.drafters.eagle3_head_files import resolve_layers
from specjax.io import loading
from specjax.models import llama
from specjax.models.config import CheckpointError

LAYERS = [1, 2, 3]  # hidden-state indices (inputs of layers 1..3) of the 4-layer tiny target
HEAD = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5,
            rope_theta=50000.0, draft_vocab_size=48)


def head_target(**kw):
    """The 4-layer tiny target the published heads here are written for."""
    return tiny_model(seed=0, num_layers=4, **kw)


def write_head(path, target, seed=0, vocab=None, hidden=None, pickle_only=False, embed=True, weights=None,
               **cfg_kw):
    """A random head saved under the published names (``config.json`` + ``model.safetensors``);
    ``weights(w)`` may change the tensors, ``cfg_kw`` the config."""
    g = torch.Generator().manual_seed(seed)
    hc = {**HEAD, **cfg_kw}
    d, v = hc["hidden_size"], vocab or target.config.vocab_size
    dt, nh, kv, f, s = hidden or d, hc["num_attention_heads"], hc["num_key_value_heads"], \
        hc["intermediate_size"], hc["draft_vocab_size"]
    hd = d // nh
    r = lambda *shape, std=0.1: std * torch.randn(*shape, generator=g)  # noqa: E731
    w = {"fc.weight": r(d, len(LAYERS) * dt, std=0.05), "midlayer.input_layernorm.weight": 1 + r(d),
         "midlayer.hidden_norm.weight": 1 + r(d), "midlayer.self_attn.q_proj.weight": r(nh * hd, 2 * d, std=0.2),
         "midlayer.self_attn.k_proj.weight": r(kv * hd, 2 * d, std=0.2),
         "midlayer.self_attn.v_proj.weight": r(kv * hd, 2 * d), "midlayer.self_attn.o_proj.weight": r(d, nh * hd),
         "midlayer.post_attention_layernorm.weight": 1 + r(d), "midlayer.mlp.gate_proj.weight": r(f, d),
         "midlayer.mlp.up_proj.weight": r(f, d), "midlayer.mlp.down_proj.weight": r(d, f),
         "norm.weight": 1 + r(d), "lm_head.weight": r(s, d, std=1.0)}
    t_ids = torch.sort(torch.randperm(v, generator=g)[:s]).values
    w["d2t"] = t_ids - torch.arange(s)
    w["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill(0, t_ids, True)
    if embed:
        w["embed_tokens.weight"] = r(v, d, std=1.0)
    if weights is not None:
        weights(w)
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
           "vocab_size": v, "hidden_act": "silu", "eagle_config": {"eagle_aux_hidden_state_layer_ids": LAYERS},
           **hc}
    if hidden:
        cfg["target_hidden_size"] = hidden
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    if pickle_only:
        torch.save(w, os.path.join(path, "pytorch_model.bin"))
    else:
        save_file(w, os.path.join(path, "model.safetensors"))
    return str(path), w


# --------------------------------------------------------------------------- the PyTorch reference
def _rms(x, w, eps=HEAD["rms_norm_eps"]):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, theta=HEAD["rope_theta"]):
    t, hd = x.shape[0], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.cat([torch.arange(t, dtype=torch.float64)[:, None] * inv] * 2, -1)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * ang.cos().float()[:, None] + torch.cat([-x2, x1], -1) * ang.sin().float()[:, None]


def ref_midlayer(w, hidden, tokens, embed):
    """The published head's layer over a whole sequence (positions 0..T−1, causal): ``hidden [T, D]``
    the h inputs, ``tokens [T]`` the paired tokens; returns the pre-norm outputs ``[T, D]``."""
    t, nh, kv = len(tokens), HEAD["num_attention_heads"], HEAD["num_key_value_heads"]
    hd = HEAD["hidden_size"] // nh
    z = torch.cat([_rms(embed[tokens], w["midlayer.input_layernorm.weight"]),
                   _rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
    q = _rope((z @ w["midlayer.self_attn.q_proj.weight"].T).view(t, nh, hd))
    k = _rope((z @ w["midlayer.self_attn.k_proj.weight"].T).view(t, kv, hd)).repeat_interleave(nh // kv, 1)
    v = (z @ w["midlayer.self_attn.v_proj.weight"].T).view(t, kv, hd).repeat_interleave(nh // kv, 1)
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    a = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(t, nh * hd)
    h = hidden + a @ w["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"])
    return h + (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T)
                * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T


def ref_q(w, o, vocab):
    """q over the target vocabulary at temperature 1: lm_head(norm(o)) scattered through d2t."""
    logits = _rms(o, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((vocab,), float("-inf"))
    full[torch.arange(len(w["d2t"])) + w["d2t"]] = logits
    return full.softmax(-1)


def ref_round(w, g, tokens, drafts, vocab, embed):
    """The reference's q of each draft of a round: the committed entries ``(g_s, x_{s+1})`` and then
    each draft fed back with the previous pre-norm output as its hidden state."""
    hidden, toks, qs = g, list(tokens), []
    for i in range(len(drafts) + 1):
        o = ref_midlayer(w, hidden, torch.tensor(toks), embed)
        qs.append(ref_q(w, o[-1], vocab))
        if i < len(drafts):
            hidden, toks = torch.cat([hidden, o[-1:]]), toks + [drafts[i]]
    return torch.stack(qs[:-1] if drafts else qs)


def hf_features(tdir, seqs):
    """The target's raw streams at the head's layers for each sequence, from Hugging Face
    transformers (``output_hidden_states``: index i = the input of layer i)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tdir, dtype=torch.float32)
    with torch.no_grad():
        return [torch.cat([hs[i][0] for i in LAYERS], -1)
                for hs in (model(torch.tensor([ids]), output_hidden_states=True).hidden_states for ids in seqs)]


def _features(target, drafter, tokens):
    """The features the decode loop hands the drafter (the prefill's call, :mod:`specjax.runtime.prefill`:
    the blocks the drafter declares, raw or not as it declares)."""
    return _features_jit(target.graphdef, target.config, drafter.feature_layers, drafter.raw_features,
                         target.params, tokens)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _features_jit(graphdef, cfg, feature_layers, raw, params, tokens):
    b, t = tokens.shape
    cache = llama.KVCache.create(cfg, b, t, jnp.float32)
    feats, _ = llama.forward(graphdef, params, tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), cache, cfg,
                             feature_layers=feature_layers, raw_features=raw)
    return feats


# --------------------------------------------------------------------------- (a) the gate
def test_head_q_equals_the_published_reference(tmp_path):
    """Two rounds of a chain of 3 at temperature 1 (rows of different prompt lengths): every q over
    the target vocabulary equals the PyTorch reference's within 1e-5 — the raw target streams of
    the right layers, the fed-back pre-norm output, the draft→target id map."""
    target = head_target()
    tdir = loading.save_model(target, str(tmp_path / "target"))
    hdir, w = write_head(tmp_path / "head", target)
    drafter = api.load_drafter(hdir, target)
    assert registry.kind_of(hdir).name == "eagle3-head" and drafter.feature_layers == (0, 1, 2)
    v, gamma, buf = target.config.vocab_size, 3, 32
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, v, 7).tolist(), rng.integers(2, v, 5).tolist()]
    width = max(map(len, prompts)) + gamma  # the prefill's bucket (stale features past a prompt are never read)
    toks = np.zeros((2, buf), np.int32)
    for i, pr in enumerate(prompts):
        toks[i, :len(pr)] = pr
    lengths = jnp.asarray([len(pr) for pr in prompts], jnp.int32)
    sp = SamplingParams.create(2, temperature=1.0)
    feats = _features(target, drafter, jnp.asarray(toks[:, :width]))
    init = jax.jit(drafter.init_state, static_argnums=2)
    propose = jax.jit(drafter.propose, static_argnums=(4, 5))
    state = init(drafter.params, DraftContext(jnp.asarray(toks), lengths, sp, feats, jnp.zeros(2, jnp.int32)), buf)
    zeros = jnp.zeros((2, gamma + 1, 3 * target.config.hidden_size), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(1), 2 * gamma).reshape(2, gamma, 2)
    prop = propose(drafter.params, state, DraftContext(jnp.asarray(toks), lengths, sp, zeros, jnp.zeros(2, jnp.int32)),
                   keys, gamma, v)
    drafts = np.asarray(prop.tokens)
    # round 2: the first draft accepted, then bonus token 5; the target's call was [x_{P-1}, drafts]
    seqs = [pr + drafts[i].tolist() for i, pr in enumerate(prompts)]
    toks_seq = np.zeros((2, width), np.int32)
    for i, sq in enumerate(seqs):
        toks_seq[i, :len(sq)] = sq
    f2 = _features(target, drafter, jnp.asarray(toks_seq))
    bonus, toks2, hid2, refs = 5, toks.copy(), [], []
    embed = w["embed_tokens.weight"]
    for i, (pr, g_hf) in enumerate(zip(prompts, hf_features(tdir, seqs))):
        g_hf = g_hf @ w["fc.weight"].T  # [len(seq), D]
        ref1 = ref_round(w, g_hf[: len(pr) - 1], pr[1:], drafts[i].tolist(), v, embed)
        np.testing.assert_allclose(np.asarray(prop.probs[i]), ref1.numpy(), atol=1e-5, err_msg=f"round 1 row {i}")
        toks2[i, len(pr):len(pr) + 2] = [drafts[i, 0], bonus]
        hid2.append(f2[i, len(pr) - 1:len(pr) + gamma])
        refs.append((g_hf[: len(pr) + 1], pr[1:] + [int(drafts[i, 0]), bonus]))
    ctx2 = DraftContext(jnp.asarray(toks2), lengths + 2, sp, jnp.stack(hid2), jnp.ones(2, jnp.int32))
    prop2 = propose(drafter.params, prop.state, ctx2, keys, gamma, v)
    for i, (g, t) in enumerate(refs):
        ref2 = ref_round(w, g, t, np.asarray(prop2.tokens[i]).tolist(), v, embed)
        np.testing.assert_allclose(np.asarray(prop2.probs[i]), ref2.numpy(), atol=1e-5, err_msg=f"round 2 row {i}")


# --------------------------------------------------------------------------- (b) the decode loop
def test_greedy_speculative_equals_autoregressive_with_a_head(tmp_path):
    """Greedy decoding with a published head (chain γ 3 and an EAGLE-2 tree) gives the
    autoregressive tokens."""
    from specjax.runtime.decoder import Decoder

    target = head_target(scale=6.0)
    v = target.config.vocab_size
    lm_head = np.asarray(target.params["lm_head"][...], np.float32)
    lm_head = lm_head.T if lm_head.shape[0] != v else lm_head

    def guess_next(w):
        """A head that drafts something: attention on its own position, which passes the current
        token's normed embedding through, read by the target's head (the peaked tiny target is
        nearly a bigram model)."""
        eye = torch.cat([torch.eye(64), torch.zeros(64, 64)], 1)  # [64, 2D]: the embedding half of z
        w.update({"fc.weight": torch.zeros_like(w["fc.weight"]), "midlayer.self_attn.q_proj.weight": 3 * eye,
                  "midlayer.self_attn.k_proj.weight": 3 * eye, "midlayer.self_attn.v_proj.weight": eye,
                  "midlayer.self_attn.o_proj.weight": torch.eye(64),
                  "midlayer.mlp.down_proj.weight": torch.zeros_like(w["midlayer.mlp.down_proj.weight"]),
                  "norm.weight": torch.tensor(np.asarray(target.params["final_norm"][...])),
                  "lm_head.weight": torch.tensor(np.ascontiguousarray(lm_head)), "d2t": torch.zeros(v, dtype=torch.int64)})

    hdir, _ = write_head(tmp_path / "head", target, seed=1, embed=False, weights=guess_next, num_key_value_heads=4,
                         draft_vocab_size=v)
    drafter = api.load_drafter(hdir, target)
    rng = np.random.default_rng(4)
    base = rng.integers(2, 128, 7).tolist()
    prompts = [base * 3, rng.integers(2, 128, 11).tolist(), [9]]  # [9]: a one-token prompt
    ref = Decoder(target).generate(prompts, max_new_tokens=16, eos_ids=[]).tokens
    accepted = 0
    for kw in (dict(gamma=3), dict(tree_nodes=6, tree_depth=3, tree_topk=2)):
        res = Decoder(target, drafter, **kw).generate(prompts, max_new_tokens=16, eos_ids=[])
        assert res.tokens == ref, f"{kw}: speculative ≠ autoregressive"
        accepted += sum(s["accepted_tokens"] for s in res.stats)
    assert accepted > 10, f"the drafts must be accepted sometimes for the test to mean anything ({accepted})"


# --------------------------------------------------------------------------- (c) one-line errors
@pytest.fixture
def _cli_env(monkeypatch):
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    monkeypatch.setenv("SPECJAX_NO_PROGRESS", "1")
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)


def test_bad_heads_are_one_line_errors(tmp_path, capsys, monkeypatch, _cli_env):
    """A pickle-only head (names the conversion) and an unknown variant are refused before the
    target loads; a vocabulary or hidden-size mismatch when the head meets the target."""
    from test_bad_inputs import one_line_error

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the head was checked")

    target = head_target()
    pkl, _ = write_head(tmp_path / "pkl", target, pickle_only=True)
    variant, _ = write_head(tmp_path / "variant", target, architectures=["Eagle3Speculator"],
                            speculators_config={"algorithm": "eagle3"})
    layers2, _ = write_head(tmp_path / "layers2", target, num_hidden_layers=2)
    with monkeypatch.context() as m:
        m.setattr(loading, "load_model", no_load)
        m.setattr(api, "load_model", no_load)
        line = one_line_error(capsys, cli.main(["generate", "hi", "--draft", pkl]),
                              ["pytorch_model.bin", "pickle", "safetensors", "python -c"])
        assert "weights_only=True" in line and f"{os.path.abspath(pkl)}/model.safetensors" in line
        one_line_error(capsys, cli.main(["generate", "hi", "--draft", variant]), ["not supported", "speculators"])
        one_line_error(capsys, cli.main(["generate", "hi", "--draft", layers2]), ["num_hidden_layers=2"])
    for kw, words in ((dict(vocab=96), "96-token vocabulary"), (dict(hidden=32), "hidden size 32")):
        bad, _ = write_head(tmp_path / f"bad{len(os.listdir(tmp_path))}", target, **kw)
        with pytest.raises(CheckpointError, match=words) as e:
            api.load_drafter(bad, target)
        assert "\n" not in str(e.value)


def test_default_layers_follow_the_reference():
    """(2, N // 2, N − 3) as hidden-state indices (the input of layer i) → block outputs i − 1."""
    assert resolve_layers(None, {}, 32) == (1, 15, 28)
    assert resolve_layers(None, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, 4) == (0, 1, 2)
    assert resolve_layers([3, 5, 7], {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, 8) == (2, 4, 6)
    with pytest.raises(CheckpointError, match="use 1..3"):
        resolve_layers([0, 2, 3], {}, 4)


def test_a_hub_id_that_is_a_head_loads_as_a_head(tmp_path, monkeypatch):
    """A pair config names heads by hub id (``draft = "org/head"``): the id is fetched (here: the local
    hub cache is a directory the test wrote) and the directory's own kind, the published head, loads it."""
    from specjax import api
    from specjax.drafters.eagle3_head import Eagle3HeadDrafter
    from specjax.io import hf

    target = head_target()
    head, _ = write_head(tmp_path / "snapshot", target)
    asked = []
    monkeypatch.setattr(hf, "resolve_hub", lambda hub_id: asked.append(hub_id) or str(head))
    d = api.load_drafter("someone/EAGLE3-tiny", target)
    assert asked == ["someone/EAGLE3-tiny"] and isinstance(d, Eagle3HeadDrafter)
