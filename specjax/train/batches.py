"""Training windows and batches: prompt-lookup candidates per position, windows tiling the
sequences, the arrays of a batch of windows, and the batch order of a step (exact resume)."""

from __future__ import annotations

import numpy as np


def lookup_candidates(ids, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt-lookup candidates for every position of a sequence: ``(cand [T], n [T])``
    int32, where ``cand[t]`` is the token that followed the latest earlier occurrence of the
    n-gram ending at ``ids[t]`` (n = max_n … 1, longest first; that occurrence must end
    before t) and ``n[t]`` its size (0 and token 0: no match). The same rule as
    :func:`specjax.drafters.ngram.lookup_candidate` in the decode loop."""
    t_len = len(ids)
    cand = np.zeros(t_len, np.int32)
    size = np.zeros(t_len, np.int32)
    last = {}  # n-gram -> end position of its latest occurrence so far
    for t in range(t_len):
        for n in range(min(max_n, t + 1), 0, -1):
            e = last.get(tuple(ids[t - n + 1: t + 1]))
            if e is not None:
                cand[t], size[t] = ids[e + 1], n
                break
        for n in range(1, min(max_n, t + 1) + 1):
            last[tuple(ids[t - n + 1: t + 1])] = t
    return cand, size


def make_windows(seqs, window: int, eval_only_response: bool = False) -> list[tuple[int, int]]:
    """``(seq index, start)`` windows tiling each sequence from its end (response first);
    with ``eval_only_response`` only the last window of each sequence."""
    out = []
    for i, s in enumerate(seqs):
        t = len(s["ids"])
        if eval_only_response:
            out.append((i, max(0, t - window)))
            continue
        st = t - window
        while True:
            out.append((i, max(0, st)))
            if st <= 0:
                break
            st -= window
    return out


def build_batch(seqs, data, windows, sub_pos, window: int, d: int, copy_ngram: int = 0) -> dict:
    """NumPy arrays for B ``windows`` (``(seq index, start)``) of W = ``window`` positions,
    zero-padded past a sequence's end: ``feats`` [B, W, d] float32 (input features h_{t-1},
    zero before the sequence), ``tokens`` [B, W] int32, ``th`` [B, W, d] float32 (target h_t),
    ``tp`` [B, W, k] float32 (target top-k probabilities), ``ti`` [B, W, k] int32 (their
    sub-vocab positions, −1 outside), ``am`` [B, W] int32 (target argmax as sub-vocab
    position, −1 outside), ``mask`` [B, W] float32 (loss positions), ``resp`` [B, W]
    float32 (positions predicting a generated token). With ``copy_ngram``: also the copy
    candidate per position ``cand`` [B, W] int32, its match size ``cand_n`` [B, W] int32,
    its sub-vocab position ``cand_pos`` [B, W] int32, and the raw top-k ids ``tk``
    [B, W, k] int32 and argmax ``amt`` [B, W] int32 (−1 padded).

    ``seqs``/``data``: as :func:`specjax.train.data.collect_parts`; ``sub_pos``:
    :func:`sub_positions`; ``d``: the width of the stored features (the hidden size, or the fused
    features' ``len·D``)."""
    b = len(windows)
    fin = np.zeros((b, window, d), np.float32)
    tok = np.zeros((b, window), np.int32)
    th = np.zeros((b, window, d), np.float32)
    k = data["topk_p"].shape[1]
    tpp = np.zeros((b, window, k), np.float32)
    tpi = np.full((b, window, k), -1, np.int32)
    am = np.full((b, window), -1, np.int32)
    mask = np.zeros((b, window), np.float32)
    resp = np.zeros((b, window), np.float32)
    for j, (i, st) in enumerate(windows):
        s = seqs[i]
        t = len(s["ids"])
        n = min(window, t - st)
        off = s["offset"]
        tok[j, :n] = s["ids"][st: st + n]
        th[j, :n] = data["hidden"][off + st: off + st + n]
        if st > 0:
            fin[j, 0] = data["hidden"][off + st - 1]
        fin[j, 1:n] = data["hidden"][off + st: off + st + n - 1]
        tpp[j, :n] = data["topk_p"][off + st: off + st + n]
        tpi[j, :n] = sub_pos[data["topk_idx"][off + st: off + st + n]]
        am[j, :n] = sub_pos[data["argmax"][off + st: off + st + n]]
        mask[j, :n] = 1.0
        pos = np.arange(st, st + n)
        # response positions: predicting a generated token (positions prompt_len-1 .. t-2)
        resp[j, :n] = ((pos >= s["prompt_len"] - 1) & (pos <= t - 2)).astype(np.float32)
    out = dict(feats=fin, tokens=tok, th=th, tp=tpp, ti=tpi, am=am, mask=mask, resp=resp)
    if copy_ngram:
        cand = np.zeros((b, window), np.int32)
        cn = np.zeros((b, window), np.int32)
        tk = np.full((b, window, k), -1, np.int32)
        amt = np.full((b, window), -1, np.int32)
        for j, (i, st) in enumerate(windows):
            s = seqs[i]
            n = min(window, len(s["ids"]) - st)
            off = s["offset"]
            c, m = lookup_candidates(s["ids"][: st + n], copy_ngram)
            cand[j, :n], cn[j, :n] = c[st:], m[st:]
            tk[j, :n] = data["topk_idx"][off + st: off + st + n]
            amt[j, :n] = data["argmax"][off + st: off + st + n]
        out.update(cand=cand, cand_n=cn, cand_pos=sub_pos[cand], tk=tk, amt=amt)
    return out



def sub_positions(sub_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """``[vocab_size]`` int32: each token id's row in the sub-vocabulary ``sub_ids``, −1 outside."""
    sub_pos = np.full(vocab_size, -1, np.int32)
    sub_pos[sub_ids] = np.arange(len(sub_ids), dtype=np.int32)
    return sub_pos


def window_order(seed: int, step: int, batch_size: int, n_windows: int) -> list[int]:
    """The window indices of training step ``step``: consecutive slices of a permutation of
    the ``n_windows`` windows per epoch (permutation seeded by ``(seed, epoch)``). Depends
    only on ``(seed, step)`` and the sizes, so a resumed run sees the same batches."""
    epoch, pos = divmod(step * batch_size, n_windows)
    idx = []
    while len(idx) < batch_size:
        perm = np.random.default_rng([seed, epoch]).permutation(n_windows)
        take = perm[pos: pos + batch_size - len(idx)]
        idx += take.tolist()
        epoch, pos = epoch + 1, 0
    return idx
