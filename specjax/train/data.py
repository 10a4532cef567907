"""Distillation data: the target's continuations of the training prompts with its hidden
states, top-k probabilities and argmax at every position (written in parts on disk),
self-written prompts (Magpie), reading and merging data sets, and the sub-vocabulary."""

from __future__ import annotations

import functools
import json
import os
import time
import zlib
from collections import Counter, defaultdict

import numpy as np

from specjax.train.common import DistillError
from specjax.train.records import encode_record, read_records


def topk_stats(logits, topk: int):
    """``(top-k probabilities [..., topk] float32, their ids [..., topk] int32, argmax [...] int32)``
    of ``logits [..., vocab]`` at temperature 1."""
    import jax
    import jax.numpy as jnp

    # top-k of the logits themselves (softmax keeps the order), normalized by one max + sum-exp
    # reduction: no [..., vocab] log-probability array is written (≈ 40 % less time on XLA CPU at
    # 49k entries; the same ids but at exact ties)
    m = jnp.max(logits, axis=-1, keepdims=True)
    log_z = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1, keepdims=True))
    tv, ti = jax.lax.top_k(logits, topk)
    return jnp.exp((tv - m) - log_z), ti.astype(jnp.int32), jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _buffer_len(n: int) -> int:
    """A generation cache of ``n`` slots rounded up to whole attention blocks: the attention pads a
    buffer that is not (a copy of every layer's cache at every step, ≈ 10 % of a batch-64 step);
    the slots added are never visible, so the tokens are the same."""
    from specjax.models.llama import ATTENTION_BLOCK
    from specjax.runtime.decoder import round_up

    return round_up(n, ATTENTION_BLOCK)


