"""Generation options and honest counters (issue 15): stop strings and stop token ids, log-probabilities,
64-bit seeds, counters that count only emitted tokens, incremental detokenization (streaming
text == final text), standard input and the chat default of ``specjax generate``.

Tiny random models cover the loop's bookkeeping; the real default model covers the text layer
(byte-level BPE, multi-byte characters) and the speculative gates with the n-gram and shipped
drafters (float32, greedy). Every program is shared through ``COMPILED``.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
import pytest
from conftest import FakeStdin, tiny_model

import specjax
from specjax import cli
from specjax.api import TextStream, generate_text, stop_cut
from specjax.runtime.decoder import SEED_LIMIT, Decoder, host_result, request_keys, row_stats, seed_key
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.core.sampling import SamplingParams

COMPILED: dict = {}


def make_decoder(target, drafter=None, gamma=4) -> Decoder:
    dec = Decoder(target, drafter, gamma)
    dec.compiled = COMPILED
    return dec


@pytest.fixture(scope="module")
def tiny():
    t = tiny_model(0, scale=4.0)  # peaked: greedy margins far above float32 noise
    return dict(target=t, same=ModelDrafter.from_model(t, name="same"),
                prompts=[[2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14]])


# --------------------------------------------------------------------------- counters
def _device_stats(st, i):
    s = jax.tree_util.tree_map(np.asarray, st.stats)
    return dict(new_tokens=int(s.new_tokens[i]), target_calls=int(s.target_calls[i]),
                draft_calls=int(s.draft_calls[i]), drafted_tokens=int(s.drafted_tokens[i]),
                accepted_tokens=int(s.accepted_tokens[i]), checked_tokens=int(s.checked_tokens[i]),
                accept_hist=s.accept_hist[i].tolist())


@pytest.mark.parametrize("gamma", [2, 8])
def test_counters_count_only_emitted_tokens(tiny, gamma):
    """A drafter equal to the target (every draft accepted) and an EOS on an accepted draft inside
    a block: the counters stop at the EOS (accepted ≤ new tokens), and the loop's on-device
    Stats equal the host's per-token recount (row_stats)."""
    t, d = tiny["target"], tiny["same"]
    ref = make_decoder(t).generate(tiny["prompts"], max_new_tokens=24, eos_ids=[]).tokens
    dec = make_decoder(t, d, gamma)
    for r, row in enumerate(ref):
        eos = next(x for k, x in enumerate(row) if k >= 3 and k % (gamma + 1) != gamma and x not in row[:k])
        prog, st, _, _ = dec.start([tiny["prompts"][r]], max_new_tokens=24, eos_ids=[eos])
        st, _, _ = dec.run(prog, st, 10_000)
        res = host_result(st, 0.0, 0.0, 0.0, model_eos=[eos])
        s = res.stats[0]
        assert res.tokens[0] == row[: row.index(eos) + 1] and s["finish_reason"] == "eos"
        assert s["accepted_tokens"] <= s["new_tokens"] and s["acceptance_rate"] == 1.0
        assert s["checked_tokens"] == s["accepted_tokens"] == s["drafted_tokens"]
        assert s["mean_accepted_tokens"] == s["new_tokens"] / s["target_calls"]
        assert {k: s[k] for k in _device_stats(st, 0)} == _device_stats(st, 0)
    ar = make_decoder(t).generate(tiny["prompts"], max_new_tokens=5)
    assert all(s["acceptance_rate"] is None for s in ar.stats)  # no drafter: null, not 0.0


def test_row_stats_cut_inside_a_round():
    """row_stats on a hand-made record: rounds 0 (2 accepted + correction, 3 offered), 1 (bonus
    after 3 of 3), 2 (a one-token step after a proposal of nothing), 3 (a plain program's round:
    the drafter did not run); cuts at every length."""
    # info = accepted + 2·rejected + 4·plain + 8·offered
    info = [1 + 2 + 24, 1 + 2 + 24, 2 + 24, 1 + 24, 1 + 24, 1 + 24, 24, 0, 4]
    rounds = [0, 0, 0, 1, 1, 1, 1, 2, 3]
    full = row_stats(np.array(info), np.array(rounds), 9, True)
    assert full == dict(new_tokens=9, target_calls=4, draft_calls=3, drafted_tokens=6, accepted_tokens=5,
                        checked_tokens=6, accept_hist=[2, 0, 1, 1])
    cut = row_stats(np.array(info), np.array(rounds), 5, True)  # inside round 1, after 2 accepted drafts
    assert cut == dict(new_tokens=5, target_calls=2, draft_calls=2, drafted_tokens=5, accepted_tokens=4,
                       checked_tokens=5, accept_hist=[0, 0, 2])
    for k in range(10):
        s = row_stats(np.array(info), np.array(rounds), k, True)
        assert s["accepted_tokens"] <= s["checked_tokens"] <= s["drafted_tokens"] and s["accepted_tokens"] <= k


