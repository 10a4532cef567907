"""Gates of the speculative core (specjax.runtime.decoder with the n-gram and draft-model drafters).

1. Greedy speculative == greedy autoregressive, token for token (float32), on the real
   default model (both drafters, γ ∈ {1, 4} at batch 4, γ ∈ {1, 2, 4, 8} at batch 1, EOS
   inside an accepted block, max_new_tokens ∈ {1, γ, γ+1}) and on tiny models (γ 1..6 ×
   batch 1/3/5 × per-row max_new). A divergence passes only at a detected float32 near-tie
   (top-2 logit margin < 1e-3 at the first differing position, recomputed with one full
   forward of the autoregressive prefix); it is printed, raised as a warning and recorded; at most
   MAX_NEAR_TIE_SITES distinct sites may be tolerated, and test_report_near_ties (last) re-verifies
   each recorded one with another forward.
2. Keys: same key ⇒ same output, different key ⇒ different output, a row's output does not
   depend on the other rows or its slot (speculative sampling, temperature 1).
3. Sampled speculative decoding has the target's distribution: chi-square of the first 3
   tokens of 4000 rows against the exact autoregressive distribution (enumerated), plus a
   negative control (a drafter that reports a q it did not sample from) that must fail.
4. n-gram mean_accepted_tokens ≥ 1.5 at γ = 4 on Spec-Bench summarization.
5. Exact stats against a Python model of the loop (scripted drafter), an identical drafter
   (100% acceptance), the n-gram drafter on a repeat-free context.
6. Streaming == generate.  7. Clear errors.  8. Padded / smaller drafter vocabularies.

Compile budget: every compiled program is reused — one Decoder per (drafter, γ), the
compiled executables shared between decoders whose programs are equal (same configs,
drafter kind/name, γ, batch, buffer bucket; parameters are arguments, not constants), and
all prompts/max_new chosen so every program lands in the 32-token prompt bucket and the
64-slot buffer bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from stats_helpers import chi2_test

from specjax.runtime.decoder import FIRST_CHUNK_ROUNDS, Decoder, request_keys
from specjax.core.drafting import Drafter, Proposal
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.io.loading import truncate_model
from specjax.models import llama
from specjax.core.sampling import SamplingParams, process_logits

NEAR_TIE = 1e-3  # top-2 logit margin below which float32 rounding may pick either token
# Distinct near-tie sites (prompt + autoregressive prefix) at which a divergence may be tolerated in
# one session (test_decode.py and test_tree_loop.py share this list): a float32 near-tie is a property
# of the reference's logits at one position, so it recurs across drafters and γ at the same site; a
# defect that diverges at many places would need many sites. A site lies on the autoregressive path
# (check_greedy stops at the first difference), so there are at most as many as the reference has
# positions with a top-2 margin < NEAR_TIE; 0 were tolerated in test_decode.py's tiny and real greedy
# tests in the session that set this bound.
MAX_NEAR_TIE_SITES = 3


@dataclasses.dataclass(frozen=True)
class NearTie:
    """A tolerated divergence: at new token ``position`` after ``prompt`` + ``prefix`` the reference
    emitted ``ar``, speculation ``spec``; the top-2 logit margin there was ``margin``."""

    label: str
    model: Any = dataclasses.field(compare=False, repr=False)
    prompt: tuple
    prefix: tuple
    ar: int
    spec: int
    margin: float

    @property
    def site(self):
        return self.prompt + self.prefix

    def __str__(self):
        return (f"{self.label}: float32 near-tie tolerated at new token {len(self.prefix)}: AR {self.ar} vs "
                f"spec {self.spec}, top-2 logit margin {self.margin:.2e} < {NEAR_TIE}")


NEAR_TIES: list[NearTie] = []  # every tolerated divergence; re-verified by test_report_near_ties

# One shared table of compiled executables: keys hold the full static program and every
# argument's shape, so decoders with equal programs (parameters are arguments) share them.
COMPILED: dict = {}


def make_decoder(target, drafter=None, gamma=4) -> Decoder:
    dec = Decoder(target, drafter, gamma)
    dec.compiled = COMPILED
    return dec


# --------------------------------------------------------------------------- helpers
@functools.partial(jax.jit, static_argnums=(0, 1))
def _full_forward(graphdef, cfg, params, toks):
    b, s = toks.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    cache = llama.KVCache.create(cfg, b, s, jnp.float32)
    return llama.apply(graphdef, params, toks, pos, cache, cfg).logits


def full_logits(model, seqs) -> np.ndarray:
    """Logits ``[N, S, V]`` of one full forward (fresh cache) over each sequence (padded to a multiple of 64)."""
    n = max(len(s) for s in seqs)
    width = max(64, -(-n // 64) * 64)
    toks = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    return np.asarray(_full_forward(model.graphdef, model.config, model.params, jnp.asarray(toks)))


def expected_greedy(ref, max_new, eos) -> list[int]:
    """The autoregressive reference (generated ignoring EOS) cut at max_new and after the first EOS."""
    out = []
    for t in ref[:max_new]:
        out.append(t)
        if t in eos:
            break
    assert len(out) == max_new or (out and out[-1] in eos), "reference too short"
    return out


def check_greedy(model, prompt, ref, got, max_new, eos, label) -> bool:
    """Assert speculative ``got`` == the autoregressive reference; tolerate (and report) only a
    float32 near-tie at the first difference. Returns False when a near-tie was tolerated."""
    exp = expected_greedy(ref, max_new, eos)
    if got == exp:
        return True
    i = next((k for k in range(min(len(got), len(exp))) if got[k] != exp[k]), None)
    if i is None:
        pytest.fail(f"{label}: lengths differ without a differing token (EOS/max_new handling)\n"
                    f"  AR   {exp}\n  spec {got}")
    z = full_logits(model, [list(prompt) + exp[:i]])[0, len(prompt) + i - 1]
    top = np.sort(z)[-2:]
    margin = float(top[1] - top[0])
    pair = {int(exp[i]), int(got[i])}
    near = margin < NEAR_TIE and pair <= set(np.argsort(z)[-2:].tolist())
    if not near:
        pytest.fail(f"{label}: speculative != autoregressive at new token {i} (AR {exp[i]}, spec {got[i]}); "
                    f"top-2 margin {margin:.3g} is not a float32 near-tie\n  AR   {exp}\n  spec {got}")
    tie = NearTie(label, model, tuple(int(t) for t in prompt), tuple(int(t) for t in exp[:i]),
                  int(exp[i]), int(got[i]), margin)
    print(tie)
    warnings.warn(str(tie))
    NEAR_TIES.append(tie)
    sites = sorted({t.site for t in NEAR_TIES})
    assert len(sites) <= MAX_NEAR_TIE_SITES, (
        f"{len(sites)} distinct float32 near-tie sites tolerated this session (at most {MAX_NEAR_TIE_SITES}): "
        "a divergence this frequent is no longer rounding\n" + "\n".join(map(str, NEAR_TIES)))
    return False


def scale_head(model, scale):
    """The model with its (untied) LM head multiplied by ``scale`` (peaked outputs: large top-2 margins)."""
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x * scale if "lm_head" in jax.tree_util.keystr(p) else x, model.params
    )
    return model.replace(params=params)


def rounds_committed(hist) -> int:
    """Tokens the rounds of ``accept_hist`` committed before any EOS cut: Σ_n (n+1)·hist[n]."""
    return int(sum((n + 1) * c for n, c in enumerate(hist)))


# --------------------------------------------------------------------------- tiny models
V_TINY = 128
EOS_TINY = [1]
N_REF = 24  # reference length; every tiny program: prompt bucket 32, buffer 64 (32 + 24 + γ+1 ≤ 64)
DRAFT1 = "tiny-1layer"  # both tiny drafters have this config and name: they share compiled programs


@pytest.fixture(scope="module")
def tiny():
    """A peaked 2-layer tiny target; two 1-layer drafters — another seed ("other") and the
    target's own first layer + head ("trunc"), same config so one compiled program serves
    both; a pool of 5 prompts (1 to 30 tokens) with their greedy references (EOS ignored)."""
    target = scale_head(tiny_model(0), 60.0)
    other = ModelDrafter.from_model(scale_head(tiny_model(1, num_layers=1), 60.0), name=DRAFT1)
    trunc = ModelDrafter.from_model(truncate_model(target, 1), name=DRAFT1)
    assert other == trunc  # equal programs (parameters are arguments)
    rng = np.random.default_rng(0)
    pool = [
        [5],  # a one-token prompt
        rng.integers(2, V_TINY, 7).tolist(),
        [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9],  # repeats: n-gram matches
        rng.integers(2, V_TINY, 19).tolist(),
        rng.integers(2, V_TINY, 30).tolist(),
    ]
    ar = make_decoder(target).generate(pool, max_new_tokens=N_REF, eos_ids=[])
    assert all(len(t) == N_REF for t in ar.tokens)
    assert all(s["target_calls"] == N_REF and s["draft_calls"] == 0 for s in ar.stats)
    return dict(target=target, other=other, trunc=trunc, pool=pool, ref=ar.tokens)


# (γ, batch): every γ 1..6 and every batch size 1/3/5; each config decodes with both 1-layer
# drafters; each row gets a different max_new from {1, γ, γ+1, 2γ+3, 24} (batch 1: each in turn).
TINY_MATRIX = [(1, 1), (2, 3), (3, 5), (4, 1), (5, 3), (6, 5)]


def _check_tiny(tiny, res, rows, mns, gamma, label):
    for j, r in enumerate(rows):
        check_greedy(tiny["target"], tiny["pool"][r], tiny["ref"][r], res.tokens[j], mns[j], EOS_TINY,
                     f"{label} row {j} (pool {r}) max_new={mns[j]}")
        st = res.stats[j]
        assert st["new_tokens"] == len(res.tokens[j]) <= mns[j]
        assert sum(st["accept_hist"]) == st["target_calls"] == st["draft_calls"]
        assert st["accepted_tokens"] == sum(n * c for n, c in enumerate(st["accept_hist"]))
        assert st["accepted_tokens"] <= st["checked_tokens"] <= st["drafted_tokens"] <= gamma * st["target_calls"]
        assert st["accepted_tokens"] <= st["new_tokens"]
        # every round commits n+1 tokens, except an EOS cut in the last one
        committed = rounds_committed(st["accept_hist"])
        assert committed == st["new_tokens"] if st["finish_reason"] == "length" else committed >= st["new_tokens"]


@pytest.mark.parametrize("gamma,batch", TINY_MATRIX)
def test_tiny_greedy_matches_autoregressive(tiny, gamma, batch):
    k = TINY_MATRIX.index((gamma, batch))
    rows = [(k + j) % 5 for j in range(batch)]
    mn_cycle = [1, gamma, gamma + 1, 2 * gamma + 3, N_REF]
    mns = [mn_cycle[(k + j) % 5] for j in range(batch)]
    calls = [(rows, mns)] if batch > 1 else [(rows, [m]) for m in mn_cycle]
    accepted = 0
    for kind in ("other", "trunc"):
        dec = make_decoder(tiny["target"], tiny[kind], gamma)
        for rws, mn in calls:
            res = dec.generate([tiny["pool"][r] for r in rws], max_new_tokens=mn)  # default EOS: id 1
            _check_tiny(tiny, res, rws, mn, gamma, f"tiny {kind} γ={gamma} batch={batch}")
            accepted += sum(s["accepted_tokens"] for s in res.stats)
    assert accepted > 0  # multi-token blocks were committed


def test_tiny_ngram_greedy_matches_autoregressive(tiny):
    """The n-gram drafter on the tiny target (batch 1, γ = 4; the repeat prompt makes it propose)."""
    dec = make_decoder(tiny["target"], NgramDrafter(3), 4)
    for r in range(5):
        for m in (1, 4, 5, N_REF):
            res = dec.generate([tiny["pool"][r]], max_new_tokens=m)
            _check_tiny(tiny, res, [r], [m], 4, "tiny ngram γ=4 batch=1")


# --------------------------------------------------------------------------- exact stats
@dataclasses.dataclass(frozen=True, eq=False)
class ScriptedDrafter(Drafter):
    """Proposes the greedy reference continuation, with chosen positions made wrong.

    params: ``ref [B, R]`` int32 — the row's full greedy sequence (prompt + reference) by
    absolute position; ``bad [B, R]`` bool — positions whose proposal is ``ref + 1`` (a
    certain rejection under greedy); ``nv [B]`` int32 — the ``num_valid`` each round.
    q is one-hot. Parameters are arguments: one compiled program serves every script.
    """

    params: Any = None
    name: str = "scripted"

    def __hash__(self):
        return hash(self.name)

    def __eq__(self, other):
        return isinstance(other, ScriptedDrafter) and other.name == self.name

    def init_state(self, params, context, max_len):
        return ()

    def propose(self, params, state, context, keys, gamma, vocab_size):
        ref, bad, nv = params["ref"], params["bad"], params["nv"]
        idx = jnp.clip(context.lengths[:, None] + jnp.arange(gamma), 0, ref.shape[1] - 1)
        toks = jnp.take_along_axis(ref, idx, axis=1)
        toks = jnp.where(jnp.take_along_axis(bad, idx, axis=1), (toks + 1) % vocab_size, toks).astype(jnp.int32)
        return Proposal(toks, jax.nn.one_hot(toks, vocab_size, dtype=jnp.float32), nv.astype(jnp.int32), state)


SCRIPT_LEN = 64


def scripted(prompts, refs, bads, nvs):
    b = len(prompts)
    ref = np.zeros((b, SCRIPT_LEN), np.int32)
    bad = np.zeros((b, SCRIPT_LEN), bool)
    for i, (p, r, bd) in enumerate(zip(prompts, refs, bads)):
        seq = list(p) + list(r)
        ref[i, : len(seq)] = seq
        for k in bd:  # k indexes the reference continuation (new token k)
            bad[i, len(p) + k] = True
    return ScriptedDrafter(params={"ref": jnp.asarray(ref), "bad": jnp.asarray(bad), "nv": jnp.asarray(nvs, jnp.int32)})


def simulate(ref, bad, nv, gamma, max_new, eos):
    """The decode loop's definitions, in Python, for one row of a scripted greedy run."""
    s = dict(target_calls=0, draft_calls=0, drafted_tokens=0, accepted_tokens=0, checked_tokens=0)
    hist = [0] * (gamma + 1)
    out = []
    while True:
        allowed = max(0, min(nv, max_new - len(out) - 1, gamma))
        n = 0
        while n < allowed and (len(out) + n) not in bad:
            n += 1
        block = ref[len(out): len(out) + n + 1]  # n accepted drafts, then the target's token
        stop = False
        emitted = 0
        for t in block:
            out.append(t)
            emitted += 1
            if t in eos:
                stop = True
                break
        # counters count only emitted tokens: an EOS on accepted draft j ends the round there
        if emitted <= n:
            n, allowed, rejected = emitted, emitted, 0
        else:
            rejected = 1 if n < allowed else 0
        s["target_calls"] += 1
        s["draft_calls"] += 1
        s["drafted_tokens"] += allowed
        s["accepted_tokens"] += n
        s["checked_tokens"] += n + rejected
        hist[n] += 1
        if stop or len(out) >= max_new:
            break
    s.update(new_tokens=len(out), accept_hist=hist,
             mean_accepted_tokens=len(out) / s["target_calls"],
             acceptance_rate=s["accepted_tokens"] / s["checked_tokens"] if s["checked_tokens"] else None,
             finish_reason="eos" if out[-1] in eos else "length")
    return out, s