def _gen_fn(target, prompt_len: int, max_new: int, topk: int, feature_layers: tuple[int, ...] = ()):
    """Jitted generation that also returns what training needs, so no separate teacher
    pass is run: per position the target's final hidden state (or fused features), top-k probabilities and
    argmax (prefill positions and generated positions).

    ``f(params, prompt [b, p] int32, lengths [b] int32, temps [b] float32, seeds [b] int32)``:
    a row with ``temps == 0`` continues greedily; otherwise it samples from
    softmax(logits / temp) with keys folded from its seed and the step (reproducible).
    The stored top-k / argmax are always the target's temperature-1 distribution. With
    ``feature_layers`` the hidden state is the fused feature of those blocks
    (:func:`specjax.models.llama.target_features`)."""
    import jax
    import jax.numpy as jnp

    from specjax.models import llama

    cfg, gd = target.config, target.graphdef

    stats = functools.partial(topk_stats, topk=topk)

    def choose(logits, greedy, temps, keys, i):  # logits [b, vocab]
        def sample(_):
            ks = jax.vmap(jax.random.fold_in, (0, None))(keys, i)
            scaled = logits / jnp.where(temps > 0, temps, 1.0)[:, None]
            sampled = jax.vmap(jax.random.categorical)(ks, scaled).astype(jnp.int32)
            return jnp.where(temps > 0, sampled, greedy)
        # an all-greedy batch (the self-prompt answers) skips the Gumbel noise over the vocabulary
        # (≈ 8 % of a batch-64 step); a sampled row's draw is the same either way
        return jax.lax.cond(jnp.any(temps > 0), sample, lambda _: greedy, None)

    @jax.jit
    def f(params, prompt, lengths, temps, seeds):
        b, p = prompt.shape
        keys = jax.vmap(jax.random.PRNGKey)(seeds)
        cache = llama.KVCache.create(cfg, b, _buffer_len(p + max_new + 1), jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        out = llama.apply(gd, params, prompt, pos, cache, cfg, return_hidden=True, feature_layers=feature_layers)
        pp, pi, pa = stats(out.logits)
        last = (lengths - 1)[:, None]
        first = choose(jnp.take_along_axis(out.logits, last[:, :, None], axis=1)[:, 0],
                       jnp.take_along_axis(pa, last, axis=1)[:, 0], temps, keys, max_new)

        def step(carry, i):
            tok, cache = carry
            o = llama.apply(gd, params, tok[:, None], (lengths + i)[:, None], cache, cfg, return_hidden=True,
                            feature_layers=feature_layers)
            sp, si, sa = stats(o.logits[:, 0])
            nxt = choose(o.logits[:, 0], sa, temps, keys, i)
            return (nxt, o.cache), (tok, o.hidden[:, 0], sp, si, sa)

        _, (toks, gh, gp, gi, ga) = jax.lax.scan(step, (first, out.cache), jnp.arange(max_new, dtype=jnp.int32))
        sw = lambda x: jnp.swapaxes(x, 0, 1)
        return out.hidden, pp, pi, pa, sw(toks), sw(gh), sw(gp), sw(gi), sw(ga)

    return f


def _onpolicy_fn(target, dcfg, prompt_len: int, max_new: int, topk: int):
    """Like :func:`_gen_fn`, but the continuation is the DRAFTER's (greedy first drafts,
    each made from the target's true feature of the previous position) and the target
    scores every position (hidden state, top-k, argmax): on-policy data (DistillSpec)."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters import eagle
    from specjax.models import llama

    cfg, gd = target.config, target.graphdef

    stats = functools.partial(topk_stats, topk=topk)

    @jax.jit
    def f(params, dparams, prompt, lengths):
        b, p = prompt.shape
        n = p + max_new + 1
        cache = llama.KVCache.create(cfg, b, _buffer_len(n), jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        out = llama.apply(gd, params, prompt, pos, cache, cfg, return_hidden=True)
        pp, pi, pa = stats(out.logits)
        dcache = eagle.new_cache(dcfg, b, n)
        feats = jnp.concatenate([jnp.zeros_like(out.hidden[:, :1]), out.hidden[:, :-1]], axis=1)
        fd, dcache = eagle.forward(dcfg, dparams, feats, prompt, pos, dcache)
        sub = dparams["frozen"]["sub_ids"]
        last = (lengths - 1)[:, None, None]
        first = sub[jnp.argmax(eagle.sub_logits(dparams, jnp.take_along_axis(fd, last, axis=1)[:, 0]), axis=-1)]
        h_prev = jnp.take_along_axis(out.hidden, last, axis=1)[:, 0]

        def step(carry, i):
            tok, h_prev, cache, dcache = carry  # tok = x_t at t = length + i; h_prev = true h_{t-1}
            p_ = (lengths + i)[:, None]
            o = llama.apply(gd, params, tok[:, None], p_, cache, cfg, return_hidden=True)
            sp, si, sa = stats(o.logits[:, 0])
            fd, dcache = eagle.forward(dcfg, dparams, h_prev[:, None], tok[:, None], p_, dcache)
            nxt = sub[jnp.argmax(eagle.sub_logits(dparams, fd[:, 0]), axis=-1)]
            return (nxt, o.hidden[:, 0], o.cache, dcache), (tok, o.hidden[:, 0], sp, si, sa)

        init = (first, h_prev, out.cache, dcache)
        _, (toks, gh, gp, gi, ga) = jax.lax.scan(step, init, jnp.arange(max_new, dtype=jnp.int32))
        sw = lambda x: jnp.swapaxes(x, 0, 1)
        return out.hidden, pp, pi, pa, sw(toks), sw(gh), sw(gp), sw(gi), sw(ga)

    return f


def generate_data(target, records, *, max_new_tokens, batch, chat, max_prompt_tokens, topk, parts_dir,
                  first_ids=(), drafter=None, log=print, samples=1, temperature=0.8, seed=0, greedy_only=(),
                  feature_layers=()):
    """Greedy target continuations of the (chat-templated) prompts, each prompt cut to its
    last ``max_prompt_tokens`` tokens (the hidden states are then exact for that cut
    input), with the target's hidden states / top-k / argmax at every position.

    Batches of ``batch`` prompts are written as they finish (``parts_dir/part_NNNN.npz``,
    atomically; arrays ``hidden`` [N, F] float32 (F = D), ``topk_p`` [N, topk] float32, ``topk_idx``
    [N, topk] int32, ``argmax`` [N] int32 over the N positions of the part's sequences, and
    ``seqs`` as JSON; with ``feature_layers``, ``hidden`` holds the fused features
    ``[N, len(feature_layers)·D]`` as float16: unit-RMS values, far inside its range) and a restart skips the parts already there; records in ``first_ids``
    (e.g. the eval questions) go first. Returns nothing: read the parts with
    :func:`collect_parts`. With ``drafter = (EagleConfig, params)`` the continuations are the
    drafter's greedy first drafts instead, scored by the target (:func:`_onpolicy_fn`).

    ``samples > 1`` adds ``samples - 1`` continuations per prompt sampled at
    ``temperature`` (seeded from ``seed``, the question id and the sample index), except
    for the question ids in ``greedy_only`` (evaluation prompts keep their one greedy
    continuation). Each sequence records its ``sample`` index (0 = greedy).

    Raises:
      DistillError: ``samples`` < 1, ``samples`` > 1 without a positive ``temperature``, or
        ``samples`` ≠ 1 with a ``drafter``.
      ValueError: text records for a target without a tokenizer.
    """
    os.makedirs(parts_dir, exist_ok=True)
    if samples < 1 or (samples > 1 and not temperature > 0):
        raise DistillError(f"samples per prompt must be >= 1 (got {samples}) and the data temperature > 0 "
                           f"(got {temperature})")
    if drafter is not None and samples != 1:
        raise DistillError("on-policy (drafter) data is greedy: one sample per prompt")
    items = _generation_items(target, records, chat, max_prompt_tokens, samples, first_ids, set(greedy_only))
    p = max(len(x[1]) for x in items)
    f = None
    eos = set(target.config.eos_token_ids)
    source = "target" if drafter is None else "drafter"
    t0 = time.time()
    for bi, lo in enumerate(range(0, len(items), batch)):
        part = os.path.join(parts_dir, f"part_{bi:04d}.npz")
        if os.path.exists(part):
            continue
        if f is None:
            f = _generation_fn(target, drafter, p, max_new_tokens, topk, feature_layers)
        chunk = items[lo: lo + batch]
        outs = _generate_batch(f, target, chunk, batch, p, temperature, seed)
        write_part(part, *_part_arrays(outs, chunk, eos, seed, source), half=bool(feature_layers))
        log(f"generated {min(lo + batch, len(items))}/{len(items)} sequences ({time.time() - t0:.0f}s)")


def _generation_items(target, records, chat, max_prompt_tokens, samples, first_ids, greedy_only):
    """``(record, prompt ids, sample index)`` per continuation to generate, in generation
    order: every greedy one (sample 0) first, records in ``first_ids`` order first."""
    rank = {q: i for i, q in enumerate(first_ids)}
    items = []
    for r in records:
        ids = encode_record(target, r, chat)[-max_prompt_tokens:]
        for k in range(1 if r["question_id"] in greedy_only else samples):
            items.append((r, ids, k))
    items.sort(key=lambda x: (x[2] > 0, rank.get(x[0]["question_id"], len(rank)), x[0]["question_id"], x[2]))
    return items


def _generation_fn(target, drafter, p, max_new_tokens, topk, feature_layers=()):
    """The jitted generation of :func:`generate_data`: ``f(params, prompt, lens, temps, seeds)``."""
    if drafter is None:
        return _gen_fn(target, p, max_new_tokens, topk, feature_layers)
    if feature_layers:
        raise DistillError("on-policy data (--data drafter/both) is not implemented for fused-feature drafters "
                           "(--feature-layers); use --data target")
    g = _onpolicy_fn(target, drafter[0], p, max_new_tokens, topk)
    return lambda params, prompt, lens, temps, seeds: g(params, drafter[1], prompt, lens)


def _generate_batch(f, target, chunk, batch, p, temperature, seed):
    """Run ``f`` on one chunk of items (padded to ``batch`` rows with its last item); the nine
    outputs of :func:`_gen_fn` as NumPy arrays."""
    import jax.numpy as jnp

    rows = chunk + [chunk[-1]] * (batch - len(chunk))
    prompt = np.zeros((batch, p), np.int32)
    lens = np.array([len(x[1]) for x in rows], np.int32)
    temps = np.array([temperature if k else 0.0 for _, _, k in rows], np.float32)
    seeds = np.array([zlib.crc32(f"{seed}/{r['question_id']}/{k}".encode()) & 0x7FFFFFFF for r, _, k in rows],
                     np.int32)
    for j, (_, ids, _) in enumerate(rows):
        prompt[j, : len(ids)] = ids
    return [np.asarray(x) for x in f(target.params, jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(temps),
                                     jnp.asarray(seeds))]


def _part_arrays(outs, chunk, eos, seed, source):
    """The sequences of one generated chunk (each cut after its first EOS) and their
    per-position arrays ``(seqs, hidden, topk_p, topk_idx, argmax)`` (lists of pieces)."""
    ph, pp, pi, pa, gt, gh, gp, gi, ga = outs
    seqs, hid, tps, tis, ams = [], [], [], [], []
    for j, (r, ids, k) in enumerate(chunk):
        n = len(ids)
        new = gt[j].tolist()  # new[i] is the input of step i (position n + i)
        cut = len(new)
        for i, t in enumerate(new):
            if t in eos:
                cut = i + 1
                break
        seqs.append({"question_id": r["question_id"], "category": r["category"], "ids": ids + new[:cut],
                     "prompt_len": n, "turn": 0, "sample": k, "seed": seed, "source": source})
        hid += [ph[j, :n], gh[j, :cut]]
        tps += [pp[j, :n], gp[j, :cut]]
        tis += [pi[j, :n], gi[j, :cut]]
        ams += [pa[j, :n], ga[j, :cut]]
    return seqs, hid, tps, tis, ams


def write_part(part, seqs, hid, tps, tis, ams, half: bool = False):
    """Write one part file atomically (a temporary file renamed); ``half``: hidden as float16. Stored
    uncompressed in C order, so :func:`collect_parts` memory-maps ``hidden`` (rows contiguous)."""
    tmp = part + ".tmp.npz"
    np.savez(tmp, seqs=np.array(json.dumps(seqs)),
             hidden=np.ascontiguousarray(np.concatenate(hid), np.float16 if half else np.float32),
             topk_p=np.concatenate(tps).astype(np.float32), topk_idx=np.concatenate(tis).astype(np.int32),
             argmax=np.concatenate(ams).astype(np.int32))
    os.replace(tmp, part)


# Every other self-prompt wraps the sampled text in a task that reuses it (as summaries,
# extraction, rewriting and translation requests do), so the copy term sees such contexts.
SELF_TASKS = (
    "Summarize the following text in a few sentences.\n\n{}",
    "List the key facts stated in this text.\n\n{}",
    "Rewrite the following text in a clear, formal style.\n\n{}",
    "Translate the following text into French.\n\n{}",
    "Read the text below, then answer: what is it about, and who is involved?\n\n{}",
)


def self_prompts(target, n: int, seed: int, path: str, *, max_tokens: int = 64, batch: int = 64, log=print):
    """``n`` user prompts written by the target itself (Magpie, Xu et al. 2024): the chat
    template up to the start of a user turn, then tokens sampled at temperature 1 until the
    end of the turn (at most ``max_tokens``); every other one is wrapped in one of
    ``SELF_TASKS`` (summarize / extract / rewrite / translate / answer about the text).
    Prompts the drafter never saw, for fitting what must generalize (the copy term).
    Written once to ``path`` (JSONL, question ids ``self-<seed>-<i>``, category ``self``)
    and read back on a resume; empty and repeated prompts are dropped, so there may be
    fewer than ``n``. Returns the records (as :func:`specjax.train.records.read_records`).

    Raises:
      DistillError: the target has no tokenizer or no chat template.
    """
    import jax.numpy as jnp

    if os.path.exists(path):
        return read_records(path)
    tok = target.tokenizer
    if tok is None or tok.chat_template is None:
        raise DistillError("--self-prompts needs a target with a tokenizer and a chat template")
    mark = "\u2063"
    text = tok.apply_chat_template([{"role": "user", "content": mark}])
    prefix = tok.encode(text[: text.index(mark)], add_special_tokens=False)
    f = _gen_fn(target, len(prefix), max_tokens, 1)
    eos = set(target.config.eos_token_ids)
    recs, seen = [], set()
    for lo in range(0, n, batch):
        seeds = np.array([zlib.crc32(f"self/{seed}/{i}".encode()) & 0x7FFFFFFF for i in range(lo, lo + batch)],
                         np.int32)
        prompt = jnp.asarray(np.tile(np.asarray(prefix, np.int32), (batch, 1)))
        outs = f(target.params, prompt, jnp.full((batch,), len(prefix), jnp.int32),
                 jnp.ones((batch,), jnp.float32), jnp.asarray(seeds))
        for j, row in enumerate(np.asarray(outs[4]).tolist()[: n - lo]):
            cut = next((i for i, t in enumerate(row) if t in eos), len(row))
            q = tok.decode(row[:cut]).strip()
            if q and q not in seen:
                seen.add(q)
                i = lo + j
                text = SELF_TASKS[(i // 2) % len(SELF_TASKS)].format(q) if i % 2 else q
                recs.append({"question_id": f"self-{seed}-{i}", "category": "self", "turns": [text]})
        log(f"self-prompts: {len(recs)} from {min(lo + batch, n)} samples")
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        for r in recs:
            fh.write(json.dumps(r) + "\n")
    os.replace(path + ".tmp", path)
    return recs


class RowSegments:
    """Rows ``[N, F]`` stored as segments (arrays or memory maps) one after another, read without
    concatenating them: the target features of a data set, which at millions of tokens do not fit
    in memory twice (3 M tokens × 3 fused layers × 576 × float16 ≈ 10 GB). Supports what the batch
    builders use — ``len``, ``shape``, ``dtype``, ``x[i]`` and ``x[a:b]`` (step 1; a slice within one
    segment is a view, across segments a copy) — and ``np.asarray(x)`` (a concatenated copy)."""

    def __init__(self, segments):
        segs = [s for s in segments if len(s)]
        widths = {tuple(s.shape[1:]) for s in segs}
        if len(widths) > 1:
            raise ValueError(f"segments of different row shapes: {sorted(widths)}")
        self._segs = segs
        self._starts = np.cumsum([0] + [len(s) for s in segs])
        self._row = widths.pop() if widths else (0,)
        self.dtype = segs[0].dtype if segs else np.dtype(np.float32)

    @property
    def segments(self) -> list:
        """The non-empty segments, in order (arrays or memory maps; not copied)."""
        return list(self._segs)

    @property
    def shape(self) -> tuple:
        return (int(self._starts[-1]),) + self._row

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, i: int) -> tuple[int, int]:
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return k, i - int(self._starts[k])

    def __getitem__(self, idx):
        n = len(self)
        if isinstance(idx, slice):
            a, b, step = idx.indices(n)
            if step != 1:
                raise IndexError("RowSegments supports slices of step 1 only")
            if b <= a:
                return np.zeros((0,) + self._row, self.dtype)
            pieces, x = [], a
            while x < b:
                k, lo = self._locate(x)
                end = min(b, int(self._starts[k + 1]))
                pieces.append(self._segs[k][lo: lo + end - x])
                x = end
            return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        i = int(idx)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {idx} out of range for {n} rows")
        k, lo = self._locate(i)
        return self._segs[k][lo]

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate(self._segs) if self._segs else np.zeros((0,) + self._row, self.dtype)
        return out if dtype is None else out.astype(dtype)


def join_rows(parts) -> "RowSegments":
    """Arrays and :class:`RowSegments` as one :class:`RowSegments` (no copy of the rows)."""
    segs = []
    for x in parts:
        segs += x.segments if isinstance(x, RowSegments) else [x]
    return RowSegments(segs)


def npz_member(path: str, name: str):
    """The array ``name`` of the npz file ``path`` memory-mapped (read-only) when it is stored
    uncompressed (as :func:`write_part` writes it: ``np.savez``); loaded otherwise."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name + ".npy")
    if info.compress_type != zipfile.ZIP_STORED:
        return np.load(path)[name]
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)
        offset = f.tell()
    if dtype.hasobject or fortran or not shape or 0 in shape:  # a row of a Fortran-order array spans the file
        return np.load(path)[name]
    return np.memmap(path, dtype=dtype, mode="r", shape=shape, offset=offset)