# --------------------------------------------------------------------------- stop (token level)
def test_stop_fn_cuts_inside_a_block_and_matches_autoregressive(tiny):
    """A host stop at token k (as a stop string does) ends the row with its first k tokens for
    AR and speculative decoding alike; nothing after k is emitted or counted; other rows go on."""
    t, d = tiny["target"], tiny["same"]
    full = make_decoder(t).generate(tiny["prompts"], max_new_tokens=20, eos_ids=[]).tokens
    stop_at = {0: 3, 2: 7}
    fn = lambda i, toks: stop_at[i] if i in stop_at and len(toks) >= stop_at[i] else None  # noqa: E731
    for dec in (make_decoder(t), make_decoder(t, d, 4)):
        res = dec.generate(tiny["prompts"], max_new_tokens=20, eos_ids=[], stop_fn=fn, rounds_per_chunk=1)
        for i in range(3):
            k = stop_at.get(i, 20)
            assert res.tokens[i] == full[i][:k]
            s = res.stats[i]
            assert s["new_tokens"] == k and s["finish_reason"] == ("stop" if i in stop_at else "length")
            assert s["accepted_tokens"] <= k
    # speculative: the stop at 3 lands inside the first 5-token block (γ 4, every draft accepted)
    s0 = res.stats[0]
    assert s0["target_calls"] == 1 and s0["accepted_tokens"] == 3 and s0["accept_hist"] == [0, 0, 0, 1, 0]


def test_stop_token_ids_per_row(tiny):
    t = tiny["target"]
    full = make_decoder(t).generate(tiny["prompts"], max_new_tokens=12, eos_ids=[]).tokens
    stops = [[full[0][4]], [], [full[2][2], full[2][6]]]
    for dec in (make_decoder(t), make_decoder(t, tiny["same"], 4)):
        res = dec.generate(tiny["prompts"], max_new_tokens=12, eos_ids=[], stop_token_ids=stops)
        assert res.tokens[0] == full[0][: full[0].index(stops[0][0]) + 1]
        assert res.tokens[1] == full[1] and res.stats[1]["finish_reason"] == "length"
        assert res.stats[0]["finish_reason"] == "stop" and len(res.tokens[2]) <= 7
    with pytest.raises(ValueError, match="vocabulary"):
        make_decoder(t).generate(tiny["prompts"], stop_token_ids=[10 ** 6])


# --------------------------------------------------------------------------- logprobs
def _teacher_forced_logprobs(model, prompt, toks, temperature):
    """log p of each emitted token from one full forward of prompt + tokens (processed p)."""
    from test_decode import full_logits  # noqa: E402  (the shared reference forward)

    z = full_logits(model, [list(prompt) + list(toks)])[0, len(prompt) - 1: len(prompt) - 1 + len(toks)]
    if temperature == 0:
        lp = jax.nn.log_softmax(z, axis=-1)
    else:
        lp = jax.nn.log_softmax(z / temperature, axis=-1)
    return np.asarray(lp)[np.arange(len(toks)), toks], np.asarray(lp)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_autoregressive_equals_speculative(tiny, temperature):
    """Every emitted token's log-probability and top-N: AR == speculative ≤ 1e-5 (greedy, same
    tokens), and both equal a teacher-forced full forward (sampled: on the speculative tokens)."""
    from specjax.io.loading import truncate_model

    t = tiny["target"]
    d = ModelDrafter.from_model(truncate_model(t, 1), name="first1")  # accepts some drafts, rejects others
    sp = SamplingParams.create(3, temperature=temperature)
    ar = make_decoder(t).generate(tiny["prompts"], max_new_tokens=12, eos_ids=[], logprobs=4, sampling=sp, seed=3)
    spec = make_decoder(t, d, 3).generate(tiny["prompts"], max_new_tokens=12, eos_ids=[], logprobs=4,
                                          sampling=sp, seed=3)
    for res in (ar, spec):
        for i, row in enumerate(res.logprobs):
            toks = res.tokens[i]
            assert [r["id"] for r in row] == toks
            want, lp = _teacher_forced_logprobs(t, tiny["prompts"][i], toks, temperature)
            np.testing.assert_allclose([r["logprob"] for r in row], want, atol=1e-5)
            for k, r in enumerate(row):
                assert len(r["top"]) == 4
                ids = [j for j, _ in r["top"]]
                np.testing.assert_allclose([v for _, v in r["top"]], lp[k, ids], atol=1e-5)
                assert [v for _, v in r["top"]] == sorted((v for _, v in r["top"]), reverse=True)
    if temperature == 0:
        assert ar.tokens == spec.tokens
        for a, b in zip(ar.logprobs, spec.logprobs):
            np.testing.assert_allclose([r["logprob"] for r in a], [r["logprob"] for r in b], atol=1e-5)
        assert sum(s["accepted_tokens"] for s in spec.stats) > 0  # blocks were verified
    with pytest.raises(ValueError, match="logprobs"):
        make_decoder(t).generate(tiny["prompts"], logprobs=-1)


