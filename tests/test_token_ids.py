"""The target's own data stored as token ids (issue 28: "store the token ids compactly outside the
installed package so no later run regenerates them"): ``specjax distill --export-ids`` writes them,
``--data-ids`` recomputes the features and top-k by teacher forcing. The recomputed arrays must be
the generated ones (the same causal model over the same tokens), and every bad file one line.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest

from conftest import tiny_model

from specjax.train.common import DistillError
from specjax.train.data import collect_parts, generate_data
from specjax.train.token_ids import (export_token_ids, length_buckets, part_sequences, read_token_ids,
                                     replay_data, write_token_ids)

FEATURES = (0, 1)  # fused features of both tiny blocks (as --feature-layers), stored in float16


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """A tiny peaked target, and a data set it generated (greedy + sampled continuations)."""
    d = tmp_path_factory.mktemp("ids")
    target = tiny_model(0, scale=20.0)
    rng = np.random.default_rng(0)
    recs = [{"question_id": i, "category": f"c{i % 3}", "ids": rng.integers(2, 128, int(rng.integers(3, 12))).tolist()}
            for i in range(10)]
    generate_data(target, recs, max_new_tokens=40, batch=8, chat=False, max_prompt_tokens=12, topk=4,
                  parts_dir=str(d / "data"), samples=2, temperature=0.8, seed=5, feature_layers=FEATURES,
                  log=lambda s: None)
    return target, d


def test_export_read_and_replay_give_the_generated_data(generated, tmp_path):
    target, d = generated
    gen_seqs, gen = collect_parts(str(d / "data"))
    path = str(tmp_path / "ids.npz")
    meta = export_token_ids(path, [str(d / "data"), str(d / "data")], target, note="a test")  # twice: kept once
    assert meta["sequences"] == len(gen_seqs) == 20 and meta["tokens"] == sum(len(q["ids"]) for q in gen_seqs)
    with np.load(path) as z:
        assert z["ids"].dtype == np.uint16 and len(z["ids"]) == meta["tokens"]
    seqs, meta2 = read_token_ids(path, target)
    assert meta2["note"] == "a test" and meta2["tokens"] == meta["tokens"]
    keys = ("ids", "prompt_len", "question_id", "category", "sample", "seed", "source", "turn")
    assert [{k: q[k] for k in keys} for q in seqs] == [{k: q[k] for k in keys} for q in gen_seqs]

    parts = str(tmp_path / "replayed")
    replay_data(target, seqs, batch=8, topk=4, parts_dir=parts, feature_layers=FEATURES, log=lambda s: None,
                step=16)
    rep_seqs, rep = collect_parts(parts)
    by_key = {(q["question_id"], q["sample"]): q for q in rep_seqs}
    assert len(by_key) == len(rep_seqs) == len(gen_seqs)
    worst = 0.0
    for q in gen_seqs:
        r = by_key[(q["question_id"], q["sample"])]
        assert r["ids"] == q["ids"] and r["prompt_len"] == q["prompt_len"]
        a = slice(q["offset"], q["offset"] + len(q["ids"]))
        b = slice(r["offset"], r["offset"] + len(r["ids"]))
        # the same model over the same tokens: decoded one step at a time or in one pass
        assert np.array_equal(rep["argmax"][b], gen["argmax"][a])
        np.testing.assert_allclose(rep["topk_p"][b], gen["topk_p"][a], atol=1e-5)
        hb, ha = np.asarray(rep["hidden"][b], np.float32), np.asarray(gen["hidden"][a], np.float32)
        assert hb.shape == ha.shape == (len(q["ids"]), len(FEATURES) * target.config.hidden_size)
        worst = max(worst, float(np.abs(hb - ha).max()))
    assert worst < 1e-2, worst  # float16 rounding of unit-RMS features (≈ 1e-3 relative)
    # a restart skips the finished parts
    before = {n: os.path.getmtime(os.path.join(parts, n)) for n in os.listdir(parts)}
    replay_data(target, seqs, batch=8, topk=4, parts_dir=parts, feature_layers=FEATURES, log=lambda s: None,
                step=16)
    assert {n: os.path.getmtime(os.path.join(parts, n)) for n in os.listdir(parts)} == before


def test_length_buckets():
    assert length_buckets([1, 64, 65, 130], 64) == [64, 128, 192]


def test_bad_token_id_files_are_one_line(generated, tmp_path):
    target, d = generated
    seqs = part_sequences(str(d / "data"))
    good = str(tmp_path / "good.npz")
    write_token_ids(good, seqs, target)
    cases = {"missing": str(tmp_path / "nope.npz")}
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file at all")
    cases["junk"] = str(junk)
    other = str(tmp_path / "other.npz")
    np.savez_compressed(other, ids=np.zeros(3, np.uint16), lengths=np.array([3], np.int32),
                        prompt_len=np.array([1], np.int32), meta=np.array(json.dumps({"format": "something else"})))
    cases["format"] = other
    with np.load(good) as z:
        arrs = {k: z[k] for k in z.files}
    damaged = str(tmp_path / "damaged.npz")
    np.savez_compressed(damaged, **dict(arrs, lengths=arrs["lengths"][:-1]))
    cases["damaged"] = damaged
    npy = str(tmp_path / "array.npy")
    np.save(npy, np.arange(5))
    cases["npy"] = npy
    rows_bad = str(tmp_path / "rows.npz")
    meta = json.loads(str(arrs["meta"]))
    np.savez_compressed(rows_bad, **dict(arrs, meta=np.array(json.dumps(dict(meta, sequences_meta=[1] * len(
        meta["sequences_meta"]))))))
    cases["rows"] = rows_bad
    for name, path in cases.items():
        with pytest.raises(DistillError) as e:
            read_token_ids(path)
        msg = str(e.value)
        assert "\n" not in msg and path in msg, (name, msg)
    with pytest.raises(DistillError, match="not of the target loaded"):
        read_token_ids(good, tiny_model(1, scale=20.0))  # another target's text
    with pytest.raises(DistillError, match="outside the target's vocabulary"):
        write_token_ids(str(tmp_path / "x.npz"), [dict(seqs[0], ids=[10 ** 6])], target)
    with pytest.raises(DistillError, match="no such data directory"):
        part_sequences(str(tmp_path / "nowhere"))
    with pytest.raises(DistillError, match="does not exist"):
        export_token_ids(str(tmp_path / "no" / "dir" / "x.npz"), [str(d / "data")], target)
    with pytest.raises(DistillError, match="is a directory"):
        export_token_ids(str(tmp_path), [str(d / "data")], target)


def test_replayed_parts_are_reused_only_for_the_same_file(generated, tmp_path):
    from specjax.train.token_ids import check_replay_source, file_source

    target, d = generated
    seqs = part_sequences(str(d / "data"))
    f = str(tmp_path / "ids.npz")
    write_token_ids(f, seqs, target)
    parts = str(tmp_path / "parts")
    check_replay_source(parts, file_source(f), f)
    check_replay_source(parts, file_source(f), f)  # the same content: fine
    write_token_ids(f, seqs[:-1], target)  # re-exported with other content at the same path
    with pytest.raises(DistillError, match="content changed"):
        check_replay_source(parts, file_source(f), f)


def test_distill_trains_on_stored_ids_without_generating(generated, tmp_path):
    """``--data-ids`` alone: nothing decoded, the run trains on the teacher-forced sequences; the CLI's
    flag checks are one line."""
    from specjax.cli import distill as cli
    from specjax.io.loading import save_model
    from specjax.train import distill

    target, d = generated
    save_model(target, str(tmp_path / "target"))
    path = str(tmp_path / "ids.npz")
    export_token_ids(path, [str(d / "data")], target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": f"c{i % 3}", "ids": [3, 4, 5]}) + "\n"
                               for i in range(10)))
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": list(range(8)), "eval": [8, 9]}))
    p = argparse.ArgumentParser()
    cli.add_args(p)
    base = ["--model", str(tmp_path / "target"), "--prompts", str(prompts), "--split", str(split),
            "--sub-vocab", "64", "--intermediate", "64", "--window", "32", "--batch-size", "4", "--gen-batch", "8",
            "--topk", "4", "--feature-layers", "0,1", "--steps", "2", "--eval-every", "2", "--checkpoint-every", "2"]
    out = tmp_path / "run"
    res = distill.run(p.parse_args(base + ["--out", str(out), "--data-ids", path]))
    assert res["step"] == 2 and "alpha" in res["final"]
    assert not (out / "data").exists()  # nothing generated
    assert sorted(os.listdir(out / "data_ids")) == ["0-ids"]
    assert json.loads((out / "run.json").read_text())["data_ids"] == [path]
    with pytest.raises(DistillError, match="--data-ids .*no such file"):
        distill.run(p.parse_args(base + ["--out", str(tmp_path / "r2"), "--data-ids", str(tmp_path / "no.npz")]))
    with pytest.raises(DistillError, match="give them with --data-dir"):
        cli.cmd_distill(p.parse_args(["--export-ids", str(tmp_path / "e.npz")]))
    with pytest.raises(DistillError, match="--out DIR is required"):
        cli.cmd_distill(p.parse_args(["--prompts", str(prompts)]))
    e = tmp_path / "e.npz"
    assert cli.cmd_distill(p.parse_args(["--model", str(tmp_path / "target"), "--export-ids", str(e),
                                         "--data-dir", str(out / "data_ids" / "0-ids")])) == 0
    assert read_token_ids(str(e), target)[1]["tokens"] == read_token_ids(path)[1]["tokens"]
    for extra in (["--out", str(tmp_path / "o")], ["--resume"], ["--data-ids", path]):
        with pytest.raises(DistillError, match="does not go with it"):
            cli.cmd_distill(p.parse_args(["--export-ids", str(e), "--data-dir", str(out / "data_ids" / "0-ids"),
                                          *extra]))
    # a run's data made by one --model, exported as another's: refused before loading anything
    made = tmp_path / "made"
    (made / "data").mkdir(parents=True)
    for n in os.listdir(d / "data"):
        (made / "data" / n).write_bytes((d / "data" / n).read_bytes())
    (made / "run.json").write_text(json.dumps({"model": str(tmp_path / "target")}))
    with pytest.raises(DistillError, match="was made by --model"):
        cli.cmd_distill(p.parse_args(["--export-ids", str(e), "--data-dir", str(made / "data")]))


def test_the_stored_data_sets_are_the_default_models(default_model):
    """``data/smollm2-135m-instruct/*.npz`` read back for the default model (fingerprint, table, ids in
    its vocabulary), hold what the README's table says, and keep the evaluation split's answers
    greedy-only (so ``--split configs/spec_bench_split.json`` holds them out)."""
    import glob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = sorted(glob.glob(os.path.join(root, "data", "smollm2-135m-instruct", "*.npz")))
    assert files, "the stored data sets are missing"
    readme = open(os.path.join(root, "data", "smollm2-135m-instruct", "README.md"), encoding="utf-8").read()
    ev = set(json.load(open(os.path.join(root, "configs", "spec_bench_split.json")))["eval"])
    total = 0
    for f in files:
        seqs, meta = read_token_ids(f, default_model)
        total += meta["tokens"]
        assert f"`{os.path.basename(f)}` | {meta['sequences']:,} | {meta['tokens']:,} |" in readme, f
        assert all(q["sample"] == 0 for q in seqs if q["question_id"] in ev)
    assert f"**{total:,}**" in readme