def part_files(parts_dir: str) -> list[str]:
    """The finished part files of ``parts_dir`` (:func:`write_part`'s ``part_NNNN.npz``, not the
    temporary ones), in order."""
    return [os.path.join(parts_dir, n) for n in sorted(os.listdir(parts_dir))
            if n.startswith("part_") and n.endswith(".npz") and ".tmp" not in n]


def collect_parts(parts_dir: str) -> tuple[list[dict], dict]:
    """All finished parts of ``parts_dir`` as ``(seqs, arrays)``: the sequence dicts, each
    with its ``offset`` (first row) into the arrays ``hidden`` [N, F] (float32 [N, D], or
    float16 fused features [N, len·D]: a :class:`RowSegments` of the parts' arrays memory-mapped
    from the part files, so a data set larger than memory can be read),
    ``topk_p`` [N, k] float32, ``topk_idx`` [N, k] int32 and ``argmax`` [N] int32 (in memory).

    Raises:
      DistillError: no finished part in ``parts_dir``.
    """
    seqs, arrs, hidden = [], defaultdict(list), []
    off = 0
    for path in part_files(parts_dir):
        z = np.load(path)
        for q in json.loads(str(z["seqs"])):
            q["offset"] = off
            off += len(q["ids"])
            seqs.append(q)
        for k in ("topk_p", "topk_idx", "argmax"):
            arrs[k].append(z[k])
        hidden.append(npz_member(path, "hidden"))
    if not seqs:
        raise DistillError(f"{parts_dir}: no generated data yet")
    return seqs, {"hidden": RowSegments(hidden), **{k: np.concatenate(v) for k, v in arrs.items()}}