# --------------------------------------------------------------------------- seeds
def test_seeds_use_all_64_bits():
    seeds = [0, 1, 2 ** 32, 2 ** 40, 2 ** 63, 2 ** 64 - 1, 2 ** 32 + 1]
    keys = {tuple(np.asarray(request_keys(s, 1))[0].tolist()) for s in seeds}
    assert len(keys) == len(seeds)
    for s in (0, 7, 2 ** 32 - 1):  # below 2**32: jax.random.PRNGKey's key (earlier runs reproduce)
        assert np.array_equal(seed_key(s), np.asarray(jax.random.PRNGKey(s)))
    for bad in (-1, SEED_LIMIT, 2 ** 70, 1.5, True):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
            request_keys(bad, 1)


def test_cli_stop_escapes():
    assert cli.unescape(r"\n\n") == "\n\n" and cli.unescape(r"a\tb") == "a\tb"
    assert cli.unescape(r"\\n") == "\\n" and cli.unescape("café ⏎") == "café ⏎"


def test_cli_seed_errors(capsys, monkeypatch):
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    for bad in ("-1", str(2 ** 64)):
        assert cli.main(["generate", "hi", "--seed", bad, "--model", "/nonexistent-model"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("specjax: error:") and "2**64" in err[0], err


# --------------------------------------------------------------------------- text layer (real tokenizer)
@pytest.mark.slow
def test_text_stream_never_splits_utf8_and_equals_final_text(default_model):
    tok = default_model.tokenizer
    text = "Zoë said: 世界 🎉🎉 — naïve café, 12345 ok"
    ids = tok.encode(text)
    for step in (1, 2, 3):
        ts, pieces = TextStream(tok), []
        for k in range(0, len(ids), step):
            pieces.append(ts.feed(ids[k:k + step]))
        pieces.append(ts.feed([], final=True))
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == tok.decode(ids) == text
    # a stop string: cut before it, held back until it is certain
    ts = TextStream(tok, stop=["café"])
    shown = "".join(ts.feed([i]) for i in ids) + ts.feed([], final=True)
    assert shown == text[: text.index("café")]
    k = stop_cut(tok, ids, ["café"])
    assert "café" in tok.decode(ids[:k]) and "café" not in tok.decode(ids[: k - 1])
    assert stop_cut(tok, ids, ["absent"]) is None


REAL_PROMPTS = ["Count: one two three one two three one two three", "List the days of the week."]


@pytest.fixture(scope="module")
def real(default_model):
    from specjax.io import shipped

    return dict(model=default_model, ngram=NgramDrafter(3), default=shipped.load_default_drafter(default_model))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "default"])
def test_real_stop_string_inside_accepted_block(real, kind):
    """A stop string completed on an accepted draft token inside a multi-token block: speculative
    text, tokens and finish_reason == autoregressive; the counters end at the stop."""
    m, d = real["model"], real[kind]
    kw = dict(max_new_tokens=40, chat=True, ignore_eos=True)
    dec_ar, dec_sp = make_decoder(m), make_decoder(m, d, 4)
    found = False
    for prompt in REAL_PROMPTS:
        ids = specjax.api.encode_prompts(m, [prompt], True)
        blocks = [c[0] for c in dec_sp.stream(ids, rounds_per_chunk=1, max_new_tokens=40, eos_ids=[])]
        out, pos = sum(blocks, []), 0
        for blk in blocks:
            for j in range(len(blk) - 1):  # an accepted draft, not the block's last token
                piece = m.tokenizer.decode(out[: pos + j + 1])[-6:]
                if len(piece.strip()) >= 3 and piece not in m.tokenizer.decode(out[: pos + j]):
                    stop = piece
                    break
            else:
                pos += len(blk)
                continue
            break
        else:
            continue
        found = True
        a = generate_text(m, [prompt], decoder=dec_ar, stop=[stop], **kw)[0]
        s = generate_text(m, [prompt], decoder=dec_sp, stop=[stop], **kw)[0]
        assert a["text"] == s["text"] and a["tokens"] == s["tokens"], (stop, a["text"], s["text"])
        assert a["stats"]["finish_reason"] == s["stats"]["finish_reason"] == "stop"
        assert stop not in s["text"] and (s["text"] + stop) in m.tokenizer.decode(out)
        st = s["stats"]
        assert st["new_tokens"] == len(s["tokens"]) and st["accepted_tokens"] <= st["new_tokens"]
        # streaming pieces add up to the final text
        pieces: list[str] = []
        generate_text(m, [prompt], decoder=dec_sp, stop=[stop], on_text=lambda i, p: pieces.append(p), **kw)
        assert "".join(pieces) == s["text"]
    assert found, "no multi-token block with an accepted draft to stop on"


