"""``distill --text-corpus`` data (specjax/train/text_data.py): which files are read, how they become
windows (budget, per-file cap, duplicates and held-out texts skipped), and that the teacher-forced
parts hold the target's own argmax and top-k at every position (checked against an independent
forward, :func:`specjax.eval.formats.teacher_forced_logits`), readable by ``collect_parts``."""

from __future__ import annotations

import os

import numpy as np
import pytest

from test_bench import WORDS, tiny_dir  # noqa: F401  (a fixture: a tiny saved model with a tokenizer)

from specjax.train.common import DistillError
from specjax.train.data import collect_parts
from specjax.train.text_data import teacher_forced_data, text_files, text_windows


def _corpus(root):
    """prose (.md, README, .txt), code (.py), too small, not text, a symlink, a duplicate, a held-out one."""
    words = lambda k, n: " ".join(WORDS[(k + i * 7) % len(WORDS)] for i in range(n))  # noqa: E731
    files = {"doc/a.md": words(1, 400), "doc/README": words(2, 400), "doc/b.txt": words(3, 400),
             "pkg/m.py": words(4, 400), "pkg/n.py": words(5, 400), "pkg/small.py": "w5 w6",
             "pkg/data.bin": words(6, 400), "doc/copy.md": words(1, 400),
             "doc/held.md": words(8, 300) + " w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 " + words(9, 300)}
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
    os.symlink(os.path.join(root, "doc", "a.md"), os.path.join(root, "doc", "link.md"))
    return str(root)


def test_text_files_kinds_and_limits(tmp_path):
    root = _corpus(tmp_path / "c")
    got = text_files([root])
    rel = {k: sorted(os.path.relpath(p, root) for p in v) for k, v in got.items()}
    assert rel == {"prose": ["doc/README", "doc/a.md", "doc/b.txt", "doc/copy.md", "doc/held.md"],
                   "code": ["pkg/m.py", "pkg/n.py"]}  # no symlink, nothing under 1 KiB, no .bin
    with pytest.raises(DistillError, match="no such file"):
        text_files([str(tmp_path / "absent")])


def test_windows_budget_duplicates_and_held_out(tiny_dir, tmp_path):  # noqa: F811
    from specjax.io.loading import load_model

    target = load_model(tiny_dir)
    root = _corpus(tmp_path / "c")
    logs = []
    # a budget larger than the corpus: every file is read (the held-out one too)
    wins = text_windows(target, [root], max_tokens=4000, window=64, per_file=200,
                        exclude=["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"], log=logs.append)
    paths = {os.path.relpath(w["path"], root) for w in wins}
    assert "doc/held.md" not in paths and not ("doc/a.md" in paths and "doc/copy.md" in paths)  # held out; dup
    assert all(len(w["ids"]) <= 64 for w in wins)
    per_file = {}
    for w in wins:
        per_file[w["path"]] = per_file.get(w["path"], 0) + len(w["ids"])
    assert max(per_file.values()) <= 200
    prose = sum(len(w["ids"]) for w in wins if w["category"] == "text-prose")
    code = sum(len(w["ids"]) for w in wins if w["category"] == "text-code")
    assert prose == 3 * 200 - 3 * 8 and code == 2 * 200 - 2 * 8  # 3 prose files, 2 code; the last 8 of each
    # file's 200 tokens (< window / 4) are left out
    assert any("1 files skipped" in line for line in logs)
    small = text_windows(target, [root], max_tokens=300, window=64, per_file=200, log=lambda s: None)
    assert sum(len(w["ids"]) for w in small) <= 300 + 2 * 64  # the budget (each kind may end one window over)
    assert text_windows(target, [root], 900, 64, per_file=200, log=lambda s: None) == \
        text_windows(target, [root], 900, 64, per_file=200, log=lambda s: None)  # seeded: reproducible


def test_teacher_forced_parts_hold_the_targets_predictions(tiny_dir, tmp_path):  # noqa: F811
    from specjax.eval.formats import teacher_forced_logits
    from specjax.io.loading import load_model

    target = load_model(tiny_dir)
    wins = text_windows(target, [_corpus(tmp_path / "c")], max_tokens=400, window=64, per_file=200,
                        log=lambda s: None)
    parts = str(tmp_path / "parts")
    teacher_forced_data(target, wins, window=64, batch=4, topk=3, parts_dir=parts, log=lambda s: None)
    seqs, arrs = collect_parts(parts)
    assert [s["ids"] for s in seqs] == [w["ids"] for w in wins] and all(s["prompt_len"] == 1 for s in seqs)
    for s in seqs[:3]:
        ref = teacher_forced_logits(target, s["ids"])  # [n, V], an independent forward
        rows = slice(s["offset"], s["offset"] + len(s["ids"]))
        assert np.array_equal(arrs["argmax"][rows], ref.argmax(-1))
        top = np.argsort(-ref, axis=-1)[:, :3]
        assert np.array_equal(np.sort(arrs["topk_idx"][rows], -1), np.sort(top, -1))
        assert np.asarray(arrs["hidden"][rows]).shape == (len(s["ids"]), target.config.hidden_size)
    # a restart skips finished parts (nothing recomputed: the files are untouched)
    before = {n: os.path.getmtime(os.path.join(parts, n)) for n in os.listdir(parts)}
    teacher_forced_data(target, wins, window=64, batch=4, topk=3, parts_dir=parts, log=lambda s: None)
    assert {n: os.path.getmtime(os.path.join(parts, n)) for n in os.listdir(parts)} == before