def sequence_key(q: dict) -> tuple:
    """What makes a continuation the same in two data sets: its prompt (question id, turn), its
    source, and for a sampled one (``sample`` > 0) the sample index and seed; the greedy one of a
    prompt is the same for every seed."""
    k = q.get("sample", 0)
    return q["question_id"], q.get("turn", 0), q.get("source"), k, q.get("seed", 0) if k else None


def collect_data(dirs: list[str]) -> tuple[list[dict], dict]:
    """Several data sets (``collect_parts`` of each) as one. A continuation present in more
    than one set is kept once: the greedy one of a prompt (``sample`` 0, the same for every
    seed) or a sampled one with the same seed and sample index. Returns ``(seqs, arrays)``
    as :func:`collect_parts` (offsets into the merged arrays; ``hidden`` still memory-mapped).

    Raises:
      DistillError: a directory with no finished part.
    """
    seqs, arrs, off = [], defaultdict(list), 0
    seen, width = set(), None
    for d in dirs:
        ds, da = collect_parts(d)
        if width is not None and da["hidden"].shape[1] != width[1]:
            raise DistillError(f"{d} holds target features of width {da['hidden'].shape[1]} but {width[0]} holds "
                               f"{width[1]}: data sets made with different --feature-layers cannot be merged")
        width = width or (d, da["hidden"].shape[1])
        for q in ds:
            key = sequence_key(q)
            if key in seen:
                continue
            seen.add(key)
            lo, n = q["offset"], len(q["ids"])
            for name, v in da.items():
                arrs[name].append(v[lo: lo + n])
            seqs.append(dict(q, offset=off))
            off += n
    return seqs, {k: (join_rows(v) if k == "hidden" else np.concatenate(v)) for k, v in arrs.items()}


