"""Drafters in isolation (n-gram lookup, draft model), vocabulary handling, and clear errors.

- NgramDrafter.propose == a brute-force Python prompt lookup on random buffers.
- ModelDrafter.propose: every q_i is exactly the processed distribution of a full forward
  of the drafter over the committed prefix + earlier drafts, round after round (after full
  acceptance, after rejections, from a one-token prompt), greedy and sampled.
- Vocabularies: fit_vocab; a padded drafter vocab (real rows = the target's) never proposes
  or emits ids ≥ the target vocab and still accepts everything; a smaller drafter vocab
  gets probability 0 beyond it and survives committed ids it does not have.
- Errors: γ < 1, a drafter tokenizer that differs, real drafter tokens beyond the target's
  vocab, an unknown --draft value (API and CLI).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

from conftest import tiny_model

from specjax.models.config import CheckpointError
from specjax.runtime.decoder import Decoder, generate, speculative_generate
from specjax.core.drafting import DraftContext
from specjax.drafters.model import ModelDrafter, check_vocab_compatible, fit_vocab
from specjax.drafters.ngram import NgramDrafter
from specjax.io.loading import save_model
from specjax.io.tokenizer import Tokenizer
from specjax.models import llama
from specjax.core.sampling import SamplingParams

V = 128


def scale_head(model, scale):
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x * scale if "lm_head" in jax.tree_util.keystr(p) else x, model.params
    )
    return model.replace(params=params)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _full_forward(graphdef, cfg, params, toks):
    b, s = toks.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return llama.apply(graphdef, params, toks, pos, llama.KVCache.create(cfg, b, s), cfg).logits


# --------------------------------------------------------------------------- n-gram
def ngram_reference(row, length, gamma, min_n, max_n):
    """Prompt lookup in Python: the latest earlier occurrence of the longest trailing n-gram
    (n = max_n .. min_n) that has at least one committed token after it."""
    seq = list(row[:length])
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        trail = seq[length - n:]
        for s in range(length - n - 1, -1, -1):  # window [s, s+n) ends before the last token
            if seq[s: s + n] == trail:
                cont = seq[s + n: s + n + gamma]
                return cont + [0] * (gamma - len(cont)), len(cont)
    return [0] * gamma, 0


@pytest.mark.parametrize("min_n,max_n,gamma", [(1, 3, 4), (2, 4, 3), (1, 1, 1)])
def test_ngram_matches_python_lookup(min_n, max_n, gamma):
    rng = np.random.default_rng(min_n * 10 + max_n)
    d = NgramDrafter(max_ngram=max_n, min_ngram=min_n)
    L, B = 48, 64
    propose = jax.jit(lambda ctx: d.propose(None, (), ctx, None, gamma, 16))
    bufs = rng.integers(0, 5, (B, L)).astype(np.int32)  # small alphabet: many matches
    bufs[B // 2:] = rng.integers(0, 16, (B - B // 2, L))  # and rows with few
    lengths = rng.integers(1, L - gamma, B).astype(np.int32)
    lengths[:4] = [1, 2, 3, L - gamma - 1]
    ctx = DraftContext(jnp.asarray(bufs), jnp.asarray(lengths), SamplingParams.create(B))
    prop = propose(ctx)
    toks, nv, q = map(np.asarray, (prop.tokens, prop.num_valid, prop.probs))
    found = 0
    for b in range(B):
        want, n = ngram_reference(bufs[b], int(lengths[b]), gamma, min_n, max_n)
        assert int(nv[b]) == n, (b, lengths[b])
        assert toks[b, :n].tolist() == want[:n], (b, lengths[b])
        found += n > 0
    assert 0 < found < B  # both kinds of rows occurred
    assert np.array_equal(q, np.eye(16, dtype=np.float32)[toks])  # q is one-hot at the proposal


@pytest.mark.parametrize("max_n", [1, 3])
def test_copy_candidate_matches_training_lookup(max_n):
    """The decode loop's copy candidate (``lookup_candidate``, JAX, per prefix) equals the
    one training uses (``specjax.train.batches.lookup_candidates``, NumPy, whole sequences) and the
    brute-force prompt lookup, including the matched size n."""
    from specjax.train.batches import lookup_candidates
    from specjax.drafters.ngram import lookup_candidate

    rng = np.random.default_rng(max_n)
    L = 40
    seqs = [rng.integers(0, 4, L), rng.integers(0, 30, L), np.tile([5, 6, 7, 8], L // 4)]
    f = jax.jit(lambda t, n: lookup_candidate(t, n, max_n))
    for seq in seqs:
        seq = seq.astype(np.int32)
        cand, size = lookup_candidates(seq.tolist(), max_n)
        lengths = np.arange(1, L + 1, dtype=np.int32)
        c, n = map(np.asarray, f(jnp.asarray(np.tile(seq, (L, 1))), jnp.asarray(lengths)))
        np.testing.assert_array_equal(c, cand)
        np.testing.assert_array_equal(n, size)
        for t in range(L):
            want, found = ngram_reference(seq, t + 1, 1, 1, max_n)
            assert (size[t] > 0) == (found > 0) and (not found or cand[t] == want[0]), t
            if found:  # n is the longest size that matches
                assert all(ngram_reference(seq, t + 1, 1, m, m)[1] == 0 for m in range(size[t] + 1, max_n + 1))
                assert ngram_reference(seq, t + 1, 1, size[t], size[t])[1] > 0
    assert (size > 0).any()


def test_eagle_int8_format_and_head_orientation():
    """The EAGLE drafter's int8 format (``quantize_params``): every matrix becomes int8 with a
    per-output-channel scale, the forward and the head stay within 2% of float32, and the
    float32 head's decode-step orientation (``head · fᵀ``, ≤ SMALL_ROWS rows) equals the
    training one (``f · headᵀ``)."""
    from specjax.drafters import eagle

    target = tiny_model(3)
    cfg = eagle.EagleConfig.for_target(target.config, 64, 48)
    params = {"train": eagle.init_params(cfg, 5), "frozen": eagle.frozen_params(target, np.arange(0, V, 2))}
    q = eagle.quantize_params(params)
    assert q["train"]["fc"].dtype == jnp.uint8 and q["frozen"]["head"].dtype == jnp.uint8
    assert all(q["train"]["layer"][k].dtype == jnp.uint8 and k + "_scale" in q["train"]["layer"]
               for k in eagle.layer_matmuls())
    assert params["train"]["fc"].dtype == jnp.float32  # the float32 parameters are not touched
    d = cfg.hidden_size
    feats = jax.random.normal(jax.random.PRNGKey(1), (2, 3, d))
    toks = jnp.asarray([[1, 5, 9], [2, 4, 8]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
    f32, _ = eagle.forward(cfg, params, feats, toks, pos, eagle.new_cache(cfg, 2, 8))
    f8, _ = eagle.forward(cfg, q, feats, toks, pos, eagle.new_cache(cfg, 2, 8))
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert rel(f8, f32) < 0.02
    assert rel(eagle.sub_logits(q, f32), eagle.sub_logits(params, f32)) < 0.02
    small = eagle.sub_logits(params, f32[:, 0])  # 2 rows: head · fᵀ
    big = jnp.einsum("bd,sd->bs", f32[:, 0], params["frozen"]["head"])
    np.testing.assert_allclose(np.asarray(small), np.asarray(big), rtol=1e-5, atol=1e-5)
    rows = jnp.tile(f32.reshape(-1, d), (4, 1))  # 24 rows: the einsum path
    assert rows.shape[0] > eagle.SMALL_ROWS
    np.testing.assert_allclose(np.asarray(eagle.sub_logits(params, rows)[:2]), np.asarray(
        eagle.sub_logits(params, rows[:2])), rtol=1e-5, atol=1e-5)


def test_ngram_sizes_validated():
    with pytest.raises(ValueError, match="ngram"):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="ngram"):
        NgramDrafter(max_ngram=0)


# --------------------------------------------------------------------------- draft model
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_model_drafter_q_is_the_prefix_distribution(temperature):
    """Round after round, q_i == process(full forward of committed + x_<i) and x_i was drawn
    from it: after a fully accepted round (x_γ and the bonus token never fed), after a
    rejection, and from a one-token prompt."""
    m = scale_head(tiny_model(1), 3.0)
    d = ModelDrafter.from_model(m)
    gamma, B, L = 3, 3, 64
    rng = np.random.default_rng(5)
    sp = SamplingParams.create(B, temperature=temperature)
    sp1 = SamplingParams.create(1, temperature=temperature)
    buf = np.zeros((B, L), np.int32)
    lengths = np.array([1, 6, 13], np.int32)
    for b in range(B):
        buf[b, : lengths[b]] = rng.integers(2, V, lengths[b])
    init = jax.jit(lambda p, ctx: d.init_state(p, ctx, L))
    propose = jax.jit(lambda p, st, ctx, keys: d.propose(p, st, ctx, keys, gamma, V))
    state = init(d.params, DraftContext(jnp.asarray(buf), jnp.asarray(lengths), sp))
    accept_plan = [[gamma, 0, 1], [gamma, gamma, 0], [1, 2, gamma], [0, gamma, 2]]
    for rnd, plan in enumerate(accept_plan):
        keys = jax.random.split(jax.random.PRNGKey(rnd), B * gamma).reshape(B, gamma, 2)
        prop = propose(d.params, state, DraftContext(jnp.asarray(buf), jnp.asarray(lengths), sp), keys)
        toks, q = np.asarray(prop.tokens), np.asarray(prop.probs)
        seqs = [buf[b, : lengths[b]].tolist() + toks[b].tolist() for b in range(B)]
        z = np.asarray(_full_forward(m.graphdef, m.config, m.params,
                                     jnp.asarray([s + [0] * (L - len(s)) for s in seqs])))
        for b in range(B):
            for i in range(gamma):
                want = np.asarray(sp1.process(jnp.asarray(z[b: b + 1, lengths[b] - 1 + i])))[0]
                np.testing.assert_allclose(q[b, i], want, atol=2e-5, err_msg=f"round {rnd} row {b} draft {i}")
                assert q[b, i, toks[b, i]] > 0
                if temperature == 0:
                    assert toks[b, i] == np.argmax(z[b, lengths[b] - 1 + i])
        state = prop.state
        for b, n in enumerate(plan):  # commit n drafts and one other token
            new = toks[b, :n].tolist() + [int(rng.integers(2, V))]
            buf[b, lengths[b]: lengths[b] + n + 1] = new
            lengths[b] += n + 1


def test_fit_vocab():
    z = jnp.arange(12.0).reshape(2, 6)
    assert fit_vocab(z, 6) is z
    np.testing.assert_array_equal(fit_vocab(z, 4), z[:, :4])
    out = np.asarray(fit_vocab(z, 9))
    np.testing.assert_array_equal(out[:, :6], z)
    assert np.all(out[:, 6:] == -np.inf)
    p = np.asarray(SamplingParams.create(2, temperature=1.0).process(jnp.asarray(out)))
    assert np.all(p[:, 6:] == 0) and np.allclose(p.sum(-1), 1)


def _resize_vocab(model, vocab, fill_head=None):
    """``model`` with ``vocab`` embedding rows / head columns: extra ones random (embedding)
    and ``fill_head`` (head), or cut off."""
    cfg = model.config
    big = tiny_model(9, vocab_size=vocab)
    old = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(model.params)[0]}

    def pick(path, b):
        k = jax.tree_util.keystr(path)
        a = old[k]
        if "embed" in k:
            return b.at[: min(vocab, cfg.vocab_size)].set(a[: min(vocab, cfg.vocab_size)])
        if "lm_head" in k:
            out = b.at[:, : min(vocab, cfg.vocab_size)].set(a[:, : min(vocab, cfg.vocab_size)])
            if fill_head is not None and vocab > cfg.vocab_size:
                out = out.at[:, cfg.vocab_size:].set(fill_head(a))
            return out
        return a

    params = jax.tree_util.tree_map_with_path(pick, big.params)
    return big.replace(params=params, name=f"resized{vocab}")


@pytest.fixture(scope="module")
def vocab_models():
    target = scale_head(tiny_model(0), 60.0)
    # padded: the target's own rows + 16 padding rows whose head columns dominate every logit
    padded = _resize_vocab(target, V + 16, fill_head=lambda a: 50.0 * a[:, :16])
    smaller = _resize_vocab(target, V - 16)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, V, n).tolist() for n in (3, 9, 17)]
    return dict(target=target, padded=padded, smaller=smaller, prompts=prompts, ref=greedy_ref(target, prompts, 20))


def greedy_ref(model, prompts, n):
    """The target's greedy continuations by repeated full forwards (argmax, lowest index on ties)."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        toks = jnp.asarray([s + [0] * (64 - len(s)) for s in seqs])
        z = np.asarray(_full_forward(model.graphdef, model.config, model.params, toks))
        for b, s in enumerate(seqs):
            s.append(int(np.argmax(z[b, len(s) - 1])))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def test_padded_drafter_vocab(vocab_models):
    """Drafter vocab V+16 whose padding columns would win every argmax: the padding is
    dropped (fit_vocab), so the drafter — otherwise the target itself — is accepted 100% in
    greedy decoding, and sampled output never contains an id ≥ V."""
    vm = vocab_models
    d = ModelDrafter.from_model(vm["padded"], name="padded")
    z = _full_forward(vm["padded"].graphdef, vm["padded"].config, vm["padded"].params,
                      jnp.asarray([vm["prompts"][1] + [0] * (64 - 9)]))
    assert int(jnp.argmax(z[0, 8])) >= V  # precondition: unmasked, the padding would be proposed
    dec = Decoder(vm["target"], d, 3)
    res = dec.generate(vm["prompts"], max_new_tokens=20, eos_ids=[])
    assert res.tokens == vm["ref"]
    for s in res.stats:
        assert s["acceptance_rate"] == 1.0 and s["checked_tokens"] > 0
    sp = SamplingParams.create(3, temperature=1.0)
    res = dec.generate(vm["prompts"], max_new_tokens=20, sampling=sp, seed=1, eos_ids=[])
    assert all(0 <= t < V for row in res.tokens for t in row)
    assert sum(s["accepted_tokens"] for s in res.stats) > 0


