"""The target's own data kept as token ids only: a compact file per data set (``data/`` in the
repository, outside the installed package) from which the target's features, top-k probabilities
and argmax are recomputed by teacher forcing, so no later run has to decode the data again.

A generated data set (:func:`specjax.train.data.generate_data`) holds, per position, the fused
features (3 × 576 float16) and the top-k distribution: ≈ 3.6 kB per token, 10 GB for 3 M tokens.
Its token ids are 2 bytes per token (uint16 while the vocabulary has ≤ 65,536 entries), about 1
after compression. Decoding them took hours (the target writes one token per step); recomputing what
training needs from them is one prefill pass per batch (teacher forcing, several times faster),
and gives the same numbers up to float rounding: a causal model's outputs at position t depend only
on positions ≤ t, whether they were decoded one at a time or in one pass.

File format (``np.savez_compressed``): ``ids`` [N] uint16 (or uint32), the sequences one after
another; ``lengths`` [S] int32 and ``prompt_len`` [S] int32 per sequence; ``meta`` a JSON string:
``{"format": FORMAT, "vocab_size", "target_name", "target_fingerprint", "tokens", "sequences",
"note", "sequences_meta": [{question_id, category, turn, sample, seed, source}, ...]}``.
"""

from __future__ import annotations

import json
import os
import time
import zipfile

import numpy as np

from specjax.train.common import DistillError

FORMAT = "specjax-token-ids/1"
SEQ_KEYS = ("question_id", "category", "turn", "sample", "seed", "source")  # what a sequence keeps besides its ids
# positions per teacher-forcing call: its [rows, bucket, vocab] float32 logits stay ≈ 0.8 GB at a 49k vocabulary
REPLAY_TOKENS = 4096
SOURCE_FILE = "source.json"  # in a replayed data directory: which token-id file (size, SHA-256) it was made from


def part_sequences(parts_dir: str) -> list[dict]:
    """The sequence dicts (``ids``, ``prompt_len``, :data:`SEQ_KEYS`) of every finished part in
    ``parts_dir`` (:func:`specjax.train.data.write_part`), in part order, without reading the
    per-position arrays.

    Raises:
      DistillError: ``parts_dir`` missing or without a finished part."""
    if not os.path.isdir(parts_dir):
        raise DistillError(f"{parts_dir}: no such data directory (a distill run's DIR/data or DIR/data_self)")
    from specjax.train.data import part_files

    seqs = []
    for path in part_files(parts_dir):
        with np.load(path) as z:
            seqs += json.loads(str(z["seqs"]))
    if not seqs:
        raise DistillError(f"{parts_dir}: no generated data yet")
    return seqs