# How much a teacher-forced installed-text token counts when the sub-vocabulary is chosen, next to a
# chat token (1). Measured on the shipped drafter's data (1.3M text + 0.12M chat training tokens),
# coverage of the held-out answers' tokens by 8,192 / 16,384 ids: weight 1/8 → 0.885 / 0.932,
# 1/128 → 0.907 / 0.932, 0 → 0.911 / 0.957 (code identifiers and markup crowd out chat words, and
# the lowest ids, the earliest BPE merges, fill better than text counts do).
TEXT_COUNT_WEIGHT = 0.0


def choose_sub_vocab(seqs: list[dict], vocab_size: int, k: int) -> np.ndarray:
    """The ``k`` most frequent token ids in ``seqs`` (ties by lowest id), filled up with the
    lowest unused ids (earliest BPE merges ≈ most frequent in the tokenizer's corpus).
    Tokens of teacher-forced installed text (``source`` ``"text"``) count
    :data:`TEXT_COUNT_WEIGHT` each (0: not at all): the drafter serves chat answers, and that
    text (much of it code) would otherwise decide the head. Returns ``min(k, vocab_size)`` distinct ids, sorted, int32."""
    k = min(k, vocab_size)
    c = Counter()
    for s in seqs:
        w = TEXT_COUNT_WEIGHT if s.get("source") == "text" else 1.0
        if w:
            for t in s["ids"]:
                c[t] += w
    ranked = sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [i for i, _ in ranked[:k] if i < vocab_size]
    have = set(chosen)
    i = 0
    while len(chosen) < k:
        if i not in have:
            chosen.append(i)
        i += 1
    return np.array(sorted(chosen), np.int32)