@pytest.mark.slow
def test_real_logprobs_autoregressive_equals_speculative(real):
    """GATE: logprobs equal between AR and speculative decoding (≤ 2e-5, float32, n-gram γ 4)."""
    m = real["model"]
    kw = dict(max_new_tokens=24, chat=True, logprobs=3)
    a = generate_text(m, REAL_PROMPTS, decoder=make_decoder(m), **kw)
    s = generate_text(m, REAL_PROMPTS, decoder=make_decoder(m, real["ngram"], 4), **kw)
    assert sum(o["stats"]["accepted_tokens"] for o in s) > 0
    for x, y in zip(a, s):
        assert x["tokens"] == y["tokens"]
        assert [r["id"] for r in x["logprobs"]] == x["tokens"]
        # float32: the one-token step and the γ+1-token verify call run on XLA CPU kernels that
        # round differently (docs/design.md, "Batch invariance"); ≈ 1.5e-5 seen after 30 layers
        np.testing.assert_allclose([r["logprob"] for r in x["logprobs"]], [r["logprob"] for r in y["logprobs"]],
                                   atol=2e-5)
        for r, q in zip(x["logprobs"], y["logprobs"]):
            assert [t["id"] for t in r["top_logprobs"]] == [t["id"] for t in q["top_logprobs"]]
            assert r["top_logprobs"][0]["id"] == r["id"]  # greedy: the emitted token is the argmax
            assert isinstance(r["token"], str)


@pytest.mark.slow
def test_real_drafter_equal_to_target_eos_in_block(real):
    """The issue's case: drafter == target, chat "What is 2+2?", γ 8: accepted ≤ new tokens."""
    m = real["model"]
    same = ModelDrafter.from_model(m, name="same")
    o = generate_text(m, ["What is 2+2?"], decoder=make_decoder(m, same, 8), chat=True, max_new_tokens=32)[0]
    st = o["stats"]
    assert st["finish_reason"] == "eos" and st["accepted_tokens"] <= st["new_tokens"] == len(o["tokens"])
    assert st["checked_tokens"] <= st["drafted_tokens"] and sum(st["accept_hist"]) == st["target_calls"]


# --------------------------------------------------------------------------- CLI: streaming, stdin, chat default
@pytest.mark.slow
def test_cli_streams_text_equal_to_json_and_reads_stdin(default_model, capsys, monkeypatch):
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    args = ["--max-new-tokens", "12", "--draft", "ngram", "--gamma", "2"]
    assert cli.main(["generate", "Name three colors.", "--json", *args]) == 0  # the real load, once
    rec = json.loads(capsys.readouterr().out)
    from specjax.io import loading  # later runs reuse the session's model (the load is not under test)

    monkeypatch.setattr(loading, "load_model", lambda path=None, dtype="float32", mesh=None, **kw: default_model)
    assert cli.main(["generate", "Name three colors.", *args]) == 0
    out, err = capsys.readouterr()
    assert out == rec["text"] + "\n"
    assert "chat template" in err and "loading" in err and "streaming" in err  # phase lines on stderr
    chat_ids = specjax.api.encode_prompts(default_model, ["Name three colors."], True)[0]
    assert rec["tokens"] == generate_text(default_model, ["Name three colors."], chat=True, max_new_tokens=12)[0]["tokens"]
    assert len(chat_ids) > 5
    # standard input: '-' and piped input with no prompt
    for argv in (["generate", "-", "--json", *args], ["generate", "--json", *args]):
        monkeypatch.setattr(sys, "stdin", FakeStdin("Name three colors.".encode(), tty=False))
        assert cli.main(argv) == 0
        assert json.loads(capsys.readouterr().out)["tokens"] == rec["tokens"]
    # two prompts stream one after the other, each text ending its own line
    assert cli.main(["generate", "--prompt", "Name three colors.", "--prompt", "Name a fruit.", *args]) == 0
    out = capsys.readouterr().out
    assert cli.main(["generate", "--prompt", "Name three colors.", "--prompt", "Name a fruit.", "--json", *args]) == 0
    recs = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert out == recs[0]["text"] + "\n" + recs[1]["text"] + "\n"
    # --no-chat sends raw text
    assert cli.main(["generate", "Name three colors.", "--json", "--no-chat", *args]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["tokens"] == generate_text(default_model, ["Name three colors."], chat=False, max_new_tokens=12)[0]["tokens"]