def test_stats_exact_scripted(tiny):
    """Every counter of decode.Stats, against a Python model of the loop, on constructed
    cases: full acceptance, rejections at chosen positions, caps by num_valid and by
    max_new, rows with no proposal (plain steps, also a whole batch of them), and an EOS
    inside an accepted block (tokens after it cut)."""
    g = 3
    dec = make_decoder(tiny["target"], ScriptedDrafter(), g)
    rows = [1, 3, 4]
    prompts = [tiny["pool"][r] for r in rows]
    refs = [tiny["ref"][r] for r in rows]
    rng = np.random.default_rng(1)
    # the EOS case: a token of row 0 whose first occurrence is new token 5 (inside an accepted block)
    first = {t: k for k, t in reversed(list(enumerate(refs[0])))}
    eos_tok = next(t for t, k in sorted(first.items(), key=lambda kv: kv[1]) if k >= 5 and k % (g + 1) != g)
    cases = [
        ([[], [], []], [g, g, g], 17, []),  # all accepted; last round capped by max_new
        ([[0], [2, 3, 9], [4]], [g, 2, 1], 13, []),  # rejections, num_valid caps
        ([[], [1], []], [g, 0, g], 10, []),  # a row with no proposal beside drafting rows
        ([[], [], []], [0, 0, 0], 6, []),  # no proposal anywhere: plain one-token steps
        ([[], [], [6]], [g, g, g], 20, [eos_tok]),  # EOS inside an accepted block of row 0
    ]
    for _ in range(4):  # random scripts
        bads = [sorted(rng.choice(N_REF, rng.integers(0, 8), replace=False).tolist()) for _ in rows]
        cases.append((bads, rng.integers(0, g + 1, 3).tolist(), int(rng.integers(1, N_REF + 1)), []))
    eos_cut_seen = False
    for bads, nvs, max_new, eos in cases:
        dec.drafter = scripted(prompts, refs, bads, nvs)
        res = dec.generate(prompts, max_new_tokens=max_new, eos_ids=eos)
        for j in range(3):
            out, want = simulate(refs[j], set(bads[j]), nvs[j], g, max_new, eos)
            got = {k: res.stats[j][k] for k in want}
            assert res.tokens[j] == out, (bads, nvs, max_new, j)
            assert got == pytest.approx(want), (bads, nvs, max_new, j)
            if eos and j == 0:
                # the stop landed inside an accepted multi-token block: tokens were cut after it
                assert out[-1] == eos_tok and got["finish_reason"] == "eos"
                # its round counts the drafts up to the EOS as accepted, and no bonus token
                assert rounds_committed(got["accept_hist"]) - got["new_tokens"] == 1
                eos_cut_seen = True
            assert got["accepted_tokens"] <= got["new_tokens"]
        if all(v == 0 for v in nvs):
            assert all(s["target_calls"] == s["new_tokens"] and s["drafted_tokens"] == 0 for s in res.stats)
    assert eos_cut_seen


