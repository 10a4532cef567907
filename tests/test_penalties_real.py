"""Penalties on the real default model (issue 27 gates; CI's gate-matrix phase):

* greedy speculative == greedy autoregressive with ``--repetition-penalty 1.3`` and with
  ``--frequency-penalty 0.5``: n-gram, the shipped EAGLE-3 drafter and a draft model (the
  target's first 2 layers), chains and trees, batch 4 (and batch 1 with the shipped drafter), on
  Spec-Bench excerpt prompts;
* parity with transformers' ``generate(repetition_penalty=1.3)`` (greedy, 32 tokens, the same
  GGUF loaded by transformers).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from test_loading import hf_gguf  # noqa: F401  (the fixture)

from specjax.core.sampling import Sampling, SamplingParams
from specjax.runtime.decoder import Decoder

pytestmark = pytest.mark.gate_matrix

EXCERPT = os.path.join(os.path.dirname(__file__), "data", "spec_bench", "question_excerpt.jsonl")
N_NEW = 48
PENALTIES = {"repetition-1.3": dict(repetition_penalty=1.3), "frequency-0.5": dict(frequency_penalty=0.5)}


@pytest.fixture(scope="module")
def prompts(default_model):
    with open(EXCERPT, encoding="utf-8") as f:
        qs = [json.loads(line) for line in f]
    picked = [q for q in qs if q["category"] in ("summarization", "writing", "math_reasoning", "qa")]
    texts = []
    for cat in ("summarization", "writing", "math_reasoning", "qa"):
        texts.append(next(q["turns"][0] for q in picked if q["category"] == cat))
    ids = [default_model.tokenizer.encode_chat(t) for t in texts]
    return [i[-200:] for i in ids]  # the last 200 tokens: one prompt bucket, a quick prefill


@pytest.fixture(scope="module")
def drafters(default_model, truncated_drafter):
    from specjax.drafters.ngram import NgramDrafter
    from specjax.io import shipped

    return {"ngram": NgramDrafter(3), "default": shipped.load_default_drafter(default_model),
            "model": truncated_drafter}


def test_real_greedy_speculative_equals_autoregressive_with_penalties(default_model, prompts, drafters):
    """Both penalties in ONE batch (rows 0, 2: repetition 1.3; rows 1, 3: frequency 0.5; the values
    are traced per row, so one program per setup serves both): every drafter setup at batch 4, and the
    shipped drafter's chain and tree at batch 1 (row 0 alone with its penalty, row 1 alone with its),
    == autoregressive."""
    m = default_model
    names = ["repetition-1.3", "frequency-0.5", "repetition-1.3", "frequency-0.5"]
    rows = [Sampling(**PENALTIES[n]) for n in names]
    sp4 = SamplingParams.from_rows(rows)
    ar = Decoder(m).generate(prompts, max_new_tokens=N_NEW, sampling=sp4)
    plain = Decoder(m).generate(prompts, max_new_tokens=N_NEW)
    for name in PENALTIES:  # each penalty changes at least one of its rows: the check is not vacuous
        assert any(ar.tokens[j] != plain.tokens[j] for j in range(4) if names[j] == name), f"{name} changed nothing"
    accepted = 0
    for kind, tree in [("ngram", None), ("default", None), ("model", None), ("ngram", (8, 4, 2)),
                       ("default", (16, 5, 3))]:
        gamma = 3 if tree is None else None
        dec = Decoder(m, drafters[kind], gamma or 1, **({} if tree is None else
                                                        dict(tree_nodes=tree[0], tree_depth=tree[1], tree_topk=tree[2])))
        res = dec.generate(prompts, max_new_tokens=N_NEW, sampling=sp4)
        for j in range(4):
            assert res.tokens[j] == ar.tokens[j], f"{names[j]} {kind} {tree} batch 4 row {j}"
        accepted += sum(s["accepted_tokens"] for s in res.stats)
        for j in ((0, 1) if kind == "default" else ()):  # batch 1 (the shipped drafter's chain and tree:
            # one program each, each penalty; CI's minutes) — every setup runs batch 4
            one = dec.generate(prompts[j:j + 1], max_new_tokens=N_NEW, sampling=SamplingParams.from_rows([rows[j]]))
            assert one.tokens[0] == ar.tokens[j], f"{names[j]} {kind} {tree} batch 1"
    assert accepted > 20, f"only {accepted} drafts accepted: the rounds' draft histories were barely exercised"


def test_repetition_penalty_matches_transformers(default_model, hf_gguf):  # noqa: F811
    """Greedy, 32 tokens, repetition penalty 1.3: specjax's tokens == transformers' ``generate``."""
    import torch

    model, _ = hf_gguf
    tok = default_model.tokenizer
    sp = SamplingParams.from_rows([Sampling(repetition_penalty=1.3)])
    checked = 0
    for text in ["Write a haiku about the sea.", "List the numbers from one to ten, one per line."]:
        ids = tok.encode_chat(text)
        ours = Decoder(default_model).generate([ids], max_new_tokens=32, sampling=sp, eos_ids=[]).tokens[0]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)
        theirs = out[0, len(ids):].tolist()
        assert ours == theirs, (text, ours, theirs)
        plain = Decoder(default_model).generate([ids], max_new_tokens=32, eos_ids=[]).tokens[0]
        checked += ours != plain
    assert checked >= 1, "the penalty changed neither continuation: the parity check would be vacuous"
