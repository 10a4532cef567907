"""``specjax analyze`` for draft trees (issue 18): the tree cost model and its measurement.

1. Theory (:mod:`specjax.eval.theory`): a chain (K = 1) reduces to Equation (1) and the chain
   speedup; a hand-computed tree; a Monte-Carlo check of ``tree_expected_tokens`` with the
   library's own acceptance walk (:func:`specjax.core.tree.verify_tree`, deterministic scheme)
   on a static tree whose target probabilities realise the i.i.d. per-rank model.
2. The command line, numbers only: ``--tree-shapes`` next to the chain table; bad shapes are
   one-line usage errors.
3. Models mode on tiny random models with the n-gram drafter: the JSON fields, measured τ from
   a real tree decode equal to the loop's new tokens ÷ target calls.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.cli import main
from specjax.eval import theory as th


def run_cli(capsys, *argv):
    os.environ.setdefault("SPECJAX_NO_CACHE", "1")  # tests use conftest's compilation cache
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------- (1) theory
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.999, 1.0])
@pytest.mark.parametrize("gamma", [1, 4, 9])
def test_chain_is_equation_1(alpha, gamma):
    """K = 1 (N = D = γ): the tree E(N) and speedup are the chain's, to rounding."""
    a = th.rank_acceptance(alpha, 1)
    assert a.tolist() == [alpha]
    parents, ranks = th.static_tree(gamma, gamma, 1, a)
    assert parents.tolist() == list(range(-1, gamma - 1)) and ranks.tolist() == [1] * gamma
    e = th.tree_expected_tokens(parents, a)
    assert e == pytest.approx(float(th.expected_tokens(alpha, gamma)), rel=1e-12, abs=1e-12)
    c, v = 0.05, 1.3
    assert th.tree_speedup(e, gamma * c, v) == pytest.approx(float(th.speedup(alpha, gamma, c, v)), rel=1e-12)
    (row,) = th.tree_table(a, [(gamma, gamma, 1)], c, v)
    (chain,) = th.theory_table(alpha, c, [gamma], v)
    for k in ("expected_tokens", "cost", "speedup", "speedup_textbook"):
        assert row[k] == pytest.approx(chain[k], rel=1e-12, abs=1e-12), k


def test_hand_computed_tree():
    """N = 4, D = 2, K = 2 at α = 0.5: a = (0.5, 0.25). Level 1: ranks 1, 2 (0.5, 0.25); level 2
    expands both: (0.25, 0.125, 0.125, 0.0625). The 4 best: 0.5, 0.25 (rank 2), 0.25 (rank 1
    below rank 1; tie, lower id), 0.125. E = 1 + 0.5 + 0.25 + 0.25 + 0.125 = 2.125."""
    a = th.rank_acceptance(0.5, 2)
    assert a.tolist() == [0.5, 0.25]
    parents, ranks = th.static_tree(4, 2, 2, a)
    assert parents.tolist() == [-1, -1, 0, 0] and ranks.tolist() == [1, 2, 1, 2]
    assert th.tree_expected_tokens(parents, a, ranks) == 2.125
    # an explicit tree (ranks from sibling order): root → {x, y}, x → {z}
    assert th.tree_expected_tokens([-1, -1, 0], [0.6, 0.3]) == pytest.approx(1 + 0.6 + 0.3 + 0.36)
    (row,) = th.tree_table(a, [(4, 2, 2)], 0.1, 1.5)
    assert row["shape"] == "4x2x2" and row["c_tree"] == pytest.approx(0.2) and row["v"] == 1.5
    assert row["speedup"] == pytest.approx(2.125 / 1.7) and row["speedup_textbook"] == pytest.approx(2.125 / 1.2)
    # a bigger tree never loses tokens: E grows with N at fixed D, K
    es = [th.tree_table(th.rank_acceptance(0.7, 3), [(n, 4, 3)], 0.0)[0]["expected_tokens"] for n in range(4, 31)]
    assert all(b >= a_ - 1e-12 for a_, b in zip(es, es[1:]))


def test_monte_carlo_expected_tokens_with_verify_tree():
    """E(N) of a static tree against the mean of n + 1 over 20000 rows of the library's own
    acceptance walk (``verify_tree``, deterministic scheme), where every node's target
    distribution puts a_r on the token of its rank-r child (tokens 1..K) and the rest on token
    0, so the child of rank r is accepted with probability a_r at every node: the i.i.d.
    model exactly. Tolerance 4 standard errors (fixed seed, so deterministic; with fresh seeds
    a correct implementation fails with probability about 6e-5)."""
    from specjax.core import tree as T

    k, rows = 3, 20000
    a = np.asarray([0.5, 0.2, 0.1])
    parents, ranks = th.static_tree(12, 4, k, a)
    n = len(parents)
    depth = np.zeros(n, np.int32)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    row_p = np.zeros(k + 1, np.float32)
    row_p[0], row_p[1:] = 1.0 - a.sum(), a
    tree = T.DraftTree.create(np.broadcast_to(ranks, (rows, n)), np.broadcast_to(parents, (rows, n)),
                              np.broadcast_to(depth, (rows, n)), max_depth=4, max_children=k)
    p = jnp.broadcast_to(jnp.asarray(row_p), (rows, n + 1, k + 1))
    key_u, key_s = jax.random.split(jax.random.PRNGKey(0))
    acc = T.verify_tree(tree, p, jax.random.uniform(key_u, (rows, n)), jax.random.split(key_s, rows),
                        "deterministic")
    tokens = np.asarray(acc.n, np.float64) + 1
    e = float(th.tree_expected_tokens(parents, a, ranks))
    se = tokens.std(ddof=1) / np.sqrt(rows)
    assert abs(tokens.mean() - e) < 4 * se, (tokens.mean(), e, se)


