"""Distillation (``specjax distill``) and the shipped default drafter.

Gates: (a) training a tiny EAGLE drafter for a tiny peaked target raises greedy α from
below 0.3 to above 0.6 within a minute; (b) SIGKILL at a random step + ``--resume``
gives bitwise the same final parameters as an uninterrupted run, and a half-written
checkpoint directory is never loaded; (c) the shipped drafter loads, rejects another
target, and greedy speculative decoding with it equals greedy autoregressive decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("SPECJAX_TEST_CACHE", os.path.join(ROOT, ".jax_cache"))

TINY_FLAGS = ["--sub-vocab", "64", "--intermediate", "64", "--window", "32", "--batch-size", "8",
              "--max-new-tokens", "20", "--max-prompt-tokens", "12", "--gen-batch", "16", "--lr", "3e-3",
              "--warmup", "5"]


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A peaked tiny target saved as a HF directory, 40 token-id prompts, and one shared data set."""
    from specjax.io.loading import save_model

    d = tmp_path_factory.mktemp("distill")
    target = tiny_model(0, scale=20.0)
    save_model(target, str(d / "target"))
    rng = np.random.default_rng(0)
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(40):
            ids = rng.integers(2, 128, size=int(rng.integers(3, 12))).tolist()
            f.write(json.dumps({"question_id": i, "category": f"c{i % 2}", "ids": ids}) + "\n")
    return d


def _args(setup, out, *extra):
    from specjax.cli.distill import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(["--model", str(setup / "target"), "--out", str(out), "--prompts",
                         str(setup / "prompts.jsonl"), *TINY_FLAGS, *extra])


def test_gate_distill_raises_alpha(tiny_setup):
    from specjax.train import distill

    # CPU seconds of this process (XLA's threads included): the gate's "within a minute" is the
    # work, which wall time on a shared machine does not measure.
    t0 = time.process_time()
    res = distill.run(_args(tiny_setup, tiny_setup / "gate_a", "--steps", "150", "--eval-every", "75",
                            "--checkpoint-every", "75"))
    elapsed = time.process_time() - t0
    hist = json.loads((tiny_setup / "gate_a" / "history.json").read_text())
    assert hist[0]["step"] == 0 and hist[0]["alpha"] < 0.3, hist[0]
    assert res["final"]["alpha"] > 0.6, res["final"]
    assert elapsed < 60, f"distillation took {elapsed:.0f}s"
    # the exported drafter is exact: greedy speculative == greedy autoregressive on the tiny target
    from specjax.runtime.decoder import Decoder
    from specjax.drafters import eagle
    from specjax.io.loading import load_model

    target = load_model(str(tiny_setup / "target"))
    dr = eagle.load_drafter(str(tiny_setup / "gate_a" / "drafter"), target)
    prompts = [[5, 9, 17, 3], [44], [7, 7, 8, 100, 2, 3]]
    ar = Decoder(target).generate(prompts, max_new_tokens=16, eos_ids=[])
    sp = Decoder(target, dr, 3).generate(prompts, max_new_tokens=16, eos_ids=[])
    assert sp.tokens == ar.tokens
    assert sum(s["accepted_tokens"] for s in sp.stats) > 0


def test_refuses_existing_out(tiny_setup, tmp_path):
    from specjax.train import distill

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="--resume"):
        distill.run(_args(tiny_setup, out, "--steps", "1"))
    with pytest.raises(ValueError, match="not a specjax distill run"):
        distill.run(_args(tiny_setup, out, "--steps", "1", "--resume"))
    assert (out / "notes.txt").read_text() == "mine" and sorted(os.listdir(out)) == ["notes.txt"]


def _cli(setup, out, data_dir, *extra):
    return [sys.executable, "-m", "specjax.cli", "distill", "--model", str(setup / "target"), "--out", str(out),
            "--prompts", str(setup / "prompts.jsonl"), "--data-dir", str(data_dir), *TINY_FLAGS,
            "--steps", "24", "--eval-every", "0", "--checkpoint-every", "3", "--seed", "3", *extra]


def _tensors(out):
    from safetensors.numpy import load_file

    return load_file(str(out / "drafter" / "model.safetensors"))