def test_identical_drafter_accepts_everything(tiny):
    """A drafter with the target's own parameters: greedy acceptance is 100% — every round
    accepts γ drafts (γ+1 tokens per target call) except the last, capped by max_new."""
    gamma = 4
    same = ModelDrafter.from_model(tiny["target"], name="tiny-same")
    dec = make_decoder(tiny["target"], same, gamma)
    rows, mns = [4, 0, 2], [N_REF, N_REF - 2, N_REF - 4]  # last rounds accept 3, 1 and 4 drafts
    res = dec.generate([tiny["pool"][r] for r in rows], max_new_tokens=mns, eos_ids=[])
    for j, r in enumerate(rows):
        m = mns[j]
        assert res.tokens[j] == tiny["ref"][r][:m]
        rounds = -(-m // (gamma + 1))
        last_n = m - (rounds - 1) * (gamma + 1) - 1
        hist = [0] * (gamma + 1)
        hist[gamma] += rounds - 1
        hist[last_n] += 1
        st = res.stats[j]
        assert st["accept_hist"] == hist
        assert st["target_calls"] == st["draft_calls"] == rounds
        assert st["accepted_tokens"] == st["checked_tokens"] == st["drafted_tokens"] == m - rounds
        assert st["acceptance_rate"] == 1.0
        assert st["mean_accepted_tokens"] == pytest.approx(m / rounds)
        assert st["mean_accepted_tokens"] == pytest.approx((gamma + 1) * (rounds - 1) / rounds + (last_n + 1) / rounds)


def test_ngram_without_repeats_is_plain_decoding(tiny):
    """The n-gram drafter on a context with no repeated token proposes nothing: every round
    is a one-token target step (target_calls == new_tokens, nothing drafted)."""
    dec = make_decoder(tiny["target"], NgramDrafter(3), 4)

    def repeat_free(r):  # longest continuation with no token repeated in prompt + continuation
        p, ref = tiny["pool"][r], tiny["ref"][r]
        m = 0
        while m < N_REF and len(set(p + ref[: m + 1])) == len(p) + m + 1:
            m += 1
        return m

    r = max(range(5), key=repeat_free)
    prompt, ref, m = tiny["pool"][r], tiny["ref"][r], repeat_free(r)
    assert m >= 3, "precondition: a repeat-free prompt + continuation of at least 3 tokens"
    res = dec.generate([prompt], max_new_tokens=m, eos_ids=[])
    st = res.stats[0]
    assert res.tokens[0] == ref[:m]
    assert st["target_calls"] == st["new_tokens"] == st["draft_calls"] == m
    assert st["drafted_tokens"] == st["accepted_tokens"] == st["checked_tokens"] == 0
    assert st["acceptance_rate"] is None and st["mean_accepted_tokens"] == 1.0  # nothing checked: no data
    assert st["accept_hist"] == [m, 0, 0, 0, 0]
    # and with a repeat the same program drafts and accepts (the counters move)
    res = dec.generate([tiny["pool"][2]], max_new_tokens=N_REF, eos_ids=[])
    assert res.tokens[0] == tiny["ref"][2]
    assert res.stats[0]["drafted_tokens"] > 0


# --------------------------------------------------------------------------- keys, streaming
@pytest.fixture(scope="module")
def tiny_soft(tiny):
    """Sampling setup: the same architectures with soft heads (high entropy at temperature
    1), decoded by the matrix's compiled (1-layer drafter, γ = 3, batch 5) program."""
    target = scale_head(tiny_model(0), 3.0)
    drafter = ModelDrafter.from_model(scale_head(tiny_model(1, num_layers=1), 3.0), name=DRAFT1)
    return make_decoder(target, drafter, 3)


def test_tiny_sampling_keys_and_row_independence(tiny, tiny_soft):
    """Speculative sampling at temperature 1: same keys ⇒ same output (and stats); other keys
    ⇒ other output; a row's output depends only on its prompt and request key, not on the
    other rows nor on its slot in the batch."""
    dec, pool = tiny_soft, tiny["pool"]
    sp = SamplingParams.create(5, temperature=1.0)
    keys = request_keys(7, 5)
    a = dec.generate(pool, max_new_tokens=N_REF, sampling=sp, keys=keys, eos_ids=[])
    b = dec.generate(pool, max_new_tokens=N_REF, sampling=sp, keys=keys, eos_ids=[])
    assert a.tokens == b.tokens and a.stats == b.stats
    assert sum(s["checked_tokens"] for s in a.stats) > 0  # drafts were tested, not only plain steps
    c = dec.generate(pool, max_new_tokens=N_REF, sampling=sp, keys=request_keys(8, 5), eos_ids=[])
    # P(24 tokens all equal under independent keys) < max_p^24 per row: negligible at this entropy
    assert all(x != y for x, y in zip(a.tokens, c.tokens))
    # rows 0, 2, 3 of the first batch move to slots 1, 3, 0 next to new rows
    fresh = request_keys(99, 2)
    prompts = [pool[3], pool[0], [9, 9, 9], pool[2], [11] * 5]
    k2 = jnp.stack([keys[3], keys[0], fresh[0], keys[2], fresh[1]])
    d = dec.generate(prompts, max_new_tokens=N_REF, sampling=sp, keys=k2, eos_ids=[])
    for slot, row in ((0, 3), (1, 0), (3, 2)):
        assert d.tokens[slot] == a.tokens[row]
        assert d.stats[slot] == a.stats[row]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tiny_stream_equals_generate(tiny, tiny_soft, temperature):
    dec = tiny_soft if temperature else make_decoder(tiny["target"], tiny["other"], 3)
    pool = tiny["pool"]
    kw = dict(max_new_tokens=[1, 3, 4, 9, N_REF], sampling=SamplingParams.create(5, temperature=temperature),
              seed=3)
    full = dec.generate(pool, **kw)
    for rpc in (1, 4):
        chunks = list(dec.stream(pool, rounds_per_chunk=rpc, **kw))
        joined = [sum((c[i] for c in chunks), []) for i in range(5)]
        assert joined == full.tokens
        rounds = max(s["target_calls"] for s in full.stats)
        first = min(rpc, FIRST_CHUNK_ROUNDS)  # the first chunk is short: the first text early
        assert len(chunks) == 1 + -(-(rounds - first) // rpc)
        if rpc == 1:  # one round per chunk: a block of n+1 ≤ γ+1 tokens per row
            assert all(len(c[i]) <= 4 for c in chunks for i in range(5))
    for bad in (0, -1, 1.5):  # 0 rounds per chunk would never finish
        with pytest.raises(ValueError, match="rounds_per_chunk"):
            next(dec.stream(pool, rounds_per_chunk=bad, **kw))


def test_request_keys():
    """Row i's key is fold_in(PRNGKey(seed), offset + i): it names the request, not the slot."""
    base = jax.random.PRNGKey(5)
    k = np.asarray(request_keys(5, 4000, offset=7))
    for i in (0, 1, 3999):
        assert np.array_equal(k[i], np.asarray(jax.random.fold_in(base, 7 + i)))
    assert len({tuple(r) for r in k.tolist()}) == 4000
    assert np.array_equal(np.asarray(request_keys([3, 4], 2)[1]), np.asarray(jax.random.PRNGKey(4)))
    with pytest.raises(ValueError, match="seeds"):
        request_keys([1, 2, 3], 2)



def test_prompt_buckets_are_geometric(tiny):
    """Prompts pad to the next power of two (≥ 32): lengths 1..1024 need 6 prompt shapes,
    and the decoder's buffer (``Decoder.prepare``) is what ``decode_buffer_len`` and
    ``Decoder.program`` report, so memory estimates match the programs that run."""
    from specjax.runtime.decoder import decode_buffer_len, prompt_bucket

    assert [prompt_bucket(n) for n in (1, 32, 33, 64, 65, 129, 1000)] == [32, 32, 64, 64, 128, 256, 1024]
    assert len({prompt_bucket(n) for n in range(1, 1025)}) == 6
    assert all(prompt_bucket(n) >= n for n in range(1, 3000))
    dec = Decoder(tiny["target"], None, gamma=0)
    for n in (5, 40, 70):
        prog, args = dec.prepare([[3] * n], max_new_tokens=9)
        assert args[2].shape == (1, prompt_bucket(n))
        assert prog.buffer_len == decode_buffer_len(n, 9, 0)
        assert dec.program(n, 9) == prog


# --------------------------------------------------------------------------- distribution
V_SMALL = 8
N_ROWS = 4000
ALPHA = 1e-3  # false-failure rate of each chi-square gate under a correct implementation


@dataclasses.dataclass(frozen=True, eq=False)
class ReportingDrafter(Drafter):
    """Wraps a drafter. ``params = {"inner": inner params, "misreport": bool}``: False passes
    the inner proposal through unchanged; True (the negative control) reports a uniform q
    while the tokens are still drawn from the inner q. One compiled program for both."""

    inner: Any
    params: Any = None
    name: str = "reporting"

    def __hash__(self):
        return hash((self.name, self.inner))

    def __eq__(self, other):
        return isinstance(other, ReportingDrafter) and other.inner == self.inner

    def init_state(self, params, context, max_len):
        return self.inner.init_state(params["inner"], context, max_len)

    def propose(self, params, state, context, keys, gamma, vocab_size):
        prop = self.inner.propose(params["inner"], state, context, keys, gamma, vocab_size)
        lie = jnp.full_like(prop.probs, 1.0 / vocab_size)
        return prop._replace(probs=jnp.where(params["misreport"], lie, prop.probs))


@pytest.fixture(scope="module")
def small_vocab():
    target = scale_head(tiny_model(3, vocab_size=V_SMALL), 12.0)
    drafter = ModelDrafter.from_model(scale_head(tiny_model(4, vocab_size=V_SMALL), 12.0), name="small-draft")
    # a prompt [a, 3, c, a, 3]: the n-gram drafter proposes c, then a; pick one where the
    # target gives c a probability in [0.3, 0.7], so that acceptance and rejection both occur
    cands = [[a, 3, c, a, 3] for a in range(V_SMALL) for c in range(V_SMALL)]
    p = np.asarray(jax.nn.softmax(jnp.asarray(full_logits(target, cands)[:, 4]), -1))
    prompt = next(cd for cd, pc in zip(cands, p) if 0.3 <= pc[cd[2]] <= 0.7)
    pre = [prompt + [a, b] for a in range(V_SMALL) for b in range(V_SMALL)]
    logits = full_logits(target, pre)  # [64, S, V]: the same compiled shape as the search
    return dict(target=target, drafter=drafter, prompt=prompt, logits=logits)


def exact_first3(sv, top_k=0) -> np.ndarray:
    """P(x1, x2, x3) of autoregressive sampling, enumerated from the target's probabilities."""
    P = len(sv["prompt"])
    p = np.asarray(process_logits(jnp.asarray(sv["logits"][:, P - 1: P + 2]), 1.0, top_k, 1.0), np.float64)
    p = p.reshape(V_SMALL, V_SMALL, 3, V_SMALL)
    return p[0, 0, 0][:, None, None] * p[:, 0, 1][:, :, None] * p[:, :, 2]


def chi_square(tokens, probs):
    """(p-value, emitted sequences of probability 0) for first-3-token counts vs ``probs``
    (the shared helper ``stats_helpers.chi2_test``: cells of expectation < 5 pooled, an impossible
    test fails)."""
    idx = np.asarray([t[0] * V_SMALL * V_SMALL + t[1] * V_SMALL + t[2] for t in tokens])
    res = chi2_test(np.bincount(idx, minlength=V_SMALL ** 3), probs)
    return res.pvalue, res.impossible


def eagle_copy_drafter(target):
    """An untrained EAGLE drafter with a copy term (n ≤ 3) whose sub-vocabulary lacks half
    the tokens: q mixes the sub-vocabulary head with boosted prompt-lookup candidates, also
    outside S (arbitrary, but it must still be exact)."""
    from specjax.drafters import eagle

    cfg = eagle.EagleConfig.for_target(target.config, V_SMALL // 2, 32, copy_ngram=3)
    tp = eagle.init_params(cfg, 7)
    tp["copy_b"] = jnp.asarray([0.5, 1.5, 3.0], jnp.float32)
    tp["copy_w"] = 0.1 * jax.random.normal(jax.random.PRNGKey(8), tp["copy_w"].shape)
    sub = np.arange(0, V_SMALL, 2, dtype=np.int32)
    return eagle.EagleDrafter(cfg, {"train": tp, "frozen": eagle.frozen_params(target, sub)}, name="eagle-copy")


def eagle_copy_int8_drafter(target):
    """:func:`eagle_copy_drafter` in the int8 weight format (``eagle.quantize_params``)."""
    import dataclasses

    from specjax.drafters import eagle

    d = eagle_copy_drafter(target)
    return dataclasses.replace(d, params=eagle.quantize_params(d.params), name="eagle-copy-int8")


def eagle3_drafter(target):
    """:func:`eagle_copy_drafter` reading fused features (EAGLE-3: every block's output of the
    target, through a random ``fuse``)."""
    from specjax.drafters import eagle

    layers = tuple(range(target.config.num_layers))
    cfg = eagle.EagleConfig.for_target(target.config, V_SMALL // 2, 32, copy_ngram=3, feature_layers=layers)
    tp = eagle.init_params(cfg, 9)
    tp["copy_b"] = jnp.asarray([0.5, 1.5, 3.0], jnp.float32)
    sub = np.arange(0, V_SMALL, 2, dtype=np.int32)
    return eagle.EagleDrafter(cfg, {"train": tp, "frozen": eagle.frozen_params(target, sub)}, name="eagle3")


@pytest.mark.parametrize("kind", ["model", "ngram", "eagle_copy", "eagle_copy_int8", "eagle3"])
def test_sampled_distribution_is_the_targets(small_vocab, kind):
    """Chi-square (α = 1e-3 each, fixed keys) of the first 3 tokens of 4000 speculative rows
    (γ = 2, temperature 1; also top-k 3) against the exact autoregressive distribution; a
    drafter that reports a q it did not sample from must be rejected."""
    sv = small_vocab

    def reporting(misreport):
        d = sv["drafter"]
        return ReportingDrafter(d, params={"inner": d.params, "misreport": jnp.asarray(misreport)})

    drafter = {"model": lambda: reporting(False), "ngram": lambda: NgramDrafter(3),
               "eagle_copy": lambda: eagle_copy_drafter(sv["target"]),
               "eagle_copy_int8": lambda: eagle_copy_int8_drafter(sv["target"]),
               "eagle3": lambda: eagle3_drafter(sv["target"])}[kind]()
    dec = make_decoder(sv["target"], drafter, 2)
    prompts = [sv["prompt"]] * N_ROWS
    for top_k, seed in ((0, 0), (3, 1)):
        sp = SamplingParams.create(N_ROWS, temperature=1.0, top_k=top_k)
        res = dec.generate(prompts, max_new_tokens=3, sampling=sp, seed=seed, eos_ids=[])
        acc = sum(s["accepted_tokens"] for s in res.stats)
        rej = sum(s["checked_tokens"] - s["accepted_tokens"] for s in res.stats)
        pval, impossible = chi_square(res.tokens, exact_first3(sv, top_k))
        print(f"{kind} top_k={top_k}: {acc} drafts accepted, {rej} rejected; chi-square p-value {pval:.4f}")
        assert acc > N_ROWS // 10 and rej > N_ROWS // 10  # both paths (accept; residual) were taken
        assert impossible == 0, "a token sequence of probability 0 was emitted"
        assert pval > ALPHA, f"{kind} top_k={top_k}: speculative ≠ target distribution (p = {pval:.2e})"
    if kind == "model":
        dec = make_decoder(sv["target"], reporting(True), 2)
        sp = SamplingParams.create(N_ROWS, temperature=1.0)
        res = dec.generate(prompts, max_new_tokens=3, sampling=sp, seed=0, eos_ids=[])
        pval, _ = chi_square(res.tokens, exact_first3(sv))
        print(f"negative control (q misreported): chi-square p-value {pval:.3g}")
        assert pval < ALPHA, "the chi-square gate failed to catch a drafter that misreports q"


# --------------------------------------------------------------------------- the real model
# Raw prompts of different lengths (one bucket of 32): a digit count (its first new token is
# also the 2-layer drafter's guess, so every γ's first block accepts a fresh token), a
# one-token prompt, a word count (long n-gram matches) and one whose greedy answer is EOS.
REAL_TEXTS = [
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Hi",
    "Count: one two three one two three one two three",
    "What is 2+2?",
]
N_REAL = 16  # new tokens: 32 + 16 + (8 + 1) ≤ 64, one buffer bucket for every γ
B1_PROMPT = {"ngram": 2, "first2": 0}  # batch-1 prompt per drafter (accepted blocks with fresh tokens)


@pytest.fixture(scope="module")
def real(default_model, truncated_drafter):
    m = default_model
    prompts = [m.tokenizer.encode(t) for t in REAL_TEXTS]
    assert len({len(p) for p in prompts}) == 4 and max(len(p) for p in prompts) <= 32
    ar = make_decoder(m).generate(prompts, max_new_tokens=N_REAL, eos_ids=[])
    drafters = {"ngram": NgramDrafter(3), "first2": truncated_drafter}
    return dict(model=m, prompts=prompts, ref=ar.tokens, eos=list(m.config.eos_token_ids), drafters=drafters)


def _real_decoder(real, kind, gamma):
    return make_decoder(real["model"], real["drafters"][kind], gamma)


def _check_rows(real, res, rows, mns, eos, label):
    for j, r in enumerate(rows):
        check_greedy(real["model"], real["prompts"][r], real["ref"][r], res.tokens[j], mns[j], eos,
                     f"{label} row {j} max_new={mns[j]}")
        st = res.stats[j]
        assert sum(st["accept_hist"]) == st["target_calls"]
        assert st["new_tokens"] == len(res.tokens[j])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "first2"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_real_greedy_batch4(real, kind, gamma):
    """Batch 4, prompts of 4 different lengths (one of 1 token): speculative == autoregressive per row, also with
    per-row max_new_tokens ∈ {1, γ, γ+1}; the EOS-first row stops at once."""
    dec = _real_decoder(real, kind, gamma)
    label = f"real {kind} γ={gamma} batch=4"
    res = dec.generate(real["prompts"], max_new_tokens=N_REAL)
    _check_rows(real, res, range(4), [N_REAL] * 4, real["eos"], label)
    assert res.stats[3]["finish_reason"] == "eos"  # the 2+2 prompt answers EOS first (greedy)
    accepted = sum(s["accepted_tokens"] for s in res.stats)
    assert accepted > 0, f"{label}: no draft accepted; the test would not exercise multi-token blocks"
    mns = [1, gamma + 1, gamma, N_REAL - 1]
    res = dec.generate(real["prompts"], max_new_tokens=mns)
    _check_rows(real, res, range(4), mns, real["eos"], label)
    if kind == "ngram" and gamma == 4:  # streaming on the real model: same tokens as generate
        full = dec.generate(real["prompts"], max_new_tokens=N_REAL)
        chunks = list(dec.stream(real["prompts"], rounds_per_chunk=3, max_new_tokens=N_REAL))
        assert [sum((c[i] for c in chunks), []) for i in range(4)] == full.tokens


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "first2"])
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_real_greedy_batch1_eos_in_block(real, kind, gamma):
    """Batch 1: speculative == autoregressive; max_new_tokens ∈ {1, γ, γ+1}; and an EOS
    placed on an accepted draft token inside a multi-token block stops the row there, with
    nothing after it emitted (the stats show the cut)."""
    dec = _real_decoder(real, kind, gamma)
    r = B1_PROMPT[kind]
    prompt, ref, eos = real["prompts"][r], real["ref"][r], real["eos"]
    label = f"real {kind} γ={gamma} batch=1"
    blocks = [c[0] for c in dec.stream([prompt], rounds_per_chunk=1, max_new_tokens=N_REAL)]
    out = sum(blocks, [])
    if not check_greedy(real["model"], prompt, ref, out, N_REAL, eos, label):
        return  # a reported near-tie: the rest of the comparison has no reference
    assert all(1 <= len(b) <= gamma + 1 for b in blocks)
    for m in (1, gamma, gamma + 1):
        res = dec.generate([prompt], max_new_tokens=m)
        check_greedy(real["model"], prompt, ref, res.tokens[0], m, eos, f"{label} max_new={m}")
        assert res.stats[0]["new_tokens"] == len(expected_greedy(ref, m, eos))
    # an accepted draft token (not the block's last token) that does not occur earlier in the output
    pos, cand = 0, None
    for blk in blocks:
        for j, t in enumerate(blk[:-1]):
            if t not in out[: pos + j]:
                cand = (t, len(blk) - 1 - j)
                break
        if cand:
            break
        pos += len(blk)
    assert cand is not None, f"{label}: no accepted draft token to put an EOS on; blocks {blocks}"
    tok, after = cand
    res = dec.generate([prompt], max_new_tokens=N_REAL, eos_ids=[tok])
    check_greedy(real["model"], prompt, ref, res.tokens[0], N_REAL, [tok], f"{label} eos={tok}")
    st = res.stats[0]
    assert res.tokens[0][-1] == tok and res.tokens[0].count(tok) == 1 and st["finish_reason"] == "eos"
    # the last round accepted past the EOS (``after`` ≥ 1 tokens dropped), and its counters stop at
    # the EOS: the drafts up to it count as accepted, nothing after it (no bonus token either)
    assert after >= 1 and rounds_committed(st["accept_hist"]) - st["new_tokens"] == 1
    assert st["accepted_tokens"] <= st["new_tokens"] and st["checked_tokens"] <= st["drafted_tokens"]


@pytest.mark.slow
def test_real_sampling_keys_and_row_independence(real):
    """Speculative sampling (n-gram, γ = 4, temperature 1) on the real model: same keys ⇒ same
    output, other keys ⇒ other output, and a row's output is the same next to other rows, in
    another slot, and alone at batch 1 (with its request key passed via ``keys=``)."""
    dec = _real_decoder(real, "ngram", 4)
    P = real["prompts"]
    sp4 = SamplingParams.create(4, temperature=1.0)
    keys = request_keys(11, 4)
    a = dec.generate(P, max_new_tokens=N_REAL, sampling=sp4, keys=keys)
    b = dec.generate(P, max_new_tokens=N_REAL, sampling=sp4, keys=keys)
    assert a.tokens == b.tokens and a.stats == b.stats
    c = dec.generate(P, max_new_tokens=N_REAL, sampling=sp4, keys=request_keys(12, 4))
    assert sum(x != y for x, y in zip(a.tokens, c.tokens)) >= 3
    other = request_keys(13, 2)
    d = dec.generate([P[2], P[0], P[1], P[3]], max_new_tokens=N_REAL, sampling=sp4,
                     keys=jnp.stack([keys[2], keys[0], other[0], other[1]]))
    assert d.tokens[0] == a.tokens[2] and d.tokens[1] == a.tokens[0]
    e = dec.generate([P[2]], max_new_tokens=N_REAL, sampling=SamplingParams.create(1, temperature=1.0),
                     keys=keys[2:3])
    # batch 1 vs 4 run different shapes; a flip needs a uniform within float32 rounding of a
    # decision boundary (probability ~1e-6 here), so a difference would be a bug
    assert e.tokens[0] == a.tokens[2]


# --------------------------------------------------------------------------- Spec-Bench gate
# the Spec-Bench excerpt carried in the repository (tests/data/spec_bench, Apache-2.0): every clone runs this
SPEC_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "spec_bench", "question_excerpt.jsonl")


@pytest.mark.slow
def test_ngram_summarization_mean_accepted_tokens(default_model):
    """n-gram (max n 3), γ = 4, greedy, chat template, max_new_tokens 128 on Spec-Bench
    summarization — the 6 summarization questions of the excerpt (the evaluation split's 5 and
    the shortest of all; 193–690 tokens), one batch: τ = total new tokens ÷ total target calls
    ≥ 1.5 (the mean over prompts of the per-prompt τ is printed too)."""
    from specjax.api import encode_prompts
    from specjax.io.prompts import read_prompts

    items = [p for p in read_prompts(SPEC_BENCH) if p["category"] == "summarization"]
    assert len(items) == 6
    ids = encode_prompts(default_model, [p["prompt"] for p in items], chat=True)
    dec = make_decoder(default_model, NgramDrafter(3), 4)
    res = dec.generate(ids, max_new_tokens=128)
    per = [st["mean_accepted_tokens"] for st in res.stats]
    new = sum(st["new_tokens"] for st in res.stats)
    calls = sum(st["target_calls"] for st in res.stats)
    tau = new / calls
    print(f"n-gram γ=4 summarization ({len(ids)} prompts): total new/total calls τ = {tau:.3f}, "
          f"mean of per-prompt τ = {np.mean(per):.3f}, per prompt {np.round(per, 2).tolist()}")
    assert tau >= 1.5, f"n-gram mean_accepted_tokens {tau:.3f} < 1.5 on summarization"


def test_check_greedy_tolerates_only_near_ties(tiny):
    """The tolerance of :func:`check_greedy` can fail: a divergence where the reference's top-2
    logits are far apart (the peaked tiny target) is a failure, not a recorded near-tie."""
    prompt, ref = tiny["pool"][3], tiny["ref"][3]
    exp = expected_greedy(ref, N_REF, [])
    z = full_logits(tiny["target"], [list(prompt) + exp[:2]])[0, len(prompt) + 1]
    second = int(np.argsort(z)[-2])
    assert int(np.argmax(z)) == exp[2] and z[exp[2]] - z[second] > 100 * NEAR_TIE
    got = exp[:2] + [second] + exp[3:]
    before = len(NEAR_TIES)
    with pytest.raises(pytest.fail.Exception, match="is not a float32 near-tie"):
        check_greedy(tiny["target"], prompt, ref, got, N_REF, [], "fabricated divergence")
    assert len(NEAR_TIES) == before


def test_report_near_ties():
    """Runs last in this file: prints every tolerated float32 near-tie (none is silent) and
    re-verifies each one independently — the top-2 logits recomputed through another forward
    (``eval.formats.teacher_forced_logits``, batch 1) at the recorded site are the two tokens
    that differed and lie within NEAR_TIE (+ 1e-5 for the other program's float32 rounding) —
    and that at most MAX_NEAR_TIE_SITES distinct sites were tolerated."""
    from specjax.eval.formats import teacher_forced_logits

    for tie in NEAR_TIES:
        print("NEAR-TIE:", tie)
        z = teacher_forced_logits(tie.model, list(tie.site))[-1]
        top2 = np.argsort(z)[-2:]
        margin = float(z[top2[1]] - z[top2[0]])
        assert {tie.ar, tie.spec} == set(top2.tolist()) and tie.ar != tie.spec, (
            f"{tie}: the differing tokens are not the top-2 there (top-2 {top2.tolist()})")
        assert margin < NEAR_TIE + 1e-5, f"{tie}: recomputed top-2 margin {margin:.2e} is no near-tie"
    sites = {t.site for t in NEAR_TIES}
    assert len(sites) <= MAX_NEAR_TIE_SITES, f"{len(sites)} near-tie sites: " + "; ".join(map(str, NEAR_TIES))