def check_export_path(path: str) -> None:
    """Raises DistillError (one line) unless ``path`` can be written: its folder exists and it is
    not a directory."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise DistillError(f"--export-ids {path}: the folder {folder} does not exist; create it first")
    if os.path.isdir(path):
        raise DistillError(f"--export-ids {path} is a directory; give a file name (e.g. {path}/answers.npz)")


def export_token_ids(path: str, dirs: list[str], target, note: str = "") -> dict:
    """The token ids of the data sets in ``dirs`` (their parts; a continuation in several is kept
    once, as :func:`specjax.train.data.collect_data` merges them) written to ``path``
    (:func:`write_token_ids`). Returns the file's ``meta``.

    Raises:
      DistillError: a directory without data, or an unwritable ``path``."""
    from specjax.train.data import sequence_key

    check_export_path(path)
    seqs, seen = [], set()
    for d in dirs:
        for q in part_sequences(d):
            if sequence_key(q) not in seen:
                seen.add(sequence_key(q))
                seqs.append(q)
    return write_token_ids(path, seqs, target, note)


def write_token_ids(path: str, seqs: list[dict], target, note: str = "") -> dict:
    """Write ``seqs`` (dicts with ``ids``, ``prompt_len`` and :data:`SEQ_KEYS`) to ``path``
    (atomically) as a compressed token-id file for ``target``; returns its ``meta`` (without the
    per-sequence list). ``note``: how the data was made (the command), kept in the file.

    Raises:
      DistillError: no sequences, a token id outside the target's vocabulary, or ``path`` not
        writable (nothing is left behind)."""
    from specjax.drafters.eagle_files import target_fingerprint

    if not seqs:
        raise DistillError("no sequences to write")
    vocab = int(target.config.vocab_size)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    ids = np.concatenate([np.asarray(q["ids"], np.int64) for q in seqs])
    bad = ids[(ids < 0) | (ids >= vocab)]
    if len(bad):
        raise DistillError(f"token id {int(bad[0])} is outside the target's vocabulary of {vocab}: these sequences "
                           "were not made by this target (give its --model)")
    meta = {"format": FORMAT, "vocab_size": vocab, "target_name": getattr(target, "name", None),
            "target_fingerprint": target_fingerprint(target), "tokens": int(len(ids)), "sequences": len(seqs),
            "note": note}
    full = dict(meta, sequences_meta=[{k: q.get(k) for k in SEQ_KEYS} for q in seqs])
    tmp = path + ".tmp.npz"
    try:
        np.savez_compressed(tmp, ids=ids.astype(dtype), lengths=np.array([len(q["ids"]) for q in seqs], np.int32),
                            prompt_len=np.array([int(q["prompt_len"]) for q in seqs], np.int32),
                            meta=np.array(json.dumps(full)))
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise DistillError(f"--export-ids {path}: cannot write it ({e.strerror or e}); choose a writable place") \
            from None
    return meta


def read_token_ids(path: str, target=None) -> tuple[list[dict], dict]:
    """The sequences of a token-id file (:func:`write_token_ids`) as dicts (``ids`` list of int,
    ``prompt_len``, :data:`SEQ_KEYS`) and the file's ``meta``. With ``target``, the file must have
    been made by that target (tokenizer, config and weights: the drafters' fingerprint check).

    Raises:
      DistillError: one line naming ``path``: missing, not a token-id file, damaged, or made by
        another target (or holding ids outside its vocabulary)."""
    from specjax.drafters.eagle_files import fingerprint_mismatch, target_fingerprint

    if not os.path.isfile(path):
        raise DistillError(f"--data-ids {path}: no such file (a token-id file: specjax distill --export-ids)")
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):  # a bare .npy array
            raise ValueError("an array, not an archive")
        with z:
            meta = json.loads(str(z["meta"]))
            ids, lengths, plen = (np.asarray(z[k]).reshape(-1) for k in ("ids", "lengths", "prompt_len"))
    except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError, TypeError) as e:
        raise DistillError(f"--data-ids {path}: not a readable token-id file ({type(e).__name__}); make one with "
                           "specjax distill --export-ids") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DistillError(f"--data-ids {path}: not a {FORMAT} file; make one with specjax distill --export-ids")
    rows = meta.get("sequences_meta")
    if not (isinstance(rows, list) and all(isinstance(r, dict) for r in rows)
            and all(np.issubdtype(a.dtype, np.integer) for a in (ids, lengths, plen))
            and len(rows) == len(lengths) == len(plen) and int(lengths.sum()) == len(ids)
            and (lengths > 0).all() and (plen >= 1).all() and (plen <= lengths).all()):
        raise DistillError(f"--data-ids {path}: its sequence table does not match its ids (a damaged file); "
                           "export it again")
    meta["sequences"], meta["tokens"] = len(rows), int(len(ids))
    if target is not None:
        why = fingerprint_mismatch(meta.get("target_fingerprint") or {}, target_fingerprint(target))
        if why:
            raise DistillError(f"--data-ids {path} holds the text of target {meta.get('target_name')!r}, not of the "
                               f"target loaded ({why}); use --model with that target or make new data")
        if len(ids) and int(ids.max()) >= target.config.vocab_size:
            raise DistillError(f"--data-ids {path}: token id {int(ids.max())} is outside the target's vocabulary of "
                               f"{target.config.vocab_size} (a damaged file); export it again")
    starts = np.concatenate([[0], np.cumsum(lengths)])
    seqs = []
    for i, row in enumerate(rows):
        q = {k: row.get(k) for k in SEQ_KEYS}
        q.update(ids=ids[starts[i]: starts[i + 1]].astype(np.int64).tolist(), prompt_len=int(plen[i]))
        seqs.append(q)
    return seqs, {k: v for k, v in meta.items() if k != "sequences_meta"}


def length_buckets(lengths, step: int = 64) -> list[int]:
    """The padded lengths used for teacher forcing sequences of ``lengths``: multiples of
    ``step`` (one compiled prefill per bucket)."""
    return sorted({-(-int(n) // step) * step for n in lengths})


def file_source(path: str) -> dict:
    """What identifies a token-id file's content: ``{"size", "sha256"}``."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"size": os.path.getsize(path), "sha256": h.hexdigest()}


def check_replay_source(parts_dir: str, source: dict, path: str) -> None:
    """Record ``source`` (:func:`file_source` of ``path``) in ``parts_dir`` on first use; refuse to
    reuse parts made from another file's content.

    Raises:
      DistillError: ``parts_dir`` holds parts made from a different file."""
    rec = os.path.join(parts_dir, SOURCE_FILE)
    if os.path.exists(rec):
        with open(rec) as f:
            old = json.load(f)
        if {k: old.get(k) for k in source} != source:
            raise DistillError(f"--data-ids {path}: its content changed since {parts_dir} was computed from it; "
                               "start a new --out (or restore the file)")
        return
    os.makedirs(parts_dir, exist_ok=True)
    with open(rec + ".tmp", "w") as f:
        json.dump(dict(source, path=os.path.abspath(path)), f)
    os.replace(rec + ".tmp", rec)


def replay_data(target, seqs: list[dict], *, batch: int, topk: int, parts_dir: str, feature_layers=(),
                log=print, step: int = 64) -> None:
    """The target's features (fused with ``feature_layers``), top-k probabilities and argmax at
    every position of ``seqs`` (from :func:`read_token_ids`) by teacher forcing: sequences grouped
    by padded length (:func:`length_buckets`), at most ``batch`` and at most
    :data:`REPLAY_TOKENS` // length per prefill call (the logits' memory), written in parts as
    :func:`specjax.train.data.generate_data` writes them (same arrays and sequence dicts; a
    restart skips the finished parts, so the order must not change: it is fixed by ``seqs``)."""
    from specjax.train.data import write_part
    from specjax.train.text_data import teacher_forcing_fn

    os.makedirs(parts_dir, exist_ok=True)
    order = sorted(range(len(seqs)), key=lambda i: (-(-len(seqs[i]["ids"]) // step), i))
    groups = []
    for i in order:
        w = -(-len(seqs[i]["ids"]) // step) * step
        if not groups or groups[-1][0] != w or len(groups[-1][1]) == _rows(batch, w):
            groups.append((w, []))
        groups[-1][1].append(i)
    fns, t0, done = {}, time.time(), 0
    total = sum(len(q["ids"]) for q in seqs)
    for bi, (w, idx) in enumerate(groups):
        part = os.path.join(parts_dir, f"part_{bi:04d}.npz")
        done += sum(len(seqs[i]["ids"]) for i in idx)
        if os.path.exists(part):
            continue
        if w not in fns:
            fns[w] = teacher_forcing_fn(target, w, topk, tuple(feature_layers))
        ids = np.zeros((_rows(batch, w), w), np.int32)
        for j, i in enumerate(idx):
            ids[j, : len(seqs[i]["ids"])] = seqs[i]["ids"]
        hid, tp, ti, am = (np.asarray(x) for x in fns[w](target.params, ids))
        out, parts = [], ([], [], [], [])
        for j, i in enumerate(idx):
            n = len(seqs[i]["ids"])
            out.append(dict(seqs[i]))
            for acc, a in zip(parts, (hid, tp, ti, am)):
                acc.append(a[j, :n])
        write_part(part, out, *parts, half=bool(feature_layers))
        el = time.time() - t0
        log(f"teacher forcing the stored token ids: {done}/{total} tokens ({el:.0f}s, "
            f"{done / max(el, 1e-9):.0f} tokens/s)")


def _rows(batch: int, width: int) -> int:
    """Rows per teacher-forcing call of ``width`` positions (fixed per width: resume-safe)."""
    return max(1, min(int(batch), REPLAY_TOKENS // int(width)))