def test_gate_sigkill_resume_bitwise(tiny_setup):
    from specjax.train import distill

    data_dir = tiny_setup / "gate_a" / "data"
    if not data_dir.exists():  # gate (a) not run (e.g. -k): make the data set here
        distill.run(_args(tiny_setup, tiny_setup / "data_only", "--steps", "0", "--eval-every", "0"))
        data_dir = tiny_setup / "data_only" / "data"
    env = dict(os.environ, SPECJAX_CACHE=os.path.abspath(CACHE), SPECJAX_NO_PROGRESS="1", PYTHONPATH=ROOT)
    ref, killed = tiny_setup / "ref", tiny_setup / "killed"
    # the interrupted run: SIGKILL once a random checkpoint step exists
    kill_at = random.Random().choice([3, 6, 9, 12, 15, 18])
    proc = subprocess.Popen(_cli(tiny_setup, killed, data_dir), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 90
    ck = killed / "ckpt"
    while time.time() < deadline and proc.poll() is None:
        if ck.exists() and any(n.isdigit() and int(n) >= kill_at for n in os.listdir(ck)):
            break
        time.sleep(0.05)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill (rc {proc.returncode})"
    steps = sorted(int(n) for n in os.listdir(ck) if n.isdigit())
    assert steps and steps[-1] < 24 and not (killed / "drafter").exists()
    # a half-written checkpoint (what a crash mid-save leaves: orbax's temporary directory),
    # and a step directory without orbax's metadata: neither may be loaded
    bad = ck / "21.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(ck / str(steps[-1]), bad)
    for p in sorted(bad.rglob("*")):
        if p.is_file():
            p.write_bytes(b"\0garbage")
    bad2 = ck / "22"
    bad2.mkdir()
    (bad2 / "default").mkdir()
    r = subprocess.run(_cli(tiny_setup, killed, data_dir, "--resume"), env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"restored checkpoint at step {steps[-1]}" in r.stderr
    assert "skipping incomplete checkpoint" in r.stderr
    # the uninterrupted reference (same seed)
    r = subprocess.run(_cli(tiny_setup, ref, data_dir), env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _tensors(ref), _tensors(killed)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs after resume"


def test_shipped_drafter_default_model(default_model):
    import dataclasses

    import jax.numpy as jnp

    from specjax.io import shipped
    from specjax.api import load_drafter
    from specjax.models.config import CheckpointError
    from specjax.runtime.decoder import Decoder

    dr = load_drafter("default", default_model)
    assert dr.config.hidden_size == default_model.config.hidden_size
    assert dr.config.feature_layers == (1, 14, 27) and dr.config.copy_ngram == 3  # EAGLE-3-style, copy term
    # another target (one weight tensor changed; a tiny model) is refused
    params = default_model.params
    other = default_model.replace(params=jax_tree_scale_embed(params), name="other")
    with pytest.raises(CheckpointError, match="trained for"):
        shipped.load_default_drafter(other)
    with pytest.raises(CheckpointError):
        shipped.load_default_drafter(tiny_model(0))
    tok = default_model.tokenizer
    ids = tok.encode(tok.apply_chat_template("Name three colors of the rainbow."), add_special_tokens=False)
    ar = Decoder(default_model).generate([ids], max_new_tokens=24)
    sp = Decoder(default_model, dr, 2).generate([ids], max_new_tokens=24)
    assert sp.tokens == ar.tokens
    assert sp.stats[0]["accepted_tokens"] > 0
    # the int8 weight format: still exact, still accepting
    d8 = load_drafter("default", default_model, dtype="int8")
    assert d8.params["frozen"]["head"].dtype == jnp.uint8
    s8 = Decoder(default_model, d8, 1).generate([ids], max_new_tokens=24)
    assert s8.tokens == ar.tokens
    assert s8.stats[0]["accepted_tokens"] > 0
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        shipped.load_default_drafter(default_model, dtype="float16")


def jax_tree_scale_embed(params):
    import jax

    p = jax.tree_util.tree_map(lambda x: x, params)
    p["embed"].value = p["embed"].value * 1.5
    return p


def test_sampled_continuations_are_seeded_and_eval_stays_greedy(tiny_setup, tmp_path):
    """``--samples-per-prompt 3``: sample 0 is the greedy continuation (identical to a
    one-sample data set), samples 1..2 are sampled (they differ from greedy on a target
    whose logits are not peaked), the same seed gives the same tokens, and the questions
    in ``greedy_only`` (the eval split) get only their greedy continuation."""
    from specjax.train.common import DistillError
    from specjax.train.data import collect_data, collect_parts, generate_data
    from specjax.io.loading import load_model

    target = load_model(str(tiny_setup / "target"), dtype="float32")
    flat = tiny_model(1)  # not peaked: sampling at temperature 1 leaves the greedy path
    recs = [{"question_id": i, "category": "c", "ids": [3 + i, 7, 11 + i]} for i in range(4)]
    kw = dict(max_new_tokens=12, batch=8, chat=False, max_prompt_tokens=8, topk=4)

    def gen(model, name, **extra):
        generate_data(model, recs, parts_dir=str(tmp_path / name), log=lambda *_: None, **kw, **extra)
        return collect_parts(str(tmp_path / name))

    one, _ = gen(flat, "one")
    three, arr = gen(flat, "three", samples=3, temperature=1.0, seed=5, greedy_only={3})
    again, arr2 = gen(flat, "again", samples=3, temperature=1.0, seed=5, greedy_only={3})
    key = lambda q: (q["question_id"], q["sample"])
    assert sorted(map(key, three)) == sorted([(q, k) for q in range(3) for k in range(3)] + [(3, 0)])
    greedy = {q["question_id"]: q["ids"] for q in one}
    by = {key(q): q["ids"] for q in three}
    assert all(by[(q, 0)] == greedy[q] for q in range(4))
    assert sum(by[(q, k)] != greedy[q] for q in range(3) for k in (1, 2)) >= 4
    assert [q["ids"] for q in three] == [q["ids"] for q in again]
    np.testing.assert_array_equal(arr["hidden"], arr2["hidden"])
    # merging data sets (--data-dir A B C): continuations present in several are kept once
    other, oarr = gen(flat, "other", samples=2, temperature=1.0, seed=6)
    merged, marr = collect_data([str(tmp_path / n) for n in ("three", "again", "other")])
    mkey = lambda q: (q["question_id"], q["sample"], q["seed"] if q["sample"] else None)
    assert len(merged) == len({mkey(q) for q in merged}) == len(three) + 4  # + seed 6's sample 1 of q0..q3
    sources = [(q, arr) for q in three] + [(q, oarr) for q in other]
    for q in merged:
        src, sarr = next((p, a) for p, a in sources if mkey(p) == mkey(q))
        assert q["ids"] == src["ids"]
        for name in ("hidden", "argmax", "topk_p"):
            np.testing.assert_array_equal(marr[name][q["offset"]: q["offset"] + len(q["ids"])],
                                          sarr[name][src["offset"]: src["offset"] + len(src["ids"])])
    with pytest.raises(DistillError, match="samples per prompt"):
        generate_data(target, recs, parts_dir=str(tmp_path / "bad"), samples=0, **kw)


def test_copy_term_fit_keeps_the_drafter_and_stays_exact(tiny_setup, tmp_path):
    """``--copy-ngram 2 --init-from D --train-only copy``: the drafter's own weights and
    sub-vocabulary are kept bitwise, only the copy term moves; the exported drafter
    reloads with its copy term, and greedy speculative decoding with it equals greedy
    autoregressive decoding. Bad combinations are refused with the fix named."""
    from specjax.train import distill
    from specjax.runtime.decoder import Decoder
    from specjax.drafters import eagle
    from specjax.io.loading import load_model

    base = tiny_setup / "gate_a" / "drafter"
    data_dir = tiny_setup / "gate_a" / "data"
    if not base.exists():  # gate (a) not run (e.g. -k)
        distill.run(_args(tiny_setup, tiny_setup / "gate_a", "--steps", "150", "--eval-every", "0"))
    out = tmp_path / "copy"
    res = distill.run(_args(tiny_setup, out, "--data-dir", str(data_dir), "--init-from", str(base),
                            "--copy-ngram", "2", "--train-only", "copy", "--steps", "30", "--eval-every", "30",
                            "--checkpoint-every", "30"))
    before, after = _tensors(tiny_setup / "gate_a"), _tensors(out)
    assert set(after) == set(before) | {"copy_w", "copy_b"}
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    assert np.abs(after["copy_b"]).max() > 0.1 and np.abs(after["copy_w"]).max() > 0
    assert 0 <= res["final"]["alpha"] <= 1
    target = load_model(str(tiny_setup / "target"))
    dr = eagle.load_drafter(str(out / "drafter"), target)
    assert dr.config.copy_ngram == 2
    prompts = [[5, 9, 17, 3, 5, 9], [44], [7, 7, 8, 100, 7, 7, 8]]
    ar = Decoder(target).generate(prompts, max_new_tokens=16, eos_ids=[])
    for gamma in (1, 3):
        sp = Decoder(target, dr, gamma).generate(prompts, max_new_tokens=16, eos_ids=[])
        assert sp.tokens == ar.tokens, gamma
    # dynamic draft length: a confidence floor offers fewer drafts, the output is unchanged
    drafted = lambda r: sum(x["drafted_tokens"] for x in r.stats)
    full = Decoder(target, dr, 3).generate(prompts, max_new_tokens=16, eos_ids=[])
    picky = eagle.load_drafter(str(out / "drafter"), target, min_confidence=0.9)
    sp = Decoder(target, picky, 3).generate(prompts, max_new_tokens=16, eos_ids=[])
    assert sp.tokens == ar.tokens and drafted(sp) < drafted(full)
    with pytest.raises(ValueError, match="min_confidence"):
        eagle.load_drafter(str(out / "drafter"), target, min_confidence=1.5)
    with pytest.raises(ValueError, match="--init-from"):
        distill.run(_args(tiny_setup, tmp_path / "bad1", "--data-dir", str(data_dir), "--copy-ngram", "2",
                          "--train-only", "copy", "--steps", "1"))
    with pytest.raises(ValueError, match="--ce full"):
        distill.run(_args(tiny_setup, tmp_path / "bad2", "--data-dir", str(data_dir), "--copy-ngram", "2",
                          "--ce", "topk", "--steps", "1"))


def test_self_prompts_are_seeded_and_kept(tmp_path, default_model):
    """Magpie-style prompts: written once (a second call reads the file, nothing is
    regenerated), the same for the same seed, named self-<seed>-<i>."""
    from conftest import tiny_config
    from specjax.train.data import self_prompts
    from specjax.io.loading import Model
    from specjax.models import llama

    v = default_model.config.vocab_size
    cfg = tiny_config(vocab_size=v, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                      eos_token_ids=tuple(default_model.config.eos_token_ids))
    gd, params = llama.init_model(cfg, seed=0)
    m = Model(cfg, gd, params, default_model.tokenizer, name="tiny-tok")
    a = self_prompts(m, 6, 3, str(tmp_path / "a.jsonl"), max_tokens=8, batch=4, log=lambda *_: None)
    b = self_prompts(m, 6, 3, str(tmp_path / "b.jsonl"), max_tokens=8, batch=4, log=lambda *_: None)
    assert a == b and 0 < len(a) <= 6
    assert all(r["question_id"].startswith("self-3-") and r["category"] == "self" and r["turns"][0] for r in a)
    mtime = os.path.getmtime(tmp_path / "a.jsonl")
    assert self_prompts(None, 6, 3, str(tmp_path / "a.jsonl")) == a  # read back, no model needed
    assert os.path.getmtime(tmp_path / "a.jsonl") == mtime


def test_resume_of_a_checkpoint_with_another_parameter_tree_is_one_line(tmp_path):
    """A checkpoint written with other parameter names (e.g. a run from before the fused
    w_qkv / w_gate_up layout: wq, wk, wv, w_gate, w_up) is refused with one DistillError naming
    the step, the directory and the fix — not an orbax traceback."""
    import optax

    from specjax.train.common import DistillError
    from specjax.train.loop import TrainState, open_checkpoints, restore_latest, save_checkpoint

    opt = optax.adam(1e-3)
    old = {"wq": np.zeros((4, 4), np.float32), "w_gate": np.ones((4, 8), np.float32)}
    ckdir = str(tmp_path / "ckpt")
    mngr = open_checkpoints(ckdir)
    save_checkpoint(mngr, TrainState(old, opt.init(old), step=3))
    new = {"w_qkv": np.zeros((4, 1, 3, 4), np.float32), "w_gate_up": np.ones((4, 2, 8), np.float32)}
    state = TrainState(new, opt.init(new))
    with pytest.raises(DistillError) as e:
        restore_latest(open_checkpoints(ckdir), ckdir, state, str(tmp_path / "history.json"))
    msg = str(e.value)
    assert "\n" not in msg and "step 3" in msg and ckdir in msg and "new run" in msg
    assert state.step == 0 and state.params is new


def test_fused_features_ttt_learns_and_time_budget_resume_is_bitwise(tiny_setup):
    """An EAGLE-3-style run (fused features of both blocks, training-time test over 3 steps):
    held-out α rises at every draft position; a run stopped by ``--time-budget`` and resumed
    ends bitwise equal to an uninterrupted one; data of another feature width is refused."""
    from specjax.train import distill
    from specjax.train.common import DistillError

    fused = ["--feature-layers", "0,1", "--ttt-steps", "3", "--unroll-weight", "1", "--seed", "5"]
    distill.run(_args(tiny_setup, tiny_setup / "f_data", "--steps", "0", "--eval-every", "0", *fused))
    data = str(tiny_setup / "f_data" / "data")
    common = ["--data-dir", data, "--steps", "40", "--checkpoint-every", "10", *fused]
    ref = distill.run(_args(tiny_setup, tiny_setup / "f_ref", "--eval-every", "40", *common))
    hist = json.loads((tiny_setup / "f_ref" / "history.json").read_text())
    first, last = hist[0]["alpha_by_position"], hist[-1]["alpha_by_position"]
    assert len(last) == 4 and all(b > a + 0.1 for a, b in zip(first[:3], last[:3])), (first, last)
    part = distill.run(_args(tiny_setup, tiny_setup / "f_cut", "--eval-every", "0", "--time-budget", "1e-9", *common))
    assert part["step"] == 1
    done = distill.run(_args(tiny_setup, tiny_setup / "f_cut", "--eval-every", "0", "--resume", *common))
    assert done["step"] == 40 and ref["step"] == 40
    a, b = _tensors(tiny_setup / "f_ref"), _tensors(tiny_setup / "f_cut")
    assert sorted(a) == sorted(b) and "fuse" in a
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs after a time-budget stop and --resume"
    with pytest.raises(DistillError, match="features of width"):
        distill.run(_args(tiny_setup, tiny_setup / "f_bad", "--data-dir", data, "--steps", "1"))
    # --init-from a fused drafter: a warm start with the same blocks (fuse kept at step 0), refused otherwise
    warm = distill.run(_args(tiny_setup, tiny_setup / "f_warm", "--init-from", str(tiny_setup / "f_ref" / "drafter"),
                             "--data-dir", data, "--steps", "2", "--eval-every", "0", "--lr", "1e-30", *fused))
    assert warm["step"] == 2
    w = _tensors(tiny_setup / "f_warm")
    assert w["fuse"].tobytes() == a["fuse"].tobytes()  # lr 1e-30: steps below float32 resolution, the warm start kept
    with pytest.raises(DistillError, match="pass --feature-layers 0,1"):
        distill.run(_args(tiny_setup, tiny_setup / "f_bad2", "--init-from", str(tiny_setup / "f_ref" / "drafter"),
                          "--data-dir", data, "--steps", "1"))
    with pytest.raises(DistillError, match="pass --feature-layers 0,1"):
        distill.run(_args(tiny_setup, tiny_setup / "f_bad3", "--init-from", str(tiny_setup / "f_ref" / "drafter"),
                          "--data-dir", data, "--steps", "1", "--feature-layers", "1"))


def test_feature_layers_outside_the_target_leave_nothing_behind(tiny_setup):
    """``--feature-layers 99`` on a 2-block target (checked after the load): one error, and the run's
    ``run.json`` and the directory it created are gone, so the corrected command starts afresh
    (new-user pass: a later run said "holds only the run.json of a run that never started")."""
    from specjax.train import distill

    out = tiny_setup / "fl_bad"
    with pytest.raises(ValueError, match=r"feature layers \[99\] are not blocks of a 2-block model"):
        distill.run(_args(tiny_setup, out, "--steps", "0", "--feature-layers", "0,99"))
    assert not out.exists()
    out.mkdir()  # a directory the user made stays, empty as it was
    with pytest.raises(ValueError, match="not blocks"):
        distill.run(_args(tiny_setup, out, "--steps", "0", "--feature-layers", "99"))
    assert out.is_dir() and not list(out.iterdir())


def test_evaluate_without_eval_sequences_reports_no_data():
    from specjax.train.loop import evaluate

    res = evaluate(None, None, None, [], {}, [], None, 8, 4, 2)
    assert res["alpha"] is None and res["alpha_by_position"] == [None, None] and res["by_category"] == {}
