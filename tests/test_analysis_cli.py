"""``specjax analyze`` and :mod:`specjax.eval.measure`: the theory as a tool.

The gate (``test_gate_mean_accepted_tokens_matches_expected_tokens``): on a synthetic
pair whose acceptance probability β is the same at every position by construction,
the real decode loop's ``mean_accepted_tokens`` matches E(N) = (1 − β^{γ+1})/(1 − β)
(Leviathan et al. 2023, Eq. 1) within a stated sampling error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.eval import theory as analysis
from specjax.eval import measure
from specjax.cli import main
from specjax.runtime.decoder import Decoder, host_result
from specjax.drafters.model import ModelDrafter
from specjax.io.loading import Model
from specjax.models import llama
from specjax.core.sampling import SamplingParams
from specjax.runtime.settings import DecodeSettings

from conftest import tiny_config, tiny_model


def run_cli(capsys, *argv):
    os.environ.setdefault("SPECJAX_NO_CACHE", "1")  # tests use conftest's compilation cache
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------- (1) numbers only
def test_numbers_only_reproduces_worked_example(capsys):
    rc, out, _ = run_cli(capsys, "analyze", "--alpha", "0.8", "--c", "0.02", "--json")
    assert rc == 0
    rep = json.loads(out)
    rows = {r["gamma"]: r for r in rep["table"]}
    assert set(rows[1]) >= {"gamma", "expected_tokens", "cost", "speedup", "speedup_textbook"}
    assert round(rows[10]["speedup"], 2) == 3.81
    assert round(rows[10]["expected_tokens"], 2) == 4.57
    assert rows[10]["cost"] == pytest.approx(1.2)
    assert rows[10]["speedup"] == rows[10]["speedup_textbook"]  # no v: textbook
    assert rep["optimal_gamma"] == 11
    assert round(rep["optimal_speedup"], 3) == 3.817
    assert rep["oracle_bound"] == pytest.approx(5.0)
    # human output: a markdown table with the same numbers
    rc, out, _ = run_cli(capsys, "analyze", "--alpha", "0.8", "--c", "0.02")
    assert rc == 0 and "| 10 | 4.571 | 1.200 | 3.809 | 3.809 |" in out and "optimal γ = 11" in out


def test_numbers_only_with_measured_v(capsys):
    rc, out, _ = run_cli(capsys, "analyze", "--alpha", "0.8", "--c", "0.02", "--v", "1.16", "1.3", "1.37", "--json")
    rep = json.loads(out)
    assert rc == 0 and [r["gamma"] for r in rep["table"]] == [1, 2, 3]
    assert rep["table"][1]["cost"] == pytest.approx(2 * 0.02 + 1.3)
    assert rep["table"][1]["speedup"] == pytest.approx(analysis.speedup(0.8, 2, 0.02, 1.3))
    assert rep["optimal_gamma"] == 3 and rep["optimal_gamma_textbook"] == 11


@pytest.mark.parametrize("argv, msg", [
    (["--alpha", "1.5", "--c", "0.1"], "--alpha must be in [0, 1]"),
    (["--alpha", "0.5"], "--alpha needs --c"),
    (["--c", "0.1"], "need --alpha"),
    (["--alpha", "0.5", "--c", "-1"], "--c must be finite and >= 0"),
    (["--alpha", "0.5", "--c", "0.1", "--v", "1", "0"], "--v values must be finite and > 0"),
    (["--alpha", "0.5", "--c", "0.1", "--v", "1", "2", "--gamma-max", "5"], "needs 5 --v values"),
    (["--alpha", "0.5", "--c", "0.1", "--gamma-max", "0"], "--gamma-max must be >= 1"),
])
def test_numbers_only_errors_are_one_liners(capsys, argv, msg):
    rc, out, err = run_cli(capsys, "analyze", *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("specjax: error: ") and msg in err


# --------------------------------------------------------------------------- (5) plot
def test_plot_writes_png(capsys, tmp_path):
    path = tmp_path / "speedup.png"
    rc, out, _ = run_cli(capsys, "analyze", "--alpha", "0.7", "--c", "0.05", "--plot", str(path), "--json")
    assert rc == 0 and json.loads(out)["plot"] == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


# --------------------------------------------------------------------------- (2) the gate
def constant_model(support: range, vocab: int = 128, seed: int = 0, name: str = "const") -> Model:
    """A 1-layer tiny Llama whose next-token distribution is uniform on ``support``
    whatever the context: every layer weight is zero (the residual stream is the token
    embedding), every embedding row is all-ones (so the final RMSNorm output is the same
    for every token), and the head's first row carries the logits (0 on the support,
    −1e4 elsewhere: exactly 0 after softmax)."""
    cfg = tiny_config(num_layers=1, vocab_size=vocab, hidden_size=8, intermediate_size=8, num_heads=2,
                      num_kv_heads=1, head_dim=4, max_position_embeddings=1024)
    graphdef, params = llama.init_model(cfg, seed=seed)
    pure = jax.tree_util.tree_map(jnp.zeros_like, nnx.to_pure_dict(params))
    pure["embed"] = jnp.ones_like(pure["embed"])
    pure["final_norm"] = jnp.ones_like(pure["final_norm"])
    logits = jnp.full((vocab,), -1e4, jnp.float32).at[jnp.asarray(list(support))].set(0.0)
    pure["lm_head"] = pure["lm_head"].at[0].set(logits)
    nnx.replace_by_pure_dict(params, pure)
    return Model(cfg, graphdef, params, None, name=name)


def synthetic_pair(beta_tenths: int):
    """Target p uniform on {0..9}, drafter q uniform on {10−k..19−k}: Σ min(p, q) = k/10 = β
    at every position, and each draft is accepted independently with probability β."""
    target = constant_model(range(0, 10), name="p")
    k = beta_tenths
    # one name for every k: the drafters differ only in weights, so they share one compiled program
    drafter = ModelDrafter.from_model(constant_model(range(10 - k, 20 - k), name="q"), name="q")
    return target, drafter


COMPILED: dict = {}  # compiled decode programs shared by the gate's cases (same shapes, new weights)


def truncated_geometric(beta: float, gamma: int) -> np.ndarray:
    """P(n accepted drafts), n = 0..γ, for i.i.d. acceptances with probability β."""
    n = np.arange(gamma + 1)
    pr = beta ** n * (1 - beta)
    pr[-1] = beta ** gamma
    return pr


@pytest.mark.parametrize("beta_tenths", [6, 9])
def test_gate_mean_accepted_tokens_matches_expected_tokens(beta_tenths):
    """GATE. B = 1280 rows × R = 16 rounds at temperature 1 and γ = 4, every round
    unclipped (max_new_tokens > R(γ+1), EOS ignored, the loop stopped after exactly R
    rounds through its round limit): tokens per round are i.i.d. N+1 with N
    truncated-geometric, so the pooled ``mean_accepted_tokens`` (bonus/residual token
    included) estimates E(N) without bias. Bound: |mean − E(N)| ≤ 4σ with
    σ = sqrt(s²/(B·R)), s² the observed variance of per-round tokens (from the loop's
    accept histogram) — a false-failure rate of about 6e-5 for a correct loop (normal
    approximation, B·R = 20,480 rounds; 4σ ≈ 0.035 tokens at β = 0.6). Also: the observed
    variance matches the truncated geometric's, the acceptance rate (accepted ÷ checked)
    matches β within 4σ, and ``measure_alpha`` (teacher-forced Σ min(p, q)) returns β at
    every position."""
    beta, gamma = beta_tenths / 10, 4
    target, drafter = synthetic_pair(beta_tenths)
    b, rounds = 1280, 16
    rng = np.random.default_rng(beta_tenths)
    prompts = [rng.integers(2, 128, size=int(rng.integers(3, 12))).tolist() for _ in range(b)]
    dec = Decoder(target, drafter, gamma)
    dec.compiled = COMPILED
    prog, st, _, _ = dec.start(prompts, max_new_tokens=rounds * (gamma + 1) + 1,
                               sampling=SamplingParams.create(b, temperature=1.0), seed=beta_tenths, eos_ids=[])
    st, _, _ = dec.run(prog, st, rounds)
    res = host_result(st, 0.0, 0.0, 0.0)
    assert all(s["target_calls"] == rounds and s["drafted_tokens"] == rounds * gamma for s in res.stats)
    assert all(s["finish_reason"] == "length" for s in res.stats)
    assert all(0 <= t < 10 for row in res.tokens for t in row)  # the target's support only

    mean = float(np.mean([s["mean_accepted_tokens"] for s in res.stats]))
    hist = np.sum([s["accept_hist"] for s in res.stats], axis=0)
    assert hist.sum() == b * rounds
    n = np.arange(gamma + 1) + 1.0  # tokens in a round with n accepted drafts
    s2 = float((hist * (n - (hist * n).sum() / hist.sum()) ** 2).sum() / (hist.sum() - 1))
    sigma = math.sqrt(s2 / (b * rounds))
    e_n = float(analysis.expected_tokens(beta, gamma))
    assert abs(mean - e_n) <= 4 * sigma, (mean, e_n, sigma)
    pr = truncated_geometric(beta, gamma)
    var_theory = float((pr * n ** 2).sum() - (pr * n).sum() ** 2)
    assert (pr * n).sum() == pytest.approx(e_n)
    assert s2 == pytest.approx(var_theory, rel=0.1)
    acc = sum(s["accepted_tokens"] for s in res.stats)
    checked = sum(s["checked_tokens"] for s in res.stats)
    assert abs(acc / checked - beta) <= 4 * math.sqrt(beta * (1 - beta) / checked)

    recs = measure.prompt_records(prompts[:4])
    al = measure.measure_alpha(target, drafter, recs, res.tokens[:4], temperature=1.0)
    assert al["alpha"] == pytest.approx(beta, abs=1e-5)
    assert np.allclose(np.concatenate([np.asarray(x) for x in al["betas"]]), beta, atol=1e-5)
    assert al["coverage"] == 1.0


def test_measure_alpha_generic_drafter_path_matches_model_path():
    """The per-position ``propose`` path (used for n-gram and custom drafters) gives the
    same β as the teacher-forced drafter forward, and n-gram β is p(proposal)."""
    from specjax.core.drafting import Drafter
    from specjax.drafters.ngram import NgramDrafter

    target = tiny_model(seed=0, scale=20.0)
    drafter = ModelDrafter.from_model(tiny_model(seed=1, scale=20.0))
    rng = np.random.default_rng(0)
    recs = measure.prompt_records([{"ids": rng.integers(2, 128, 9).tolist(), "category": c} for c in "aab"])
    conts = [rng.integers(2, 128, 12).tolist() for _ in recs]
    fast = measure.measure_alpha(target, drafter, recs, conts, temperature=0.7)

    @dataclasses.dataclass(frozen=True, eq=False)
    class Generic(Drafter):  # same drafter, but no causal_model declared: forces the generic path
        inner: ModelDrafter
        name: str = "generic"

        @property
        def params(self):
            return self.inner.params

        def __hash__(self):
            return hash(self.inner)

        def init_state(self, params, ctx, max_len):
            return self.inner.init_state(params, ctx, max_len)

        def propose(self, params, state, ctx, keys, gamma, vocab):
            return self.inner.propose(params, state, ctx, keys, gamma, vocab)

    slow = measure.measure_alpha(target, Generic(drafter), recs, conts, temperature=0.7)
    np.testing.assert_allclose(np.concatenate(fast["betas"]), np.concatenate(slow["betas"]), atol=2e-5)
    assert set(fast["by_category"]) == {"a", "b"} and fast["by_category"]["a"]["prompts"] == 2
    assert fast["positions"] == 36 and 0 < fast["alpha"] < 1

    # n-gram: the continuation repeats the prompt, so lookups propose; β = p(proposal)
    ng = NgramDrafter(max_ngram=2)
    rec = measure.prompt_records([[5, 6, 7, 8, 9, 5, 6]])
    al = measure.measure_alpha(target, ng, rec, [[7, 8, 9, 5, 3]], temperature=1.0)
    assert 0 < al["coverage"] <= 1 and al["positions"] >= 3
    assert 0 <= al["alpha"] <= 1


# --------------------------------------------------------------------------- (3) models, tiny
def tiny_tokenizer():
    from tokenizers import Tokenizer as HFTok, models, pre_tokenizers

    from specjax.io.tokenizer import Tokenizer

    vocab = {f"w{i}": i for i in range(128)}
    hf = HFTok(models.WordLevel(vocab=vocab, unk_token="w2"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(hf, bos_token_id=0, eos_token_ids=(1,), add_bos=False)




def test_model_mode_tiny_models_json_fields(capsys, tmp_path):
    from specjax.io.loading import save_model

    tok = tiny_tokenizer()
    # one layer each (cheap compiles); the drafter is the target with a flatter embedding
    target = tiny_model(seed=0, scale=20.0, num_layers=1).replace(tokenizer=tok)
    tdir = save_model(target, str(tmp_path / "target"))
    ddir = save_model(tiny_model(seed=0, scale=12.0, num_layers=1).replace(tokenizer=tok), str(tmp_path / "draft"))
    pfile = tmp_path / "prompts.jsonl"
    rng = np.random.default_rng(0)
    with open(pfile, "w") as f:
        for i, cat in enumerate(["qa", "qa", "qa", "math", "rag"]):
            text = " ".join(f"w{t}" for t in rng.integers(2, 128, 10))
            f.write(json.dumps({"question_id": i, "category": cat, "turns": [text]}) + "\n")
    png = tmp_path / "m.png"
    rc, out, err = run_cli(capsys, "analyze", "--model", tdir, "--draft", ddir, "--prompts", str(pfile),
                           "--categories", "qa,math", "--limit", "2", "--max-new-tokens", "12", "--gamma-max", "2",
                           "--timing-repeats", "2", "--ignore-eos", "--json", "--plot", str(png))
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["settings"]["prompts"] == 3  # qa ×2 (limit), math ×1; rag dropped
    al = rep["alpha"]
    assert set(al["by_category"]) == {"qa", "math"}
    assert al["by_category"]["qa"]["prompts"] == 2 and al["positions"] == 36
    assert 0 <= al["alpha"] <= 1 and al["coverage"] == 1.0
    assert rep["c"] > 0 and len(rep["c_by_gamma"]) == 2 and len(rep["v"]) == 2
    assert all(v > 0 for v in rep["v"])
    assert [r["gamma"] for r in rep["table"]] == [1, 2]
    assert set(rep["table"][0]) >= {"gamma", "expected_tokens", "cost", "speedup", "speedup_textbook"}
    assert rep["recommended_gamma"] in (1, 2)
    assert rep["predicted_speedup"] == max(r["speedup"] for r in rep["table"])
    (m,) = rep["measured"]
    assert m["gamma"] == rep["recommended_gamma"]
    for k in ("expected_tokens", "mean_accepted_tokens", "acceptance_rate", "measured_speedup",
              "predicted_speedup", "predicted_speedup_textbook", "tokens_per_s_spec", "tokens_per_s_ar"):
        assert isinstance(m[k], float) and m[k] >= 0, k
    assert 1 <= m["mean_accepted_tokens"] <= m["gamma"] + 1
    assert m["ar_tokens_match"] is True  # greedy speculative == greedy autoregressive
    assert set(m["by_category"]) == {"qa", "math"}
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the human rendering of the same report: markdown tables
    from specjax.eval.report import render_models

    text = render_models(rep)
    assert "### Acceptance rate" in text and "recommended γ" in text and "| speedup (×) |" in text
    assert "| **all** | 3 | 36 |" in text

    # `specjax generate --gamma auto` calls recommend_gamma (γ ≤ 2 here: the shapes above, nothing new to compile)
    from specjax.eval.measure import recommend_gamma
    from specjax.api import load_drafter
    from specjax.io.loading import load_model

    tgt = load_model(tdir)
    g = recommend_gamma(tgt, load_drafter(ddir, tgt), ["w3 w4 w5 w6 w7 w8 w9 w10"], gamma_max=2)
    assert isinstance(g, int) and g in (1, 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_measure_times_the_decoders_programs(dtype, tmp_path):
    """Gate: measure and the decoder use the same cache dtype and buffer size (a test compares
    the programs). measure_costs reports the target-cache dtype and buffer length it timed;
    they equal those of the Program ``Decoder.prepare`` builds for the same prompt, for every
    weight format (a bfloat16 target on CPU decodes with a float32 cache) and γ, also where
    the context caps ``max_new_tokens``."""
    from specjax.io.loading import load_model, save_model

    path = save_model(tiny_model(seed=1, num_layers=1), str(tmp_path / "m"))
    target = load_model(path, dtype=dtype)
    drafter = ModelDrafter.from_model(load_model(path, dtype=dtype))
    ctx = target.config.max_position_embeddings
    for plen, mn in ((9, 12), (40, ctx)):  # the second is capped to the context
        costs = measure.measure_costs(target, drafter, [2], prompt_len=plen, max_new_tokens=mn, repeats=1, warmup=1)
        progs = measure.timed_programs(target, drafter, [0, 2], plen, mn)
        for g in (0, 2):
            prog, _ = Decoder(target, drafter if g else None, g).prepare([[3] * plen], max_new_tokens=mn)
            assert (progs[g].cache_dtype, progs[g].buffer_len) == (prog.cache_dtype, prog.buffer_len)
            assert (costs["cache_dtype"], costs["buffer_len"][g]) == (prog.cache_dtype, prog.buffer_len)
    assert costs["cache_dtype"] == llama.kv_cache_dtype(target.dtype)
    if jax.default_backend() == "cpu":
        assert costs["cache_dtype"] == "float32"


def test_progress_bars_on_stderr_only_on_a_terminal(monkeypatch, capsys):
    """The analyze loops' tqdm bars (measure.progress_bar): stderr only, and only on a terminal."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, enabled, shown in ((Terminal(), True, True), (io.StringIO(), True, False), (Terminal(), False, False)):
        monkeypatch.setattr(sys, "stderr", stream)
        assert list(measure.progress_bar(range(3), "alpha", enabled=enabled)) == [0, 1, 2]
        assert ("alpha" in stream.getvalue()) is shown and ("\r" in stream.getvalue()) is shown
    assert capsys.readouterr().out == ""


