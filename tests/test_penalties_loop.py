"""Penalties and min-p through the real decode loop (issue 27): greedy speculative == greedy
autoregressive with penalties on, every drafter kind, chains and trees, batch 1 and 4; and the
sampled output's distribution is the penalized target's (chi-square at T = 0.7, a fixed key).

The tiny target has a vocabulary of 8 (``test_decode.small_vocab``), where a repetition or
frequency penalty changes the greedy text within a few tokens (asserted: the checks are not
vacuous) and drafts are accepted (asserted)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from test_decode import (ALPHA, N_ROWS, V_SMALL, chi_square, eagle3_drafter, eagle_copy_drafter,  # noqa: F401
                         make_decoder, small_vocab)

from test_tree_loop import OracleTreeDrafter

from specjax.core.sampling import Sampling, SamplingParams, penalize
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.io.loading import truncate_model

PENALTIES = {"repetition": dict(repetition_penalty=1.3), "frequency": dict(frequency_penalty=0.5),
             "all": dict(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.4, min_tokens=3,
                         logit_bias={1: 0.5})}
N_NEW = 12


def _prompts(sv, batch):
    base = sv["prompt"]
    pool = [base, [1, 2, 3, 1, 2, 3, 1], [5], [0, 6, 6, 0, 6, 6, 0, 6, 2]]
    return pool[:batch]


def _drafter(sv, kind):
    return {"model": lambda: ModelDrafter.from_model(truncate_model(sv["target"], 1), name="trunc"), "ngram": lambda: NgramDrafter(3),
            "eagle": lambda: eagle_copy_drafter(sv["target"]), "eagle3": lambda: eagle3_drafter(sv["target"])}[kind]()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("penalty", list(PENALTIES))
@pytest.mark.parametrize("kind,tree", [("model", None), ("ngram", None), ("eagle", None), ("eagle3", None),
                                       ("ngram", (6, 3, 2)), ("eagle", (8, 3, 2)), ("oracle", (3, 3, 1)),
                                       ("oracle", (8, 3, 3))],
                         ids=["model", "ngram", "eagle", "eagle3", "ngram-tree", "eagle-tree", "oracle-chain",
                              "oracle-tree"])
def test_greedy_speculative_equals_autoregressive_with_penalties(small_vocab, kind, tree, penalty, batch):
    sv = small_vocab
    prompts = _prompts(sv, batch)
    sp = SamplingParams.from_rows([Sampling(**PENALTIES[penalty])] * batch)
    eos = [7]
    ar = make_decoder(sv["target"]).generate(prompts, max_new_tokens=N_NEW, sampling=sp, eos_ids=eos)
    plain = make_decoder(sv["target"]).generate(prompts, max_new_tokens=N_NEW, eos_ids=eos)
    assert ar.tokens != plain.tokens, "the penalty changed nothing: the check would be vacuous"
    if kind == "oracle":  # the penalized continuation on one branch: drafts accepted at every depth
        drafter = OracleTreeDrafter.create(tree, [p + t for p, t in zip(prompts, ar.tokens)])
    else:
        drafter = _drafter(sv, kind)
    if tree is None:
        dec = make_decoder(sv["target"], drafter, 3)
    else:
        from specjax.runtime.decoder import Decoder

        dec = Decoder(sv["target"], drafter, tree_nodes=tree[0], tree_depth=tree[1], tree_topk=tree[2])
    res = dec.generate(prompts, max_new_tokens=N_NEW, sampling=sp, eos_ids=eos)
    for j in range(batch):
        assert res.tokens[j] == ar.tokens[j], f"{kind} {tree} {penalty} row {j}: {res.tokens[j]} != {ar.tokens[j]}"
    if kind == "oracle":  # (the untrained drafters rarely agree with a penalized target)
        assert sum(s["accepted_tokens"] for s in res.stats) >= batch, "too few drafts accepted: history untested"


def _exact_first3_penalized(sv, sampling: Sampling) -> np.ndarray:
    """P(x1, x2, x3) of autoregressive sampling with penalties, enumerated from the target's
    logits: position i penalized with the prompt + x_<i (the definition, one position at a time)."""
    sp = SamplingParams.from_rows([sampling])
    prompt = list(sv["prompt"])
    P = len(prompt)
    logits = sv["logits"].reshape(V_SMALL, V_SMALL, -1, V_SMALL)  # [a, b, S, V]: prefix prompt + [a, b]

    def p_at(z, hist):
        seen = np.zeros((1, V_SMALL), bool)
        seen[0, prompt + list(hist)] = True
        counts = np.zeros((1, V_SMALL), np.int32)
        for t in hist:
            counts[0, t] += 1
        out = penalize(jnp.asarray(z)[None, None], sp, jnp.asarray(seen), jnp.asarray(counts),
                       jnp.zeros((1, 0), jnp.int32), jnp.zeros((1, 1, 0), bool),
                       jnp.asarray([[len(hist)]], jnp.int32), jnp.full((1, 1), -1, jnp.int32))
        return np.asarray(sp.process(out), np.float64)[0, 0]

    joint = np.zeros((V_SMALL,) * 3)
    p1 = p_at(logits[0, 0, P - 1], ())
    for a in range(V_SMALL):
        p2 = p_at(logits[a, 0, P], (a,))
        for b in range(V_SMALL):
            joint[a, b] = p1[a] * p2[b] * p_at(logits[a, b, P + 1], (a, b))
    return joint


@pytest.mark.parametrize("kind", ["model", "eagle"])
def test_sampled_distribution_with_penalties_is_the_penalized_targets(small_vocab, kind):
    """Chi-square (α = 1e-3, fixed keys) of the first 3 tokens of 4000 speculative rows (γ = 2,
    T = 0.7, repetition 1.5, frequency 0.5, presence 0.3, min-p 0.05) against the exact
    penalized autoregressive distribution; a history that ignores the round's drafts is caught
    by tests/test_penalties.py's enumeration."""
    sv = small_vocab
    samp = Sampling(temperature=0.7, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3, min_p=0.05)
    dec = make_decoder(sv["target"], _drafter(sv, kind), 2)
    res = dec.generate([sv["prompt"]] * N_ROWS, max_new_tokens=3, sampling=SamplingParams.from_rows([samp] * N_ROWS),
                       seed=5, eos_ids=[])
    acc = sum(s["accepted_tokens"] for s in res.stats)
    rej = sum(s["checked_tokens"] - s["accepted_tokens"] for s in res.stats)
    assert acc > N_ROWS // 10 and rej > N_ROWS // 10  # both paths (accept; residual) were taken
    pval, impossible = chi_square(res.tokens, _exact_first3_penalized(sv, samp))
    assert impossible == 0, "a token sequence of probability 0 was emitted"
    assert pval > ALPHA, f"{kind}: speculative ≠ penalized target distribution (p = {pval:.2e})"
    # the negative control: the unpenalized distribution is rejected (the penalties are visible)
    pval0, _ = chi_square(res.tokens, _exact_first3_penalized(sv, Sampling(temperature=0.7)))
    assert pval0 < ALPHA, f"the unpenalized distribution was not rejected (p = {pval0:.2e})"