@pytest.mark.parametrize("call, msg", [
    (lambda: th.rank_acceptance(1.5, 2), "alpha must be in [0, 1]"),
    (lambda: th.rank_acceptance(0.5, 0), "topk must be an integer >= 1"),
    (lambda: th.static_tree(3, 4, 2, [0.5, 0.2]), "depth (4) must be <= nodes (3)"),
    (lambda: th.static_tree(20, 2, 2, [0.5, 0.2]), "nodes (20) must be <= K + (D-1)·K² = 6"),
    (lambda: th.static_tree(4, 2, 3, [0.5, 0.2]), "the tree needs topk = 3"),
    (lambda: th.tree_expected_tokens([-1, 1], [0.5]), "parents[1] = 1 must be -1"),
    (lambda: th.tree_expected_tokens([-1, -1], [0.5]), "rank 2; rank_probs covers ranks 1..1"),
    (lambda: th.tree_expected_tokens([-1], [0.7, 0.6]), "must sum to <= 1"),
    (lambda: th.tree_speedup(0.5, 0.1), "expected tokens must be finite and >= 1"),
    (lambda: th.tree_speedup(2.0, -0.1), "c_tree must be finite and >= 0"),
])
def test_theory_errors_are_one_liners(call, msg):
    with pytest.raises(ValueError) as e:
        call()
    assert msg in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- (2) numbers only
def test_numbers_mode_with_trees(capsys):
    rc, out, _ = run_cli(capsys, "analyze", "--alpha", "0.8", "--c", "0.02", "--gamma-max", "6",
                         "--tree-shapes", "8x4x2,16x5x3,6x6x1", "--json")
    assert rc == 0
    rep = json.loads(out)
    rows = {r["shape"]: r for r in rep["trees"]}
    assert list(rows) == ["8x4x2", "16x5x3", "6x6x1"]
    assert rows["8x4x2"]["expected_tokens"] == pytest.approx(3.88)  # 1 + .8 + .16 + .64 + 2·.128 + .512 + .1024 + .4096
    assert rows["8x4x2"]["c_tree"] == pytest.approx(4 * 0.02) and rows["8x4x2"]["v"] == 1.0
    # K = 1 is the chain row of the same γ
    chain6 = rep["table"][5]
    for k in ("expected_tokens", "cost", "speedup"):
        assert rows["6x6x1"][k] == pytest.approx(chain6[k], rel=1e-12)
    rec = rep["recommended"]
    assert rec == {"kind": "tree", "gamma": 5, "shape": "16x5x3", "speedup": rows["16x5x3"]["speedup"],
                   "basis": "predicted"}
    assert rec["speedup"] > rep["optimal_speedup"] and "tree_model" in rep
    # measured v(N) as a list: v(N) is the list's N-th entry
    vs = [str(1 + 0.05 * i) for i in range(1, 17)]
    rc, out, _ = run_cli(capsys, "analyze", "--alpha", "0.8", "--c", "0.02", "--v", *vs, "--tree-shapes", "16x5x3",
                         "--json")
    (row,) = json.loads(out)["trees"]
    assert row["v"] == pytest.approx(1.8) and row["cost"] == pytest.approx(0.1 + 1.8)
    # the human table and the recommendation line
    rc, out, _ = run_cli(capsys, "analyze", "--alpha", "0.8", "--c", "0.02", "--tree-shapes", "8x4x2")
    assert rc == 0 and "| 8x4x2 | 8 | 4 | 2 | 3.880 | 0.080 | 1.000 | 1.080 | 3.593 | 3.593 |" in out
    assert "recommended: chain, γ = 11, predicted speedup 3.817×" in out


@pytest.mark.parametrize("shapes, msg", [
    ("8x4", "'8x4' is not NxDxK"),
    ("8x4x2,a", "'a' is not NxDxK"),
    ("8x0x2", "'8x0x2' is not NxDxK"),
    ("3x2x5", "topk K=5 > nodes N=3"),
    ("2x3x1", "depth D=3 > nodes N=2"),
    ("30x2x2", "nodes N=30 > K + (D-1)·K² = 6"),
])
def test_bad_tree_shapes_are_one_line_usage_errors(capsys, shapes, msg):
    rc, out, err = run_cli(capsys, "analyze", "--alpha", "0.8", "--c", "0.02", "--tree-shapes", shapes)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("specjax: error: ") and msg in err


