"""Distillation data from installed text (no decoding): prose and code files found under the
given roots, cut into token windows, and the target's features and top-k probabilities at every
position of each window from ONE teacher-forced call per batch, written in parts like
:func:`specjax.train.data.generate_data` (``distill --text-corpus``)."""

from __future__ import annotations

import os
import time

import numpy as np

from specjax.train.common import DistillError
from specjax.train.data import topk_stats, write_part


PROSE_SUFFIXES = (".md", ".rst", ".txt")  # and files named METADATA, README, LICENSE, COPYING
CODE_SUFFIXES = (".py",)


def _text_kind(path: str) -> str | None:
    """``"prose"``, ``"code"`` or None (not used) for a file name."""
    base = os.path.basename(path)
    if base.endswith(CODE_SUFFIXES):
        return "code"
    if base.endswith(PROSE_SUFFIXES) or base.split(".")[0] in ("METADATA", "README", "LICENSE", "COPYING"):
        return "prose"
    return None


def text_files(roots: list[str], min_bytes: int = 1024, max_bytes: int = 4 << 20) -> dict[str, list[str]]:
    """The prose and code files under ``roots`` (files or directories, walked in sorted order,
    symlinks not followed) of ``min_bytes .. max_bytes``: ``{"prose": [...], "code": [...]}``.

    Raises:
      DistillError: a root that does not exist."""
    out = {"prose": [], "code": []}
    for root in roots:
        if not os.path.exists(root):
            raise DistillError(f"--text-corpus {root}: no such file or directory")
        walk = [(os.path.dirname(root), [], [os.path.basename(root)])] if os.path.isfile(root) else os.walk(root)
        for d, dirs, files in walk:
            dirs.sort()
            for name in sorted(files):
                p = os.path.join(d, name)
                kind = _text_kind(p)
                if kind and not os.path.islink(p) and min_bytes <= os.path.getsize(p) <= max_bytes:
                    out[kind].append(p)
    return out


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def text_windows(target, roots: list[str], max_tokens: int, window: int, *, exclude=(), seed: int = 0,
                 prose_share: float = 0.65, per_file: int = 2048, log=print) -> list[dict]:
    """Windows of ``window`` tokens of installed text for teacher forcing: a seeded shuffle of the
    files under ``roots`` (:func:`text_files`), ``prose_share`` of the tokens from prose
    (documentation, READMEs, package metadata, licences) and the rest from source code, at most
    ``per_file`` tokens from any one file (many sources rather than a few long ones). Files whose
    normalized text repeats one already taken, or that contain one of the ``exclude`` texts
    (normalized; e.g. the held-out questions), are skipped. Returns records ``{"question_id":
    "text-<i>", "category": "text-prose"|"text-code", "ids": [window ids], "path": file}`` with
    at most ``max_tokens`` tokens in all.

    Raises:
      DistillError: the target has no tokenizer, or nothing usable under ``roots``."""
    import hashlib
    import random

    tok = target.tokenizer
    if tok is None:
        raise DistillError("--text-corpus needs a target with a tokenizer")
    files = text_files(roots)
    rng = random.Random(seed)
    for v in files.values():
        rng.shuffle(v)
    excl = [_norm(x) for x in exclude if len(_norm(x)) >= 24]
    budget = {"prose": int(max_tokens * prose_share), "code": max_tokens - int(max_tokens * prose_share)}
    seen, out, skipped = set(), [], 0
    for kind in ("prose", "code"):
        got = 0
        for p in files[kind]:
            if got >= budget[kind]:
                break
            try:
                with open(p, encoding="utf-8") as fh:
                    text = fh.read()
            except (UnicodeDecodeError, OSError):
                continue
            n = _norm(text)
            h = hashlib.sha1(n.encode()).hexdigest()
            if h in seen or any(e in n for e in excl):
                skipped += h not in seen
                continue
            seen.add(h)
            ids = tok.encode(text, add_special_tokens=False)[:per_file]
            for lo in range(0, len(ids) - window // 4, window):
                w = ids[lo: lo + window]
                if got >= budget[kind]:
                    break
                out.append({"question_id": f"text-{len(out)}", "category": f"text-{kind}", "ids": w, "path": p})
                got += len(w)
        log(f"text corpus: {got} {kind} tokens from {sum(1 for r in out if r['category'] == 'text-' + kind and r['ids'])}"
            f" windows ({len(files[kind])} {kind} files found)")
    if skipped:
        log(f"text corpus: {skipped} files skipped (containing a held-out text)")
    if not out:
        raise DistillError(f"--text-corpus {' '.join(roots)}: no prose or code files found")
    return out


def teacher_forcing_fn(target, window: int, topk: int, feature_layers: tuple[int, ...]):
    """Jitted ``f(params, ids [b, window] int32)`` → ``(hidden, topk_p, topk_idx, argmax)`` per position
    (one prefill pass: teacher forcing)."""
    import jax
    import jax.numpy as jnp

    from specjax.models import llama

    cfg, gd = target.config, target.graphdef

    @jax.jit
    def f(params, ids):
        b = ids.shape[0]
        cache = llama.KVCache.create(cfg, b, window, jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32), (b, window))
        out = llama.apply(gd, params, ids, pos, cache, cfg, return_hidden=True, feature_layers=feature_layers)
        return (out.hidden,) + topk_stats(out.logits, topk)

    return f


def teacher_forced_data(target, windows: list[dict], *, window: int, batch: int, topk: int, parts_dir: str,
                        feature_layers=(), log=print) -> None:
    """The target's hidden states (or fused features), top-k probabilities and argmax at every
    position of the ``windows`` (:func:`text_windows`), by prefill passes of ``batch`` windows
    (no decoding: far faster than :func:`generate_data`). Written in parts as
    :func:`generate_data` (same arrays; a restart skips finished parts); each sequence has
    ``prompt_len`` 1 (every position predicts a text token) and ``source`` ``"text"``."""
    os.makedirs(parts_dir, exist_ok=True)
    f = None
    t0, done = time.time(), 0
    total = sum(len(w["ids"]) for w in windows)
    for bi, lo in enumerate(range(0, len(windows), batch)):
        chunk = windows[lo: lo + batch]
        part = os.path.join(parts_dir, f"part_{bi:04d}.npz")
        done += sum(len(w["ids"]) for w in chunk)
        if os.path.exists(part):
            continue
        if f is None:
            f = teacher_forcing_fn(target, window, topk, tuple(feature_layers))
        ids = np.zeros((batch, window), np.int32)
        for j, w in enumerate(chunk):
            ids[j, : len(w["ids"])] = w["ids"]
        hid, tp, ti, am = (np.asarray(x) for x in f(target.params, ids))
        seqs, parts = [], ([], [], [], [])
        for j, w in enumerate(chunk):
            n = len(w["ids"])
            seqs.append({"question_id": w["question_id"], "category": w["category"], "ids": list(w["ids"]),
                         "prompt_len": 1, "turn": 0, "sample": 0, "seed": 0, "source": "text"})
            for acc, a in zip(parts, (hid, tp, ti, am)):
                acc.append(a[j, :n])
        write_part(part, seqs, *parts, half=bool(feature_layers))
        el = time.time() - t0
        log(f"teacher forcing: {done}/{total} tokens ({el:.0f}s, {done / max(el, 1e-9):.0f} tokens/s)")