def test_logprobs_report_the_penalized_distribution(small_vocab):
    """``logprobs``: a sampled row reports log p of the processed, penalized distribution; a
    greedy row log_softmax of the penalized logits (what it chose its argmax from)."""
    sv = small_vocab
    prompt = sv["prompt"]
    for samp in (Sampling(temperature=0.7, repetition_penalty=1.5, frequency_penalty=0.5),
                 Sampling(repetition_penalty=1.5, frequency_penalty=0.5)):
        sp = SamplingParams.from_rows([samp])
        res = make_decoder(sv["target"], _drafter(sv, "model"), 2).generate(
            [prompt], max_new_tokens=3, sampling=sp, seed=1, eos_ids=[], logprobs=2)
        toks = res.tokens[0]
        want = _exact_first3_penalized(sv, samp) if samp.temperature > 0 else None
        lp = [r["logprob"] for r in res.logprobs[0]]
        if want is not None:
            p1 = want.sum(axis=(1, 2))
            np.testing.assert_allclose(lp[0], np.log(p1[toks[0]]), atol=1e-5)
            p2 = want[toks[0]].sum(axis=1) / p1[toks[0]]
            np.testing.assert_allclose(lp[1], np.log(p2[toks[1]]), atol=1e-5)
        else:
            z = sv["logits"][0, len(prompt) - 1]
            seen = np.zeros((1, V_SMALL), bool)
            seen[0, prompt] = True
            pen = penalize(jnp.asarray(z)[None, None], sp, jnp.asarray(seen), jnp.zeros((1, V_SMALL), jnp.int32),
                           jnp.zeros((1, 0), jnp.int32), jnp.zeros((1, 1, 0), bool), jnp.zeros((1, 1), jnp.int32),
                           jnp.full((1, 1), -1, jnp.int32))
            ref = np.asarray(jnp.log(jnp.exp(pen) / jnp.sum(jnp.exp(pen))))[0, 0]
            np.testing.assert_allclose(lp[0], ref[toks[0]], atol=1e-5)
            assert toks[0] == int(np.argmax(ref))