def test_smaller_drafter_vocab(vocab_models):
    """Drafter vocab V-16: q is 0 on the ids it lacks (-inf logits), committed ids it lacks
    are still fed without poisoning its cache, and the output is the target's."""
    vm = vocab_models
    d = ModelDrafter.from_model(vm["smaller"], name="smaller")
    # direct: a context containing ids ≥ V-16 gives finite q, zero beyond V-16
    B, L = 2, 64
    buf = np.zeros((B, L), np.int32)
    buf[0, :5] = [3, V - 1, 7, V - 5, 9]
    buf[1, :3] = [V - 2, 4, V - 3]
    lengths = jnp.asarray([5, 3], jnp.int32)
    sp = SamplingParams.create(B, temperature=1.0)
    ctx = DraftContext(jnp.asarray(buf), lengths, sp)
    st = d.init_state(d.params, ctx, L)
    prop = d.propose(d.params, st, ctx, jax.random.split(jax.random.PRNGKey(0), 2 * 3).reshape(2, 3, 2), 3, V)
    q = np.asarray(prop.probs)
    assert np.all(np.isfinite(q)) and np.allclose(q.sum(-1), 1, atol=1e-5)
    assert np.all(q[..., V - 16:] == 0) and np.all(np.asarray(prop.tokens) < V - 16)
    dec = Decoder(vm["target"], d, 3)
    res = dec.generate(vm["prompts"], max_new_tokens=20, eos_ids=[])
    assert res.tokens == vm["ref"]
    assert sum(s["accepted_tokens"] for s in res.stats) > 0


