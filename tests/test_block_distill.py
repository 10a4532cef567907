"""``specjax distill --arch block``: training a block (DFlash-style parallel) drafter.

(a) On a tiny peaked target, a few dozen steps lower the held-out loss and raise slot-1 greedy
agreement; (b) SIGKILL during training + ``--resume`` exports bitwise the drafter of an
uninterrupted run; (c) the exported drafter is recognized as kind ``block``, loads, and greedy
speculative decoding with it equals autoregressive decoding (with drafts accepted); (d) bad block
flags are one-line errors before anything is loaded or written.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("SPECJAX_TEST_CACHE", os.path.join(ROOT, ".jax_cache"))

FLAGS = ["--arch", "block", "--sub-vocab", "64", "--intermediate", "64", "--window", "32", "--batch-size", "8",
         "--max-new-tokens", "20", "--max-prompt-tokens", "12", "--gen-batch", "16", "--lr", "3e-3", "--warmup", "5",
         "--feature-layers", "0,1", "--block-size", "4", "--anchors", "8", "--layers", "1"]


def peaked_target():
    """A tiny untied target with a peaked, non-trivial next-token map: embedding ×4 and head ×30
    (top-1 probability ≈ 0.65; greedy continuations wander before they cycle). A tied tiny target
    only repeats its last token, an untied one with the plain head is nearly uniform."""
    t = tiny_model(0, scale=4.0)
    t.params["lm_head"][...] = t.params["lm_head"][...] * 30.0
    return t


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The peaked target saved as a HF directory, 40 token-id prompts and one data set (``data``)."""
    from specjax.io.loading import save_model
    from specjax.train import block_distill

    d = tmp_path_factory.mktemp("block_distill")
    save_model(peaked_target(), str(d / "target"))
    rng = np.random.default_rng(0)
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(40):
            ids = rng.integers(2, 128, size=int(rng.integers(3, 12))).tolist()
            f.write(json.dumps({"question_id": i, "category": f"c{i % 2}", "ids": ids}) + "\n")
    block_distill.run(_args(d, d / "data_run", "--steps", "0", "--eval-every", "0"))
    return d


def _args(setup, out, *extra):
    from specjax.cli.distill import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(["--model", str(setup / "target"), "--out", str(out), "--prompts",
                         str(setup / "prompts.jsonl"), *FLAGS, *extra])


def _data(setup):
    return str(setup / "data_run" / "data")


@pytest.fixture(scope="module")
def trained(setup):
    """An 80-step run (held-out evaluation at steps 0, 40, 80): ``(run directory, result)``."""
    from specjax.train import block_distill

    out = setup / "trained"
    res = block_distill.run(_args(setup, out, "--data-dir", _data(setup), "--steps", "80", "--eval-every", "40",
                                  "--checkpoint-every", "40"))
    return out, res


def _tensors(out):
    from safetensors.numpy import load_file

    return load_file(str(out / "drafter" / "model.safetensors"))


def test_training_lowers_held_out_loss_and_raises_agreement(trained):
    out, res = trained
    hist = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in hist] == [0, 40, 80]
    first, last = hist[0], hist[-1]
    assert len(last["agreement_by_slot"]) == 4 and len(last["alpha_by_position"]) == 4
    assert last["positions"] == first["positions"] > 100
    assert last["loss"] < first["loss"] - 5.0, (first["loss"], last["loss"])
    assert first["agreement_by_slot"][0] < 0.1 and last["agreement_by_slot"][0] > first["agreement_by_slot"][0] + 0.15
    assert last["accepted_per_round"] > first["accepted_per_round"] + 0.15
    assert sorted(last["by_category"]) == ["c0", "c1"]
    assert res["step"] == 80 and res["final"]["alpha"] == last["alpha"]
    meta = json.loads((out / "drafter" / "block_drafter.json").read_text())
    assert meta["config"]["block_size"] == 4 and meta["config"]["num_layers"] == 1
    assert meta["settings"]["arch"] == "block" and meta["settings"]["position_decay"] == 2.0
    assert meta["eval"]["alpha_by_position"] == last["alpha_by_position"] and meta["data"]["train_sequences"] == 30