def test_model_mode_errors(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "analyze", "--model", "x", "--alpha", "0.5", "--c", "0.1")
    assert rc == 2 and "cannot be combined with --model" in err
    pfile = tmp_path / "p.jsonl"
    pfile.write_text(json.dumps({"prompt": "hi", "category": "qa"}) + "\n")
    rc, _, err = run_cli(capsys, "analyze", "--prompts", str(pfile))
    assert rc == 2 and "needs one drafter" in err


# --------------------------------------------------------------------------- (4) default model
@pytest.mark.slow
def test_default_model_alpha_next_to_mean_accepted_tokens(default_model, truncated_drafter):
    """Measured α (teacher-forced Σ min) beside the loop's mean accepted tokens and E(N)
    from α, on the real model with its untrained 2-layer truncation as drafter (4 short
    prompts × 16 greedy tokens, batch 4, γ = 4: the shapes tests/test_decode.py compiles
    too, so the suite compiles that program once). Greedy p and q are one-hot, so
    β ∈ {0, 1}: α is the fraction of positions where the two argmaxes agree."""
    gamma = 4
    texts = [("The capital of France is", "qa"), ("def add(a, b):\n    return", "coding"),
             ("Translate to French: good morning", "translation"), ("Two plus two equals", "qa")]
    recs = measure.prompt_records([{"prompt": t, "category": c} for t, c in texts], default_model)
    assert max(len(r["ids"]) for r in recs) <= 32
    settings = DecodeSettings(max_new_tokens=16, batch_size=4, ignore_eos=True)
    run = measure.measure_speedup(default_model, truncated_drafter, recs, gamma, settings, autoregressive=False)
    assert [len(t) for t in run["tokens"]] == [16] * 4
    al = measure.measure_alpha(default_model, truncated_drafter, recs, run["tokens"], batch_size=4)
    cmp = measure.compare(al["alpha"], gamma, run)
    assert al["positions"] == 64 and set(al["by_category"]) == {"qa", "coding", "translation"}
    assert al["by_category"]["qa"]["prompts"] == 2 and al["by_category"]["qa"]["positions"] == 32
    assert np.all(np.isin(np.round(np.concatenate(al["betas"]), 4), [0.0, 1.0]))  # greedy: one-hot p and q
    assert 0 <= cmp["alpha"] < 0.6
    assert 1.0 <= cmp["expected_tokens"] <= 1 + gamma and 1.0 <= cmp["mean_accepted_tokens"] <= 1 + gamma
    assert cmp["tokens_discrepancy"] == pytest.approx(cmp["mean_accepted_tokens"] - cmp["expected_tokens"])
    # the loop's acceptance rate checks a subset of the same positions: close to α
    assert abs(cmp["acceptance_rate"] - cmp["alpha"]) < 0.25
    print(f"\nalpha={cmp['alpha']:.3f}  E(N)={cmp['expected_tokens']:.3f}  "
          f"mean_accepted_tokens={cmp['mean_accepted_tokens']:.3f}  acceptance_rate={cmp['acceptance_rate']:.3f}")
