"""Distillation data at scale (issue 28): the target features of a data set are read from the part
files memory-mapped (:func:`specjax.train.data.collect_parts` / :func:`collect_data`), never
concatenated in memory, so a multi-million-token data set (≈ 10 GB of float16 features) can be
trained on with 24 GiB of RAM.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from specjax.train.data import RowSegments, npz_member, write_part, collect_data, collect_parts, join_rows


def test_row_segments_read_like_the_concatenation():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((n, 3)).astype(np.float16) for n in (5, 0, 1, 7, 2)]
    full = np.concatenate(parts)
    r = join_rows([parts[0], RowSegments(parts[1:3]), parts[3], RowSegments(parts[4:])])
    assert r.shape == full.shape == (15, 3) and len(r) == 15 and r.dtype == np.float16
    for i in range(-15, 15):
        np.testing.assert_array_equal(r[i], full[i])
    for a in range(16):
        for b in range(16):
            np.testing.assert_array_equal(r[a:b], full[a:b])
    np.testing.assert_array_equal(np.asarray(r), full)
    with pytest.raises(IndexError):
        r[15]
    with pytest.raises(IndexError):
        r[0:10:2]
    with pytest.raises(ValueError, match="row shapes"):
        RowSegments([np.zeros((2, 3)), np.zeros((2, 4))])


def test_npz_member_is_memory_mapped_when_stored(tmp_path):
    full = np.arange(40, dtype=np.float16).reshape(10, 4)
    p = str(tmp_path / "a.npz")
    np.savez(p, seqs=np.array("[]"), hidden=full)
    m = npz_member(p, "hidden")
    assert isinstance(m, np.memmap) and not m.flags.writeable
    np.testing.assert_array_equal(m, full)
    np.savez_compressed(p, seqs=np.array("[]"), hidden=full)  # compressed: loaded (still right)
    m = npz_member(p, "hidden")
    assert not isinstance(m, np.memmap)
    np.testing.assert_array_equal(m, full)


def _write_set(d, n_parts, seq_len, width, seed, qid0=0):
    """A data set of ``n_parts`` parts written by the generator's own writer (2 sequences each)."""
    rng = np.random.default_rng(seed)
    os.makedirs(d, exist_ok=True)
    for p in range(n_parts):
        seqs = [{"question_id": qid0 + 2 * p + j, "turn": 0, "ids": rng.integers(0, 50, seq_len).tolist(),
                 "prompt_len": 3, "category": "c"} for j in range(2)]
        hid = [rng.standard_normal((seq_len, width)).astype(np.float32) for _ in seqs]
        tps = [rng.random((seq_len, 4)).astype(np.float32) for _ in seqs]
        tis = [rng.integers(0, 50, (seq_len, 4)) for _ in seqs]
        ams = [rng.integers(0, 50, seq_len) for _ in seqs]
        write_part(os.path.join(d, f"part_{p:04d}.npz"), seqs, hid, tps, tis, ams, half=True)


def test_collect_data_matches_the_part_files(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write_set(a, 3, 9, 6, 0)
    _write_set(b, 2, 5, 6, 1, qid0=100)
    seqs, data = collect_data([a, b])
    assert isinstance(data["hidden"], RowSegments) and len(seqs) == 10
    assert data["hidden"].shape == (3 * 2 * 9 + 2 * 2 * 5, 6) == (len(data["argmax"]), 6)
    for q in seqs:
        d = a if q["question_id"] < 100 else b
        part = np.load(os.path.join(d, f"part_{(q['question_id'] % 100) // 2:04d}.npz"))
        j = q["question_id"] % 2
        n = len(q["ids"])
        lo = q["offset"]
        np.testing.assert_array_equal(data["hidden"][lo: lo + n], part["hidden"][j * n: (j + 1) * n])
        np.testing.assert_array_equal(data["topk_p"][lo: lo + n], part["topk_p"][j * n: (j + 1) * n])
    one, _ = collect_parts(a)
    assert [q["offset"] for q in one] == [0, 9, 18, 27, 36, 45]


def test_a_large_data_set_is_not_loaded_into_memory(tmp_path):
    """≈ 900 MB of float16 features in 4 parts: collecting them and reading every sequence's
    windows raises the anonymous resident memory (RssAnon: heap, not the memory-mapped files' page
    cache, which the kernel reclaims at will) of a fresh process by far less than that while the
    data is held (bound 160 MB; before 2026-12-02 every array was concatenated in memory: ≥ 2 × 900 MB)."""
    d = str(tmp_path / "big")
    os.makedirs(d)
    rng = np.random.default_rng(0)
    seq_len, width = 32768, 1728  # 2 sequences × 32768 tokens × 1728 fused features per part: 226 MB float16
    for p in range(4):
        seqs = [{"question_id": 2 * p + j, "turn": 0, "ids": [1] * seq_len, "prompt_len": 3} for j in range(2)]
        hid = [np.broadcast_to(rng.standard_normal(width).astype(np.float16), (seq_len, width)) for _ in seqs]
        write_part(os.path.join(d, f"part_{p:04d}.npz"), seqs, hid, [np.zeros((seq_len, 4), np.float32)] * 2,
                    [np.zeros((seq_len, 4), np.int32)] * 2, [np.zeros(seq_len, np.int32)] * 2, half=True)
    total = 4 * 2 * seq_len * width * 2
    assert total > 850e6
    code = textwrap.dedent(f"""
        import numpy as np
        from specjax.train.data import collect_data
        def anon():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        before = anon()
        seqs, data = collect_data([{d!r}])
        acc = 0.0
        for q in seqs:
            for st in range(0, len(q["ids"]) - 192, 4096):
                acc += float(np.asarray(data["hidden"][q["offset"] + st: q["offset"] + st + 192], np.float32).sum())
        after = anon()
        print(after - before, data["hidden"].shape[0], acc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    grew, rows, _ = out.stdout.split()
    assert int(rows) == 4 * 2 * seq_len
    assert int(grew) < 160e6, f"anonymous memory grew by {int(grew) / 1e6:.0f} MB for {total / 1e6:.0f} MB of features"


def test_topk_stats_are_the_softmax_top_k():
    """The stored targets: top-k probabilities of softmax(logits) (temperature 1), their ids and the
    argmax — against a float64 softmax, also for logits far from 0 (the max is subtracted)."""
    import jax.numpy as jnp

    from specjax.train.data import topk_stats

    rng = np.random.default_rng(0)
    for scale, shift in ((1.0, 0.0), (30.0, 0.0), (3.0, 500.0), (3.0, -500.0)):
        x = (rng.standard_normal((3, 5, 300)) * scale + shift).astype(np.float32)
        tp, ti, am = (np.asarray(a) for a in topk_stats(jnp.asarray(x), 7))
        x64 = x.astype(np.float64)
        p = np.exp(x64 - x64.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = np.argsort(-p, axis=-1, kind="stable")[..., :7]
        assert np.array_equal(ti, want) and np.array_equal(am, x.argmax(-1))
        np.testing.assert_allclose(tp, np.take_along_axis(p, want, -1), rtol=2e-6, atol=1e-7)