def test_exported_drafter_is_a_block_drafter_and_exact(trained):
    from specjax.drafters import block, registry
    from specjax.io.loading import load_model
    from specjax.runtime.decoder import Decoder

    out, _ = trained
    spec = str(out / "drafter")
    kind = registry.check_spec(spec)
    assert kind is registry.find_kind(spec) and kind.name == "block"
    target = load_model(str(out.parent / "target"))
    dr = kind.load(spec, target, "float32")
    assert isinstance(dr, block.BlockDrafter) and dr.config.block_size == 4
    assert block.load_drafter(spec, target).config == dr.config
    prompts = [[5, 9, 17, 3], [44, 7], [7, 7, 8, 100, 2, 3]]
    ar = Decoder(target).generate(prompts, max_new_tokens=16, eos_ids=[])
    sp = Decoder(target, dr, 4).generate(prompts, max_new_tokens=16, eos_ids=[])
    assert sp.tokens == ar.tokens
    assert sum(s["accepted_tokens"] for s in sp.stats) > 0, sp.stats


def _cli(setup, out, *extra):
    return [sys.executable, "-m", "specjax.cli", "distill", "--model", str(setup / "target"), "--out", str(out),
            "--prompts", str(setup / "prompts.jsonl"), "--data-dir", _data(setup), *FLAGS,
            "--steps", "40", "--eval-every", "0", "--checkpoint-every", "2", "--seed", "3", *extra]


def test_sigkill_and_resume_is_bitwise(setup):
    from specjax.train import block_distill

    env = dict(os.environ, SPECJAX_CACHE=os.path.abspath(CACHE), SPECJAX_NO_PROGRESS="1", PYTHONPATH=ROOT)
    killed = setup / "killed"
    kill_at = random.Random().choice(range(2, 22, 2))  # at least 9 more checkpoints after it: the kill lands
    proc = subprocess.Popen(_cli(setup, killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    ck = killed / "ckpt"
    deadline = time.time() + 90
    while time.time() < deadline and proc.poll() is None:
        if ck.exists() and any(n.isdigit() and int(n) >= kill_at for n in os.listdir(ck)):
            break
        time.sleep(0.02)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill (rc {proc.returncode})"
    steps = sorted(int(n) for n in os.listdir(ck) if n.isdigit())
    assert steps and steps[-1] < 40 and not (killed / "drafter").exists()
    r = subprocess.run(_cli(setup, killed, "--resume"), env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restored checkpoint at step" in r.stderr
    # the uninterrupted reference, same settings (in this process: the same programs)
    ref = setup / "uninterrupted"
    a = block_distill.run(_args(setup, ref, "--data-dir", _data(setup), "--steps", "40", "--eval-every", "0",
                                "--checkpoint-every", "2", "--seed", "3"))
    assert a["step"] == 40
    x, y = _tensors(ref), _tensors(killed)
    assert sorted(x) == sorted(y) and "mask_embed" in x
    for k in x:
        assert x[k].tobytes() == y[k].tobytes(), f"{k} differs after SIGKILL and --resume"


@pytest.fixture
def no_load(monkeypatch):
    """Model loads fail: the input must be rejected before any."""
    from specjax.io import loading

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", boom)
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)


@pytest.mark.parametrize("extra, words", [
    (["--block-size", "0"], ["--block-size must be an integer >= 1", "got 0"]),
    (["--layers", "0"], ["--layers must be an integer >= 1"]),
    (["--anchors", "-2"], ["--anchors must be an integer >= 1", "got -2"]),
    (["--position-decay", "0"], ["--position-decay must be a finite number > 0"]),
    (["--position-decay", "nan"], ["--position-decay"]),
    (["--block-size", "32"], ["--block-size 32 must be smaller than --window 32"]),
    (["--copy-ngram", "2"], ["--copy-ngram", "drop --copy-ngram"]),
    (["--data", "both", "--onpolicy-after", "1"], ["--data", "use --data target"]),
    (["--ttt-steps", "5"], ["--ttt-steps is an EAGLE-drafter option, ignored by --arch block: drop it"]),
    (["--gamma", "6"], ["--gamma", "--block-size"]),
    (["--unroll-weight", "1"], ["--unroll-weight", "EAGLE"]),
    (["--init-from", "{tmp}"], ["--init-from", "block_drafter.json"]),
    (["--steps", "-1"], ["--steps"]),
])
def test_bad_block_flags_are_one_line_errors(no_load, capsys, tmp_path, extra, words):
    from specjax import cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 0, "ids": [3, 4, 5]}) + "\n")
    out = tmp_path / "out"
    argv = ["distill", "--model", "nowhere", "--out", str(out), "--prompts", str(prompts), *FLAGS,
            *[x.replace("{tmp}", str(tmp_path)) for x in extra]]
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("specjax: error: "), err
    for w in words:
        assert w in err[0], (w, err[0])
    assert not out.exists()