# --------------------------------------------------------------------------- errors
def test_gamma_below_one_is_rejected():
    t = tiny_model(0)
    d = NgramDrafter(3)
    for g in (0, -1, 1.5):
        with pytest.raises(ValueError, match="gamma"):
            Decoder(t, d, g)
        with pytest.raises(ValueError, match="gamma"):
            speculative_generate(t, d, [[2, 3]], gamma=g)
        with pytest.raises(ValueError, match="gamma"):
            generate(t, [[2, 3]], drafter=d, gamma=g)
    with pytest.raises(ValueError, match="drafter"):
        speculative_generate(t, None, [[2, 3]])


WORDS = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(3, V)]


def word_tokenizer(words):
    """A word-level tokenizer: ``words`` is a list (id = index) or a ``{word: id}`` dict."""
    vocab = words if isinstance(words, dict) else {w: i for i, w in enumerate(words)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(tok, bos_token_id=0, eos_token_ids=(1,), special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def test_check_vocab_compatible():
    same = word_tokenizer(WORDS)
    check_vocab_compatible(same, word_tokenizer(WORDS), V, V)
    check_vocab_compatible(same, word_tokenizer(WORDS), V, V + 16)  # padding rows: fine
    check_vocab_compatible(same, word_tokenizer(WORDS[: V - 16]), V, V - 16)  # a prefix vocab: fine
    swapped = list(WORDS)
    swapped[5], swapped[6] = swapped[6], swapped[5]
    with pytest.raises(CheckpointError, match="id 5"):
        check_vocab_compatible(same, word_tokenizer(swapped), V, V)
    extra = WORDS + [f"x{i}" for i in range(8)]
    with pytest.raises(CheckpointError, match="beyond the target"):
        check_vocab_compatible(same, word_tokenizer(extra), V, V + 8)
    gap = {w: i for i, w in enumerate(WORDS) if i != 50}  # id 50 missing
    with pytest.raises(CheckpointError, match="lacks target token id 50"):
        check_vocab_compatible(same, word_tokenizer(gap), V, V)


def test_load_drafter_checks_the_checkpoint_tokenizer(tmp_path):
    """load_drafter on saved tiny checkpoints: a different tokenizer and real extra tokens are
    refused with CheckpointError; a padded vocab with the same tokenizer is accepted."""
    from specjax.api import load_drafter

    target = tiny_model(0).replace(tokenizer=word_tokenizer(WORDS))
    swapped = list(WORDS)
    swapped[10], swapped[11] = swapped[11], swapped[10]
    cases = {
        "swapped": (tiny_model(1).replace(tokenizer=word_tokenizer(swapped)), "differs"),
        "extra": (tiny_model(1, vocab_size=V + 8).replace(tokenizer=word_tokenizer(WORDS + [f"x{i}" for i in range(8)])),
                  "beyond the target"),
        "padded": (tiny_model(1, vocab_size=V + 8).replace(tokenizer=word_tokenizer(WORDS)), None),
    }
    for name, (model, err) in cases.items():
        path = save_model(model, str(tmp_path / name))
        if err is None:
            d = load_drafter(path, target)
            assert isinstance(d, ModelDrafter) and d.config.vocab_size == V + 8
        else:
            with pytest.raises(CheckpointError, match=err):
                load_drafter(path, target)


def test_unknown_draft_value(monkeypatch, capsys):
    from specjax import cli
    from specjax.io import loading
    from specjax.api import load_drafter

    target = tiny_model(0).replace(tokenizer=word_tokenizer(WORDS))
    with pytest.raises(ValueError, match="unknown --draft value 'foo'"):
        load_drafter("foo", target)
    assert isinstance(load_drafter("ngram:2", target), NgramDrafter)
    with pytest.raises(ValueError, match="n-gram size"):
        load_drafter("ngram:x", target)
    # the CLI: one line on stderr, exit status 2 (the target load is stubbed: no real model)
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: target)
    assert cli.main(["generate", "hi", "--draft", "foo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specjax: error:") and "'foo'" in err
    assert cli.main(["generate", "hi", "--draft", "ngram", "--gamma", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gamma" in err
