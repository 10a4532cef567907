"""Tree speculation inside the jitted decode loop (issue 18): ``Decoder(..., tree_nodes=N,
tree_depth=D, tree_topk=K)`` and :func:`specjax.runtime.loop._tree_round`.

1. Greedy tree speculation == greedy autoregressive decoding, token for token (float32 up to a
   detected near-tie, int8 exactly), batch 1 and 4, several shapes, EOS inside an accepted path,
   per-row ``max_new_tokens``; an oracle drafter puts the true continuation on a random branch
   cut at a random depth (deep, partial and no acceptance; paths through later siblings, so
   the cache compaction really moves K/V), and the real tree drafters (n-gram trie, EAGLE-2
   dynamic tree) propose their own trees.
2. K = 1 is the chain: the same tokens and the same counters as chain decoding with γ = D
   (n-gram greedy and sampled, the EAGLE drafter greedy, a draft model through the chain
   fallback greedy and sampled).
3. Sampled rows have the target's distribution: chi-square (α = 1e-3 each, fixed keys, so
   deterministic; with fresh keys a correct implementation fails one gate with probability
   1e-3) of the first 3 tokens of 4000 rows against the enumerated autoregressive distribution,
   for the n-gram, EAGLE and oracle trees; a negative control (deterministic children verified
   as if drawn from a uniform q) must fail.
4. The target's KV cache after tree rounds is the autoregressive (causal) cache; log-probabilities
   equal autoregressive ones; the on-device counters equal :func:`row_stats` (one definition);
   the n-gram trie equals a Python reference; no one-row bf16/int8 dot in a tree program.
5. Errors (Decoder, pair configs, command line: one line, before the model loads) and the
   ``generate`` / ``bench`` commands with a tree.
6. (marker ``tree_gate``, not in the suite) the real model with the shipped drafter and n-gram:
   greedy == autoregressive; sampled rows (shipped drafter) pass a chi-square that a negative
   control fails with p < 1e-6.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from test_decode import (  # helpers and the small-vocabulary fixture (no test functions)
    ALPHA, N_ROWS, V_SMALL, chi_square, check_greedy, eagle_copy_drafter, exact_first3, scale_head, small_vocab,
)
from test_bench import tiny_dir  # noqa: F401  (a fixture: a tiny saved model with a tokenizer)
from specjax.core import tree as T
from specjax.core.drafting import Drafter, TreeProposal, TreeShape
from specjax.core.sampling import SamplingParams, process_logits
from specjax.drafters import eagle
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.io.loading import assemble_params, float_tensors, truncate_model
from specjax.models import llama
from specjax.runtime import decoder as D
from specjax.runtime.decoder import Decoder

_ = small_vocab  # a fixture used by name
COMPILED: dict = {}  # executables shared by decoders with equal programs (parameters are arguments)


def make_decoder(target, drafter=None, gamma=4, tree=None) -> Decoder:
    kw = {} if tree is None else dict(tree_nodes=tree[0], tree_depth=tree[1], tree_topk=tree[2])
    dec = Decoder(target, drafter, gamma, **kw)
    dec.compiled = COMPILED
    return dec


# --------------------------------------------------------------------------- tiny models
V = 128
N_NEW = 24
EOS = [1]


def _in_format(model, fmt):
    if fmt == "float32":
        return model
    g, p = assemble_params(model.config, float_tensors(model), fmt, source="convert")
    return model.replace(graphdef=g, params=p, dtype=fmt)


@pytest.fixture(scope="module")
def tiny():
    """A peaked 2-layer target in float32 and int8, a pool of 5 prompts (1 to 30 tokens, one
    with repeats) and each format's greedy continuation (40 tokens, EOS ignored)."""
    base = scale_head(tiny_model(0), 60.0)
    rng = np.random.default_rng(0)
    pool = [[5], rng.integers(2, V, 7).tolist(), [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9],
            rng.integers(2, V, 19).tolist(), rng.integers(2, V, 30).tolist()]
    out = {"pool": pool}
    for fmt in ("float32", "int8"):
        target = _in_format(base, fmt)
        ar = make_decoder(target).generate(pool, max_new_tokens=40, eos_ids=[])
        out[fmt] = dict(target=target, ref=ar.tokens)
    return out


def tree_structure(n, d, k, seed=0):
    """A random tree of n nodes, depth d (nodes 0..d-1 are a chain), at most k children per node."""
    rng = np.random.default_rng(seed)
    parents, depth, kids = [], [], {-1: 0}
    for i in range(n):
        if i < d:
            p = i - 1
        else:
            ok = [u for u in [-1, *range(i)] if (u < 0 or depth[u] < d) and kids[u] < k]
            p = int(rng.choice(ok))
        parents.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
        kids[p] += 1
        kids[i] = 0
    return tuple(parents), tuple(depth)