def test_tree_needs_v_for_every_size_and_a_tree_drafter(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "analyze", "--alpha", "0.8", "--c", "0.02", "--v", "1.1", "1.2",
                         "--tree-shapes", "8x4x2")
    assert rc == 2 and err.count("\n") == 1 and "needs v(N) for N = 8" in err
    pfile = tmp_path / "p.jsonl"
    pfile.write_text(json.dumps({"prompt": "hi"}) + "\n")
    (tmp_path / "dm").mkdir()
    (tmp_path / "dm" / "config.json").write_text("{}")  # a draft model's directory (not read before the error)
    rc, _, err = run_cli(capsys, "analyze", "--model", "m", "--draft", str(tmp_path / "dm"), "--prompts", str(pfile),
                         "--tree-shapes", "4x2x2")
    assert rc == 2 and err.count("\n") == 1 and "proposes chains only" in err and "4x2x2" in err


# --------------------------------------------------------------------------- (3) models, tiny
def test_models_mode_trees_tiny(capsys, tmp_path):
    """A tiny random target with the n-gram drafter: each tree shape is timed (c_tree, v(N)) and
    decoded for real; τ is the loop's new tokens ÷ target calls, the same counters as a tree
    Decoder gives on the same prompts; greedy tree output equals greedy autoregressive output."""
    from conftest import tiny_model
    from test_analysis_cli import tiny_tokenizer
    from specjax.api import load_drafter
    from specjax.eval.measure import prompt_records
    from specjax.eval.report import render_models
    from specjax.io.loading import load_model, save_model
    from specjax.runtime.decoder import Decoder

    tok = tiny_tokenizer()
    tdir = save_model(tiny_model(seed=0, scale=20.0, num_layers=1).replace(tokenizer=tok), str(tmp_path / "target"))
    pfile = tmp_path / "prompts.jsonl"
    texts = ["w5 w6 w7 w8 w5 w6 w7 w8 w5 w6", "w9 w3 w9 w3 w9 w4 w9 w3"]
    with open(pfile, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"question_id": i, "category": "qa", "prompt": t}) + "\n")
    rc, out, err = run_cli(capsys, "analyze", "--model", tdir, "--draft", "ngram", "--prompts", str(pfile),
                           "--max-new-tokens", "12", "--gamma-max", "2", "--timing-repeats", "2", "--ignore-eos",
                           "--tree-shapes", "4x2x2,3x3x1", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert [t["shape"] for t in rep["trees"]] == ["4x2x2", "3x3x1"] and "tree_model" in rep
    for t in rep["trees"]:
        for k in ("c_tree", "v", "t_target_ms", "t_draft_ms", "expected_tokens", "cost", "predicted_speedup",
                  "predicted_speedup_textbook", "mean_accepted_tokens", "measured_speedup",
                  "predicted_speedup_from_measured_tokens", "tokens_per_s_spec", "tokens_per_s_ar"):
            assert isinstance(t[k], float) and t[k] >= 0, k
        assert t["v"] > 0 and t["cost"] == pytest.approx(t["c_tree"] + t["v"])
        assert 1.0 <= t["expected_tokens"] <= t["depth"] + 1
        tau = t["mean_accepted_tokens"]
        assert 1.0 <= tau <= t["depth"] + 1 and tau == t["new_tokens"] / t["target_calls"]
        assert len(t["accept_hist"]) == t["depth"] + 1 and sum(t["accept_hist"]) == t["target_calls"]
        assert t["ar_tokens_match"] is True  # greedy tree decoding == greedy autoregressive
        # the same counters from a tree Decoder of that shape on the same prompts (batch 1)
        target = load_model(tdir)
        dec = Decoder(target, load_drafter("ngram", target), tree_nodes=t["nodes"], tree_depth=t["depth"],
                      tree_topk=t["topk"])
        new = calls = 0
        for rec in prompt_records(texts, target):
            r = dec.generate([rec["ids"]], max_new_tokens=12, eos_ids=[])
            new += r.stats[0]["new_tokens"]
            calls += r.stats[0]["target_calls"]
        assert (new, calls) == (t["new_tokens"], t["target_calls"])
    rec = rep["recommended"]
    assert rec["basis"] == "measured" and rec["kind"] in ("chain", "tree")
    best = max([rep["measured"][0]["measured_speedup"]] + [t["measured_speedup"] for t in rep["trees"]])
    assert rec["speedup"] == best
    text = render_models(rep)
    assert "### Draft trees N×D×K" in text and "| 4x2x2 |" in text and "recommended: " in text
    print(text)