def test_resume_with_another_arch_is_refused(no_load, capsys, tmp_path):
    from specjax import cli

    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    base = ["distill", "--out", str(run), "--resume"]
    (run / "run.json").write_text(json.dumps({"arch": "block", "prompts": None}))
    assert cli.main(base) == 2
    assert "resume it with --arch block" in capsys.readouterr().err
    (run / "run.json").write_text(json.dumps({"prompts": None}))  # an eagle run records no arch
    assert cli.main(base + ["--arch", "block"]) == 2
    assert "resume it with --arch eagle" in capsys.readouterr().err


def test_distill_bench_runs_a_block_drafter(trained, setup, tmp_path):
    """``specjax distill --bench DIR`` with a block drafter's directory: it is loaded as kind
    ``block`` (before 2026-12-02 the EAGLE loader was called and refused it), decodes the evaluation
    prompts with it, and every greedy speculative output equals the autoregressive one."""
    from specjax.train.benchmark import bench

    out, _ = trained
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": list(range(30)), "eval": list(range(30, 40))}))
    args = _args(setup, tmp_path / "bench", "--bench", str(out / "drafter"), "--split", str(split),
                 "--bench-gammas", "4", "--bench-limit", "3")
    res = bench(args)
    assert res["mismatches"] == [], res["mismatches"]
    row = res["table"]["distilled γ=4"]
    assert row["new_tokens"] == 3 * 20 and row["alpha"] > 0, row
    assert json.loads((tmp_path / "bench" / "bench.json").read_text())["table"]["distilled γ=4"] == row


def test_no_held_out_data_is_said_not_a_traceback(tmp_path, capsys, monkeypatch):
    """A 1-prompt prompts file leaves no evaluation sequence: the held-out figures are no data —
    ``null`` in history.json, "–" in the log with "no held-out data" (as the EAGLE log prints α) —
    not a ``TypeError`` from formatting ``None`` (nor a loss of 0)."""
    from specjax import cli
    from specjax.io.loading import save_model

    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    monkeypatch.setenv("SPECJAX_NO_PROGRESS", "1")
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)
    save_model(peaked_target(), str(tmp_path / "target"))
    (tmp_path / "one.jsonl").write_text(json.dumps({"question_id": 0, "ids": list(range(3, 15))}) + "\n")
    rc = cli.main(["distill", "--model", str(tmp_path / "target"), "--out", str(tmp_path / "run"), "--prompts",
                   str(tmp_path / "one.jsonl"), *FLAGS, "--steps", "2", "--eval-every", "1", "--checkpoint-every", "2"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "Traceback" not in err and "specjax: error" not in err, err
    assert "1 train / 0 eval sequences" in err, err
    assert ("step 0: held-out loss –, agreement by slot – / – / – / –, – greedy drafts accepted per round "
            "(0 anchors: no held-out data)") in err, err
    assert "held-out α by draft position – / – / – / –" in err, err
    hist = json.load(open(tmp_path / "run" / "history.json"))
    assert [h["step"] for h in hist] == [0, 1, 2]
    assert all(h["loss"] is None and h["accepted_per_round"] is None and h["agreement_by_slot"] == [None] * 4
               and h["alpha_by_position"] == [None] * 4 and h["positions"] == 0 for h in hist), hist


def test_anchor_feature_warm_start_begins_where_the_drafter_was(trained, setup):
    """``--init-from`` a drafter trained without the anchor feature, ``--anchor-feature``: step 0's
    held-out loss and agreement are the init drafter's own (its ``anchor_proj`` starts at zero);
    training then moves the projection, and the exported drafter reads it."""
    from safetensors.numpy import load_file

    from specjax.train import block_distill

    out_init, res_init = trained
    out = setup / "anchor"
    block_distill.run(_args(setup, out, "--data-dir", _data(setup), "--steps", "10", "--eval-every", "10",
                            "--checkpoint-every", "10", "--init-from", str(out_init / "drafter"),
                            "--anchor-feature"))
    hist = json.loads((out / "history.json").read_text())
    assert hist[0]["step"] == 0
    np.testing.assert_allclose(hist[0]["loss"], res_init["final"]["loss"], rtol=1e-5)
    assert hist[0]["agreement_by_slot"] == res_init["final"]["agreement_by_slot"]
    meta = json.loads((out / "drafter" / "block_drafter.json").read_text())
    assert meta["config"]["anchor_feature"] is True
    proj = load_file(str(out / "drafter" / "model.safetensors"))["anchor_proj"]
    assert np.abs(proj).max() > 0  # trained away from zero


def test_anchor_feature_without_block_arch_is_one_line(tmp_path, capsys):
    from specjax.cli import main

    rc = main(["distill", "--out", str(tmp_path / "x"), "--anchor-feature"])
    err = capsys.readouterr().err
    assert rc != 0 and "--anchor-feature is a block-drafter option" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()