@dataclasses.dataclass(frozen=True, eq=False)
class OracleTreeDrafter(Drafter):
    """A tree of a fixed random structure whose tokens are arbitrary except on the path to one
    node, which holds the row's true continuation ``params["ref"][b, L:]`` up to a cut depth;
    node and cut follow from the committed length (so every round differs: full, partial and no
    acceptance, through first and later siblings). A deterministic function of the context:
    verified with ``"deterministic"`` — or, as a negative control (``lie=True``), with ``"iid"``
    as if every child had been drawn from a uniform q, which is not exact."""

    parents: tuple
    depth: tuple
    topk: int
    lie: bool = False
    params: Any = dataclasses.field(default=None, repr=False)
    name: str = "oracle-tree"
    proposes_trees = True
    always_proposes = True

    def _key(self):
        return (self.parents, self.depth, self.topk, self.lie, self.name)

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, OracleTreeDrafter) and self._key() == other._key()

    @classmethod
    def create(cls, shape, ref, lie=False, seed=0):
        parents, depth = tree_structure(*shape, seed=seed)
        width = 128
        buf = np.zeros((len(ref), width), np.int32)
        for b, r in enumerate(ref):
            buf[b, :len(r)] = r
        return cls(parents, depth, shape[2], lie, {"ref": jnp.asarray(buf)})

    def init_state(self, params, context, max_len):
        return ()

    def propose_tree(self, params, state, context, keys, shape, vocab_size):
        ref = params["ref"]
        n, d_max = len(self.parents), shape.depth
        assert (n, d_max, self.topk) == (shape.nodes, shape.depth, shape.topk)
        b = context.lengths.shape[0]
        par = jnp.asarray(self.parents, jnp.int32)
        dep = jnp.asarray(self.depth, jnp.int32)
        tmpl = T.DraftTree(par[None], par[None], dep[None], jnp.ones((1, n), bool), None, d_max, self.topk)
        on_path = jnp.any(T.node_paths(tmpl)[0][:, :, None] == jnp.arange(n)[None, None, :], axis=1)  # [N, N]
        length = context.lengths
        h = length * 7919 + jnp.arange(b, dtype=jnp.int32) * 104729
        node = jnp.where((h // 7) % 2 == 0, d_max - 1, h % n)  # half the rounds: node D-1, of depth D
        cut = jnp.where((h // 11) % 2 == 0, dep[node], (h // 13) % (dep[node] + 1))
        truth = jnp.take_along_axis(ref, jnp.clip(length[:, None] + jnp.arange(d_max), 0, ref.shape[1] - 1), axis=1)
        noise = (length[:, None] * 131 + jnp.arange(n)[None, :] * 71 + 5) % vocab_size
        use = on_path[node] & (dep[None, :] <= cut[:, None])
        tokens = jnp.where(use, jnp.take_along_axis(truth, jnp.broadcast_to(dep - 1, (b, n)), axis=1), noise)
        probs = None
        if self.lie:
            probs = jnp.full((b, n + 1, vocab_size), 1.0 / vocab_size, jnp.float32)
        tree = T.DraftTree(tokens.astype(jnp.int32), jnp.broadcast_to(par, (b, n)), jnp.broadcast_to(dep, (b, n)),
                           jnp.ones((b, n), bool), probs, d_max, self.topk)
        return TreeProposal(tree, "iid" if self.lie else "deterministic", state)


def copy_eagle(target, fmt="float32", min_confidence=0.0):
    """An untrained EAGLE drafter (sub-vocabulary of the even ids) with a strong copy term: it
    proposes the prompt-lookup candidate where there is one (so drafts are accepted on the
    repeat prompt), its own random guesses elsewhere (``min_confidence`` > 0: not below it)."""
    cfg = eagle.EagleConfig.for_target(target.config, V // 2, 32, copy_ngram=3)
    tp = eagle.init_params(cfg, 7)
    tp["copy_b"] = jnp.asarray([6.0, 8.0, 10.0], jnp.float32)
    params = {"train": tp, "frozen": eagle.frozen_params(target, np.arange(0, V, 2, dtype=np.int32))}
    if fmt == "int8":
        params = eagle.quantize_params(params)
    return eagle.EagleDrafter(cfg, params, name=f"eagle-copy-{fmt}", min_confidence=min_confidence)


def _refs(tiny, fmt, rows):
    return [tiny["pool"][r] + tiny[fmt]["ref"][r] for r in rows]


def _device_stats(st, row):
    s = st.stats
    return dict(new_tokens=int(s.new_tokens[row]), target_calls=int(s.target_calls[row]),
                draft_calls=int(s.draft_calls[row]), drafted_tokens=int(s.drafted_tokens[row]),
                accepted_tokens=int(s.accepted_tokens[row]), checked_tokens=int(s.checked_tokens[row]),
                accept_hist=np.asarray(s.accept_hist[row]).tolist())


def decode(dec, prompts, **kw):
    """``dec.generate`` through ``start``/``run``: ``(GenerationResult, final state)``; the host
    counters (:func:`row_stats` of the per-token record) are checked against the device's."""
    prog, st, _, _ = dec.start(prompts, **kw)
    st, _, _ = dec.run(prog, st, np.iinfo(np.int32).max)
    eos = dec.target.config.eos_token_ids if kw.get("eos_ids") is None else kw["eos_ids"]
    res = D.host_result(st, 0.0, 0.0, 0.0, model_eos=eos)
    for j, s in enumerate(res.stats):
        dev = _device_stats(st, j)
        assert {k: s[k] for k in dev} == dev, f"row {j}: row_stats {s} != device counters {dev}"
    return res, st


def check_tree_stats(res, shape, label):
    n_nodes, depth, _ = shape
    for j, st in enumerate(res.stats):
        hist = st["accept_hist"]
        assert len(hist) == depth + 1, label
        assert sum(hist) == st["target_calls"] == st["draft_calls"], label
        assert st["accepted_tokens"] == sum(n * c for n, c in enumerate(hist)), label
        assert st["accepted_tokens"] <= st["checked_tokens"] <= st["drafted_tokens"] <= n_nodes * st["target_calls"]
        assert st["checked_tokens"] <= st["accepted_tokens"] + st["target_calls"], label
        assert st["accepted_tokens"] <= st["new_tokens"] == len(res.tokens[j]), label


SHAPES = [(8, 4, 2), (16, 5, 3)]


@pytest.mark.parametrize("fmt", ["float32", "int8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N%d-D%d-K%d" % s)
def test_oracle_tree_greedy_equals_autoregressive(tiny, fmt, shape):
    """Greedy tree rounds == greedy autoregressive decoding, batch 4 (per-row max_new_tokens,
    the model's EOS, then an EOS id the continuation reaches inside accepted paths) and batch 1;
    deep, partial and empty acceptances all occur; the host counters equal the device's."""
    target, ref = tiny[fmt]["target"], tiny[fmt]["ref"]
    depth = shape[1]
    hists = np.zeros(depth + 1, int)
    rows = [0, 2, 3, 4]
    stop = ref[2][6]  # a token the repeat prompt's continuation reaches: an EOS inside a path
    for rws, mns, eos in ((rows, [N_NEW, depth, 2 * depth + 3, N_NEW], None), (rows, N_NEW, [stop]),
                          ([1], [N_NEW], None), ([2], [depth + 1], [stop])):
        drafter = OracleTreeDrafter.create(shape, _refs(tiny, fmt, rws))
        dec = make_decoder(target, drafter, tree=shape)
        kw = {} if eos is None else {"eos_ids": eos}
        res, _ = decode(dec, [tiny["pool"][r] for r in rws], max_new_tokens=mns, **kw)
        check_tree_stats(res, shape, f"{fmt} {shape}")
        mn = mns if isinstance(mns, list) else [mns] * len(rws)
        for j, r in enumerate(rws):
            exact = check_greedy(target, tiny["pool"][r], ref[r], res.tokens[j], mn[j], eos or EOS,
                                 f"{fmt} tree {shape} row {j} (pool {r})")
            assert exact or fmt == "float32", "int8 must be exact"
            hists += np.asarray(res.stats[j]["accept_hist"])
    assert hists[0] > 0 and hists[depth] > 0 and hists[1:depth].sum() > 0, hists  # every kind of round


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_cache_and_logprobs_after_tree_rounds_are_autoregressive(tiny, fmt):
    """After tree rounds (accepted paths through later siblings: compacted K/V) the target's KV
    cache at every committed position equals the causal cache of the committed tokens (≤ 1e-5),
    and log-probabilities (top 3) equal autoregressive decoding's (≤ 1e-5)."""
    target, ref = tiny[fmt]["target"], tiny[fmt]["ref"]
    shape = (16, 5, 3)
    rows = [0, 2, 3, 4]
    prompts = [tiny["pool"][r] for r in rows]
    dec = make_decoder(target, OracleTreeDrafter.create(shape, _refs(tiny, fmt, rows)), tree=shape)
    res, st = decode(dec, prompts, max_new_tokens=N_NEW, eos_ids=[], logprobs=3)
    assert sum(s["accepted_tokens"] for s in res.stats) > N_NEW
    cfg = target.config
    toks = st.tokens
    pos = jnp.broadcast_to(jnp.arange(toks.shape[1], dtype=jnp.int32), toks.shape)
    _, causal = jax.jit(lambda p, t, c: llama.forward(target.graphdef, p, t, pos, c, cfg))(
        target.params, toks, llama.KVCache.create(cfg, toks.shape[0], toks.shape[1]))
    worst = 0.0
    for j in range(len(rows)):
        live = int(st.lengths[j]) - 1  # the cache holds positions 0 .. lengths-2
        for a, b in zip(st.target_cache.k + st.target_cache.v, causal.k + causal.v):
            worst = max(worst, float(np.max(np.abs(np.asarray(a)[j, :, :live] - np.asarray(b)[j, :, :live]))))
    print(f"{fmt}: max |tree-decoded cache - causal cache| = {worst:.2e}")
    assert worst <= 1e-5
    ar = make_decoder(target).generate(prompts, max_new_tokens=N_NEW, eos_ids=[], logprobs=3)
    assert res.tokens == ar.tokens
    for got, want in zip(res.logprobs, ar.logprobs):
        for g, w in zip(got, want):
            assert g["id"] == w["id"] and abs(g["logprob"] - w["logprob"]) <= 1e-5
            assert [i for i, _ in g["top"]] == [i for i, _ in w["top"]]
            assert np.allclose([v for _, v in g["top"]], [v for _, v in w["top"]], atol=1e-5)


@pytest.mark.parametrize("kind,fmt,shape", [("ngram", "float32", (8, 4, 2)), ("eagle", "float32", (16, 5, 3)),
                                            ("eagle", "int8", (8, 4, 2)), ("eagle-conf", "float32", (8, 4, 2))])
def test_tree_drafters_greedy_equal_autoregressive(tiny, kind, fmt, shape):
    """The n-gram trie and the EAGLE-2 dynamic tree (copy term; the drafter in the target's
    format; also with a confidence cut-off) on the tiny target: greedy == autoregressive, batch
    5; trees with several valid nodes per round are offered and drafts are accepted."""
    target, ref = tiny[fmt]["target"], tiny[fmt]["ref"]
    drafter = {"ngram": lambda: NgramDrafter(3), "eagle": lambda: copy_eagle(target, fmt),
               "eagle-conf": lambda: copy_eagle(target, fmt, min_confidence=0.3)}[kind]()
    dec = make_decoder(target, drafter, tree=shape)
    pool = tiny["pool"]
    accepted = drafted = calls = 0
    for rows, mns in ((list(range(5)), [1, shape[1], N_NEW, shape[1] + 1, N_NEW]),):  # batch 1: the oracle tests
        res, _ = decode(dec, [pool[r] for r in rows], max_new_tokens=mns)
        check_tree_stats(res, shape, f"{kind} {fmt}")
        for j, r in enumerate(rows):
            exact = check_greedy(target, pool[r], ref[r], res.tokens[j], mns[j], EOS, f"{kind} {fmt} tree row {j}")
            assert exact or fmt == "float32"
        accepted += sum(s["accepted_tokens"] for s in res.stats)
        drafted += sum(s["drafted_tokens"] for s in res.stats)
        calls += sum(s["target_calls"] for s in res.stats)
    assert accepted > 0, (accepted, drafted, calls)
    if kind == "eagle":  # it always proposes: a tree of several valid nodes every round
        assert drafted > 2 * calls, (accepted, drafted, calls)


# --------------------------------------------------------------------------- K = 1 is the chain
@pytest.mark.parametrize("kind", ["ngram", "eagle-float32", "eagle-int8", "eagle-conf", "model"])
def test_topk_one_is_the_chain(tiny, kind):
    """A tree of K = 1 (N = D = γ) gives the chain's tokens and counters exactly: greedy for
    every drafter, and sampled (temperature 1, top-k 3) for the n-gram drafter and a draft model
    (the chain fallback, verified with "iid": the same keys, uniforms and kernels). The EAGLE
    tree at temperature > 0 takes its top-1 child where the chain samples q, so only greedy; with
    ``min_confidence`` its tree keeps the chain's leading-confidence drafts (and plain steps)."""
    fmt = "int8" if kind == "eagle-int8" else "float32"
    target = tiny[fmt]["target"]
    drafter = {"ngram": lambda: NgramDrafter(3),
               "eagle-float32": lambda: copy_eagle(target), "eagle-int8": lambda: copy_eagle(target, "int8"),
               "eagle-conf": lambda: copy_eagle(target, min_confidence=0.3),
               "model": lambda: ModelDrafter.from_model(truncate_model(target, 1), name="trunc1")}[kind]()
    pool = tiny["pool"]
    gamma = 4
    chain = make_decoder(target, drafter, gamma)
    tree = make_decoder(target, drafter, tree=(gamma, gamma, 1))
    temps = (0.0, 1.0) if kind in ("ngram", "model") else (0.0,)
    for temperature in temps:
        sp = SamplingParams.create(5, temperature=temperature, top_k=3 if temperature else 0)
        kw = dict(max_new_tokens=[gamma, 1, N_NEW, gamma + 1, N_NEW], sampling=sp, seed=11)
        a = chain.generate(pool, **kw)
        b, _ = decode(tree, pool, **kw)
        assert b.tokens == a.tokens, f"{kind} T={temperature}"
        assert b.stats == a.stats, f"{kind} T={temperature}: {b.stats} != {a.stats}"
        assert sum(s["accepted_tokens"] for s in a.stats) > 0
        if kind == "eagle-conf":  # the cut-off really cut: fewer drafts than γ per round
            assert sum(s["drafted_tokens"] for s in a.stats) < gamma * sum(s["target_calls"] for s in a.stats)


# --------------------------------------------------------------------------- sampled rows: exactness
@pytest.mark.parametrize("kind", ["ngram", "eagle", "oracle", "oracle-lie"])
def test_sampled_tree_distribution_is_the_targets(small_vocab, kind):
    """Chi-square of the first 3 tokens of 4000 rows (temperature 1; also top-k 3) decoded with
    trees of N = 6, D = 2, K = 3 against the exact autoregressive distribution: every tree
    drafter passes; the negative control (the oracle's deterministic children verified with
    "iid" and a uniform q they were not drawn from) must fail."""
    sv = small_vocab
    target, prompt = sv["target"], sv["prompt"]
    shape = (6, 2, 3)
    p = len(prompt)
    g1 = int(np.argmax(sv["logits"][0, p - 1]))  # the greedy path (logits of prompt + [a, b], row a·V + b)
    g2 = int(np.argmax(sv["logits"][g1 * V_SMALL, p]))
    g3 = int(np.argmax(sv["logits"][g1 * V_SMALL + g2, p + 1]))
    seqs = [prompt + [g1, g2, g3]]
    drafter = {"ngram": lambda: NgramDrafter(3), "eagle": lambda: eagle_copy_drafter(target),
               "oracle": lambda: OracleTreeDrafter.create(shape, seqs * N_ROWS),
               "oracle-lie": lambda: OracleTreeDrafter.create(shape, seqs * N_ROWS, lie=True)}[kind]()
    dec = make_decoder(target, drafter, tree=shape)
    prompts = [prompt] * N_ROWS
    for top_k, seed in ((0, 0), (3, 1)):
        sp = SamplingParams.create(N_ROWS, temperature=1.0, top_k=top_k)
        res = dec.generate(prompts, max_new_tokens=3, sampling=sp, seed=seed, eos_ids=[])
        acc = sum(s["accepted_tokens"] for s in res.stats)
        rej = sum(s["checked_tokens"] - s["accepted_tokens"] for s in res.stats)
        pval, impossible = chi_square(res.tokens, exact_first3(sv, top_k))
        print(f"{kind} top_k={top_k}: {acc} drafts accepted, {rej} rounds ended on a rejection; p = {pval:.4g}")
        if kind == "oracle-lie":
            assert pval < ALPHA, "the chi-square gate failed to catch children verified with a wrong q"
            return
        assert acc > N_ROWS // 10 and rej > N_ROWS // 10
        assert impossible == 0, "a token sequence of probability 0 was emitted"
        assert pval > ALPHA, f"{kind} top_k={top_k}: tree speculation ≠ the target's distribution (p = {pval:.2e})"


# --------------------------------------------------------------------------- errors
def test_tree_argument_errors(tiny):
    target = tiny["float32"]["target"]
    with pytest.raises(ValueError, match="missing tree_topk"):
        Decoder(target, NgramDrafter(3), tree_nodes=8, tree_depth=4)
    with pytest.raises(ValueError, match="needs a drafter"):
        Decoder(target, None, tree_nodes=8, tree_depth=4, tree_topk=2)
    with pytest.raises(ValueError, match="chains only"):
        Decoder(target, ModelDrafter.from_model(truncate_model(target, 1)), tree_nodes=8, tree_depth=4, tree_topk=2)
    for n, d, k, msg in ((3, 4, 1, "depth"), (5, 4, 1, "K \\+ \\(D-1\\)"), (0, 1, 1, "integer >= 1"),
                         (4.5, 2, 2, "integer >= 1"), (4, 2, 9, "topk \\(9\\) must be <= tree nodes \\(4\\)")):
        with pytest.raises(ValueError, match=msg):
            TreeShape(n, d, k)
    dec = Decoder(target, NgramDrafter(3), gamma=7, tree_nodes=8, tree_depth=4, tree_topk=2)
    assert dec.gamma == 4 and dec.tree == TreeShape(8, 4, 2)  # γ is the depth
    prog = dec.program(10, 20)
    assert prog.tree == TreeShape(8, 4, 2) and prog.block == 5
    assert prog.buffer_len == D.decode_buffer_len(10, 20, 8)
    assert Decoder(target, NgramDrafter(3), gamma=4).program(10, 20).tree is None


def test_pair_config_tree_keys(tmp_path):
    from specjax.api import load_pair_config

    def cfg(text):
        p = tmp_path / "pair.toml"
        p.write_text(text)
        return str(p)

    got = load_pair_config(cfg('draft = "ngram"\ntree_nodes = 8\ntree_depth = 4\ntree_topk = 2\n'))
    assert (got["tree_nodes"], got["tree_depth"], got["tree_topk"]) == (8, 4, 2)
    for text, msg in (('tree_nodes = 8\ntree_depth = 4\n', "missing tree_topk"),
                      ('gamma = 3\ntree_nodes = 8\ntree_depth = 4\ntree_topk = 2\n', "alternatives"),
                      ('tree_nodes = 8\ntree_depth = 4\ntree_topk = "2"\n', "integer >= 1"),
                      ('tree_nodes = 80\ntree_depth = 4\ntree_topk = 2\n', "K \\+ \\(D-1\\)")):
        with pytest.raises(ValueError, match=msg):
            load_pair_config(cfg(text))


@pytest.mark.parametrize("argv,msg", [
    (["--tree-nodes", "8", "--tree-depth", "4"], "missing --tree-topk"),
    (["--tree-nodes", "8", "--tree-depth", "4", "--tree-topk", "2"], "need a drafter"),
    (["--draft", "ngram", "--gamma", "4", "--tree-nodes", "8", "--tree-depth", "4", "--tree-topk", "2"],
     "alternatives"),
    (["--draft", "ngram", "--tree-nodes", "80", "--tree-depth", "4", "--tree-topk", "2"], "must be <="),
    (["--draft", "ngram", "--tree-nodes", "8", "--tree-depth", "0", "--tree-topk", "2"], "integer >= 1"),
])
def test_cli_tree_errors_before_loading(argv, msg, capsys, monkeypatch):
    """Bad tree flags: one line ``specjax: error: …``, exit status 2, before any model loads."""
    from specjax import cli
    from specjax.io import loading

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(loading, "load_model", no_load)
    rc = cli.main(["generate", "hello", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("specjax: error:") and msg in err and err.count("\n") == 1, err


def test_bench_tree_without_draft_and_config_tree_without_draft_fail_fast(tmp_path, capsys, monkeypatch):
    """bench's default drafter (n-gram) does not silently stand in for a tree's drafter; a pair
    config with tree keys and no draft names the file and its key. One line, before any load."""
    from specjax import cli
    from specjax.io import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\n')
    tree = ["--tree-nodes", "8", "--tree-depth", "4", "--tree-topk", "2"]
    assert cli.main(["bench", "--prompts", str(prompts), *tree]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specjax: error:") and "need a drafter" in err and err.count("\n") == 1, err
    conf = tmp_path / "pair.toml"
    conf.write_text("tree_nodes = 8\ntree_depth = 4\ntree_topk = 2\n")
    assert cli.main(["generate", "hello", "--config", str(conf)]) == 2
    err = capsys.readouterr().err
    assert str(conf) in err and 'draft = "default"' in err and err.count("\n") == 1, err


# --------------------------------------------------------------------------- the commands
def test_generate_and_bench_commands_with_a_tree(tiny_dir, tmp_path, capsys, monkeypatch):
    """``specjax generate --tree-*`` and ``specjax bench`` with a chain γ and a tree: the tree's
    method is named by its shape, its greedy output equals autoregressive decoding, and τ is
    reported as for chains."""
    from specjax.cli import main

    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    monkeypatch.setenv("SPECJAX_NO_PROGRESS", "1")
    tree = ["--tree-nodes", "6", "--tree-depth", "3", "--tree-topk", "2"]
    prompt = "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"
    rc = main(["generate", prompt, "--model", tiny_dir, "--draft", "ngram", *tree, "--max-new-tokens", "8",
               "--no-chat", "--json", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rec = json.loads(out)
    rc = main(["generate", prompt, "--model", tiny_dir, "--max-new-tokens", "8", "--no-chat", "--json",
               "--ignore-eos"])
    ar = json.loads(capsys.readouterr().out)
    assert rc == 0 and rec["tokens"] == ar["tokens"] and len(rec["tokens"]) == 8
    assert len(rec["stats"]["accept_hist"]) == 4 and rec["stats"]["draft_calls"] == rec["stats"]["target_calls"]

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in
                               enumerate([("qa", prompt), ("qa", "w10 w11 w12 w10 w11 w12 w10"), ("coding", "w50")])))
    rc = main(["bench", "--prompts", str(prompts), "--model", tiny_dir, "--draft", "ngram", "--gamma", "2", *tree,
               "--max-new-tokens", "8", "--ignore-eos", "--json", "--no-progress", "--warmup", "0"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads(out)
    assert list(res["methods"]) == ["ar", "ngram:3@γ2", "ngram:3@tree(N6,D3,K2)"]
    m = res["methods"]["ngram:3@tree(N6,D3,K2)"]
    assert m["tree"] == {"nodes": 6, "depth": 3, "topk": 2} and m["gamma"] == 3
    assert m["overall"]["mean_accepted_tokens"] >= 1.0 and 0.0 <= m["overall"]["acceptance_rate"] <= 1.0
    assert res["config"]["greedy_mismatches_vs_ar"] == 0
    assert res["config"]["trees"] == [{"nodes": 6, "depth": 3, "topk": 2, "label": "tree(N6,D3,K2)"}]
    rc = main(["bench", "--prompts", str(prompts), "--model", tiny_dir, "--draft", "ngram", *tree,
               "--max-new-tokens", "4", "--no-progress", "--warmup", "0"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "| ngram:3@tree(N6,D3,K2) |" in out and "@γ" not in out  # a tree alone: no chain γ by default


# --------------------------------------------------------------------------- the n-gram trie
def trie_reference(row, length, shape, min_n=1, max_n=3):
    """The n-gram trie of one row in plain Python (the rules of ``NgramDrafter.propose_tree``)."""
    n_nodes, d_max, k_max = shape
    cands = []
    for c in range(1, length):
        best = 0
        for n in range(min_n, max_n + 1):
            if c - n >= 0 and length >= n + 1 and list(row[c - n:c]) == list(row[length - n:length]):
                best = n
        if best:
            cands.append((best, c))
    cands = sorted(cands, reverse=True)[:2 * n_nodes]
    tokens, parents, kids = [], [], {-1: 0}
    for _, c in cands:
        seq = list(row[c:min(length, c + d_max)])
        cur, placed = -1, True
        for t in seq:
            hit = [i for i in range(len(tokens)) if parents[i] == cur and tokens[i] == t]
            if hit:
                cur = hit[0]
            elif kids[cur] < k_max and len(tokens) < n_nodes:
                tokens.append(int(t))
                parents.append(cur)
                kids[cur] += 1
                kids[len(tokens) - 1] = 0
                cur = len(tokens) - 1
            else:
                placed = False
                break
        if placed and 0 < len(seq) < d_max:
            kids[cur] += 1
    return tokens, parents


@pytest.mark.parametrize("shape", [(4, 4, 1), (6, 3, 2), (12, 4, 3)], ids=lambda s: "N%d-D%d-K%d" % s)
def test_ngram_trie_matches_reference_and_chain(shape):
    """The on-device trie equals the Python reference on random rows with many repeats (a small
    alphabet), every length; K = 1 is exactly the chain's proposal."""
    from specjax.core.drafting import DraftContext

    rng = np.random.default_rng(1)
    rows, width = 24, 64
    buf = rng.integers(0, 4, size=(rows, width)).astype(np.int32)
    buf[::3, 20:40] = np.tile([5, 6, 7], 7)[:20]  # periodic stretches: candidates cut short by the end
    lengths = rng.integers(1, width, size=rows).astype(np.int32)
    ctx = DraftContext(jnp.asarray(buf), jnp.asarray(lengths), SamplingParams.create(rows))
    drafter = NgramDrafter(3)
    tree = drafter.propose_tree(None, (), ctx, None, TreeShape(*shape), 8).tree
    T.check_tree(tree, 8)
    tok, par, valid = (np.asarray(a) for a in (tree.tokens, tree.parents, tree.valid))
    for b in range(rows):
        want_tok, want_par = trie_reference(buf[b], int(lengths[b]), shape)
        k = len(want_tok)
        assert valid[b].tolist() == [True] * k + [False] * (shape[0] - k), b
        assert tok[b, :k].tolist() == want_tok and par[b, :k].tolist() == want_par, b
    if shape[2] == 1:
        prop = drafter.propose(None, (), ctx, None, shape[1], 8)
        nv = np.asarray(prop.num_valid)
        assert np.array_equal(valid.sum(1), nv)
        for b in range(rows):
            assert tok[b, :nv[b]].tolist() == np.asarray(prop.tokens)[b, :nv[b]].tolist()


# --------------------------------------------------------------------------- the real model
REAL_TEXTS = ["Hi! How are you today?", "What is 2+2?", "Write a haiku about the sea.",
              "Explain photosynthesis in one paragraph for a child."]
REAL_NEW = 32
REAL_TREES = [(8, 4, 2), (16, 5, 3)]


@pytest.mark.tree_gate
@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_real_model_greedy_tree_equals_autoregressive(fmt):
    """The default model (SmolLM2-135M-Instruct) in float32 and int8 with the shipped drafter
    (``--draft default``) and n-gram lookup: greedy tree speculation == greedy autoregressive on
    4 chat prompts × 32 tokens, batch 4 and (the larger tree) batch 1 (float32: up to a detected near-tie; int8:
    exactly); prints τ (new tokens ÷ target calls, pooled over the prompts) for each tree shape (not
    an assertion: a measurement). The same drafters' chains (γ 1 and 4) against autoregressive
    decoding in every format: the gate matrix (tests/test_batch_invariance.py)."""
    from specjax.api import encode_prompts, load_drafter
    from specjax.io.loading import load_model

    model = load_model(dtype=fmt)
    prompts = encode_prompts(model, REAL_TEXTS, chat=True)
    ar = make_decoder(model).generate(prompts, max_new_tokens=REAL_NEW, eos_ids=[]).tokens
    taus, exact = {}, True

    def tau(res):
        return sum(s["new_tokens"] for s in res.stats) / sum(s["target_calls"] for s in res.stats)

    for spec in ("default", "ngram"):
        drafter = load_drafter(spec, model, dtype=fmt)
        for shape in REAL_TREES:
            dec = make_decoder(model, drafter, tree=shape)
            res = dec.generate(prompts, max_new_tokens=REAL_NEW, eos_ids=[])
            check_tree_stats(res, shape, f"{fmt} {spec} {shape}")
            taus[f"{spec} tree N{shape[0]}/D{shape[1]}/K{shape[2]}"] = tau(res)
            for j, p in enumerate(prompts):
                exact &= check_greedy(model, p, ar[j], res.tokens[j], REAL_NEW, [], f"{fmt} {spec} {shape} row {j}")
            for j in range(3 if shape == REAL_TREES[-1] else 0):  # batch 1 (the larger tree: one program per drafter)
                one = dec.generate([prompts[j]], max_new_tokens=REAL_NEW, eos_ids=[])
                exact &= check_greedy(model, prompts[j], ar[j], one.tokens[0], REAL_NEW, [],
                                      f"{fmt} {spec} {shape} alone, prompt {j}")
                assert one.stats[0] == res.stats[j] or fmt == "float32", "int8: a row alone == in the batch"
    print(f"\n{fmt}: τ (new tokens / target call) over {len(prompts)} chat prompts × {REAL_NEW} greedy tokens")
    for k, v in taus.items():
        print(f"  {k:28s} {v:.3f}")
    assert exact or fmt == "float32"


REAL_CHI_TEXT = "Name one fruit."  # chat; top-4 first tokens ≈ 0.37 / 0.36 / 0.13 / 0.13 at T = 1
REAL_CHI_ROWS = 1000  # 2000 until 2026-12-02 (CI's minutes); the tiny-model enumerations in the suite are exact
REAL_CHI_CONTROL_ROWS = 500  # the control gave p = 1e-87 at 1,000 rows (CI, 2026-12-02): 500 still fail by far
REAL_CHI_TREE = (8, 3, 3)


def _real_first3_distribution(model, ids, temperature, top_k):
    """{(x1, x2, x3): P} of autoregressive sampling from ``model`` after ``ids``, enumerated over
    the top-k support with teacher-forced calls (1 + k + k² sequences)."""
    from specjax.eval.formats import teacher_forced_logits

    def probs(seq):
        lg = teacher_forced_logits(model, seq)[len(ids) - 1:]
        return np.asarray(process_logits(jnp.asarray(lg), temperature, top_k, 1.0), np.float64)

    exact = {}
    p1 = probs(ids)[0]
    for a in np.flatnonzero(p1):
        p2 = probs(ids + [int(a)])[1]
        for b in np.flatnonzero(p2):
            p3 = probs(ids + [int(a), int(b)])[2]
            for c in np.flatnonzero(p3):
                exact[(int(a), int(b), int(c))] = p1[a] * p2[b] * p3[c]
    return exact


def _chi_square_cells(samples, exact):
    """(p-value, samples outside the support, bins) of first-3-token tuples against ``exact`` (the
    shared helper ``stats_helpers.chi2_test``: cells of expectation < 5 pooled, an impossible test fails)."""
    from collections import Counter

    from stats_helpers import chi2_test

    counts = Counter(samples)
    keys = sorted(exact)
    obs = [counts.get(k, 0) for k in keys] + [sum(v for k, v in counts.items() if k not in exact)]
    res = chi2_test(obs, [exact[k] for k in keys] + [0.0])
    return res.pvalue, res.impossible, res.bins


def _no_sibling_renormalization(step):
    """NEGATIVE CONTROL of :func:`specjax.core.tree.child_step`: a rejected child leaves p as it was
    (the next sibling is accepted by p/q as if no sibling had been rejected, and the final draw may
    repeat a rejected token) — the mistake the residual update exists to prevent."""
    def broken(p, q, token, scheme):
        return step(p, q, token, scheme)._replace(p_rejected=jnp.asarray(p, jnp.float32))
    return broken


@pytest.mark.tree_gate
def test_real_model_sampled_tree_distribution_is_the_targets(monkeypatch):
    """The default model (int8) with the shipped drafter's EAGLE-2 dynamic tree (N 8, D 3, K 3),
    temperature 1, top-k 4, on the chat prompt "Name one fruit.": the first 3 tokens of 1000 rows
    against the autoregressive distribution enumerated over the top-4 support (64 sequences) —
    chi-square p > 1e-3 (fixed keys, so deterministic; a correct implementation fails with
    probability 1e-3 over key choices), no sequence outside the support. Negative control: the same
    run (500 rows) with siblings accepted by p/q without the residual update for the siblings already rejected
    (:func:`_no_sibling_renormalization`, patched into the compiled program) must fail with
    p < 1e-6."""
    from specjax.api import encode_prompts, load_drafter
    from specjax.io.loading import load_model

    temperature, top_k = 1.0, 4
    model = load_model(dtype="int8")
    ids = encode_prompts(model, [REAL_CHI_TEXT], chat=True)[0]
    exact = _real_first3_distribution(model, ids, temperature, top_k)
    assert abs(sum(exact.values()) - 1) < 1e-5 and len(exact) > 16
    drafter = load_drafter("default", model, dtype="int8")

    def sample(rows, seed0):
        dec = make_decoder(model, drafter, tree=REAL_CHI_TREE)
        dec.compiled = {}  # the control's program must be compiled from the patched kernel
        out, acc, rej = [], 0, 0
        for s in range(0, rows, 250):
            n = min(250, rows - s)
            res = dec.generate([ids] * n, max_new_tokens=3, seed=seed0 + s, eos_ids=[],
                               sampling=SamplingParams.create(n, temperature=temperature, top_k=top_k))
            out += [tuple(t[:3]) for t in res.tokens]
            acc += sum(st["accepted_tokens"] for st in res.stats)
            rej += sum(st["checked_tokens"] - st["accepted_tokens"] for st in res.stats)
        return out, acc, rej

    toks, acc, rej = sample(REAL_CHI_ROWS, 0)
    pval, impossible, bins = _chi_square_cells(toks, exact)
    print(f"\nreal model, shipped drafter tree N{REAL_CHI_TREE[0]}/D{REAL_CHI_TREE[1]}/K{REAL_CHI_TREE[2]}, "
          f"T={temperature} top-k {top_k}: {len(toks)} rows, {acc} drafts accepted, {rej} rejections, "
          f"{bins} bins, p = {pval:.4g}")
    assert acc > REAL_CHI_ROWS // 4 and rej > REAL_CHI_ROWS // 4, "the setting must exercise acceptance and rejection"
    assert impossible == 0, "a sequence outside the top-k support was emitted"
    assert pval > 1e-3, f"tree speculation on the real model ≠ the target's distribution (p = {pval:.2e})"

    jax.clear_caches()
    monkeypatch.setattr(T, "child_step", _no_sibling_renormalization(T.child_step))
    try:
        toks, acc, rej = sample(REAL_CHI_CONTROL_ROWS, 10_000)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    pval, _, bins = _chi_square_cells(toks, exact)
    print(f"negative control (no residual update after a rejected sibling): {len(toks)} rows, p = {pval:.3g}")
    assert pval < 1e-6, "the chi-square gate failed to catch siblings verified without the residual update"


@pytest.mark.tree_gate
@pytest.mark.parametrize("spec", ["default", "shipped:smollm2-135m-instruct-block"], ids=["eagle3", "block"])
def test_real_model_sampled_chain_distribution_is_the_targets_t07(spec):
    """Issue 19's gate (``default``: the shipped EAGLE-3 drafter) and issue 28's (the shipped block
    drafter, whose γ drafts come from ONE pass with independent noise per slot): the default model in
    the default pair's format (float32 since issue 26; int8 before,
    which gave p = 1.4e-4 on the host of 2026-12-01's session: see BENCHMARKS.md "CI phases"),
    chains of γ = 3, temperature 0.7, top-k 4, on the chat prompt "Name one fruit.": the first 3 tokens
    of 1000 rows against the autoregressive distribution enumerated over the top-4 support —
    chi-square p > 1e-3 (fixed keys; a correct implementation fails with probability 1e-3 over key
    choices), nothing outside the support, drafts both accepted and rejected."""
    from specjax.api import encode_prompts, load_drafter
    from specjax.io.loading import load_model

    temperature, top_k = 0.7, 4
    model = load_model(dtype="float32")
    ids = encode_prompts(model, [REAL_CHI_TEXT], chat=True)[0]
    exact = _real_first3_distribution(model, ids, temperature, top_k)
    drafter = load_drafter(spec, model, dtype="float32")
    dec = make_decoder(model, drafter, 3)
    toks, acc, rej = [], 0, 0
    for s in range(0, REAL_CHI_ROWS, 250):
        n = min(250, REAL_CHI_ROWS - s)
        res = dec.generate([ids] * n, max_new_tokens=3, seed=s, eos_ids=[],
                           sampling=SamplingParams.create(n, temperature=temperature, top_k=top_k))
        toks += [tuple(t[:3]) for t in res.tokens]
        acc += sum(st["accepted_tokens"] for st in res.stats)
        rej += sum(st["checked_tokens"] - st["accepted_tokens"] for st in res.stats)
    pval, impossible, bins = _chi_square_cells(toks, exact)
    print(f"\nreal model float32, {spec} γ 3, T={temperature} top-k {top_k}: {len(toks)} rows, {acc} drafts "
          f"accepted, {rej} rejections, {bins} bins, p = {pval:.4g}")
    assert acc > REAL_CHI_ROWS // 4 and rej > REAL_CHI_ROWS // 10, "the setting must exercise acceptance and rejection"
    assert impossible == 0, "a sequence outside the top-k support was emitted"
    assert pval > 1e-3, f"chain speculation at T = 0.7 on the real model ≠ the target's distribution (p = {pval:.2e})"


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_no_slow_path_in_compiled_tree_decode(fmt):
    """The compiled tree decode program at batch 1: every bf16/int8 dot has >= 2 rows and no
    weight is converted to float32 (tests/test_formats.py's check on the chain programs). int8:
    with the EAGLE drafter in int8 too (its forest calls and head run on few rows); bfloat16: the
    n-gram drafter (an EAGLE drafter loaded in bfloat16 computes in float32, and the tiny
    drafter's float32 weights have the target's shapes)."""
    from test_formats import no_slow_path, convert

    target = convert(tiny_model(seed=0, tie_word_embeddings=True), fmt)
    drafter = copy_eagle(target, "int8") if fmt == "int8" else NgramDrafter(3)
    weight_shapes = {tuple(x.shape) for x in jax.tree_util.tree_leaves(target.params) if x.ndim == 2}
    weight_shapes |= {s[::-1] for s in weight_shapes}
    d = Decoder(target, drafter, tree_nodes=8, tree_depth=4, tree_topk=2)
    prog, args = d.prepare([[3, 4, 5]], max_new_tokens=8)
    sprog = D.prefill_program(prog)
    st = D.size_for_gamma(D.prefill_jit(sprog, *args), prog)
    compiled = D.run_rounds_jit.lower(prog, args[0], args[1], st, jnp.int32(4)).compile()
    no_slow_path(compiled.as_text(), fmt, weight_shapes)
