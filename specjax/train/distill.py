"""``specjax distill``: train a feature-level drafter (:mod:`specjax.drafters.eagle`) to
match a target (DistillSpec, Zhou et al. 2023; EAGLE, Li et al. 2024).

Pipeline (everything under ``--out DIR``):

1. **data** (``DIR/data``, written to a temporary directory and renamed): the target's
   own greedy continuations of the training prompts (both turns of multi-turn
   questions, the second turn answered after the target's own first answer), then one
   teacher forward per sequence storing the target's final hidden states ``h`` [N, D],
   its top-k next-token probabilities and its argmax. With a tied head the hidden
   states determine the logits exactly; top-k is kept for the loss.
   ``--data drafter`` / ``both`` add on-policy sequences: continuations drafted by the
   trained-so-far drafter (its greedy drafts, re-anchored on the target's true features
   every γ tokens) scored by the target — generated after ``--onpolicy-after`` steps.
2. **sub-vocabulary**: the ``--sub-vocab`` most frequent target tokens in the training
   sequences (ties and the remainder filled by lowest id, i.e. earliest BPE merges).
3. **training** (optax AdamW, linear warmup + cosine decay, global-norm clipping) on
   windows of ``--window`` positions: loss = smooth-L1(f_t, h_t) + ``--ce-weight`` ×
   cross-entropy(p_t top-k restricted to the sub-vocabulary, q_t), plus the same terms
   for a second, unrolled pass that feeds the drafter's own predicted features (what
   drafts 2..γ see). Greedy α (first draft, teacher-forced with true features) on the
   held-out prompts every ``--eval-every`` steps.
4. **checkpoints**: orbax ``CheckpointManager`` in ``DIR/ckpt`` (params, optimizer state,
   step; written to a temporary directory and renamed by orbax, so a half-written step
   is never listed); ``--resume`` restores the latest one and continues with the same
   data order and keys (the batch and key of step s depend only on (seed, s)).
5. **export**: ``DIR/drafter`` (safetensors + ``drafter.json`` with the target fingerprint),
   loadable with :func:`specjax.drafters.eagle.load_drafter`.

Copy term (``--copy-ngram N``, :mod:`specjax.drafters.eagle`): the head also scores the
prompt-lookup candidate with learned per-match-length biases and a context weight. A
drafter fits its own training text far better than new text, so on that text copying
looks useless; ``--init-from D --train-only copy --self-prompts K`` therefore fits only
the copy term, on K prompts the target writes itself (:func:`self_prompts`, Magpie) and
their greedy answers — text the drafter never saw.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zlib
from collections import Counter, defaultdict

import numpy as np

RUN_KEYS = ("model", "prompts", "split", "steps", "seed", "batch_size", "lr", "eval_every", "data", "sub_vocab",
            "intermediate", "window", "max_new_tokens", "gen_batch", "topk", "ce_weight", "unroll_weight",
            "warmup", "checkpoint_every", "chat", "weight_decay", "max_prompt_tokens", "onpolicy_after", "gamma",
            "data_dir", "ce", "samples_per_prompt", "data_temperature", "copy_ngram", "init_from", "self_prompts",
            "train_only")


# --------------------------------------------------------------------------- prompts
def read_records(path: str) -> list[dict]:
    """JSONL records: Spec-Bench (``question_id``, ``category``, ``turns``), ``prompt`` text,
    or ``ids`` (a token-id list, for models without a tokenizer)."""
    if not os.path.exists(path):
        raise ValueError(f"prompts file not found: {path}")
    if os.path.isdir(path):
        raise ValueError(f"--prompts {path} is a directory; give a JSONL file")
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:  # a UTF-8 byte-order mark on the first line is accepted
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start + 1} of the line); "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                o = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(o, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with 'ids', 'turns' or 'prompt'")
            rec = {"question_id": o.get("question_id", len(out)), "category": str(o.get("category", "all"))}
            if "ids" in o:
                if not isinstance(o["ids"], list) or not o["ids"] or not all(
                        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in o["ids"]):
                    raise ValueError(f"{path}:{lineno}: 'ids' must be a non-empty list of token ids (integers >= 0)")
                rec["ids"] = [int(i) for i in o["ids"]]
            elif "turns" in o:
                t = o["turns"]
                if not isinstance(t, list) or not t or not all(isinstance(x, str) and x.strip() for x in t):
                    raise ValueError(f"{path}:{lineno}: 'turns' must be a non-empty list of non-empty strings")
                rec["turns"] = list(t)
            elif "prompt" in o:
                if not isinstance(o["prompt"], str) or not o["prompt"].strip():
                    raise ValueError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
                rec["turns"] = [o["prompt"]]
            else:
                raise ValueError(f"{path}:{lineno}: need 'ids', 'turns' or 'prompt'")
            out.append(rec)
    if not out:
        raise ValueError(f"{path}: no prompts in the file (it is empty)")
    return out


def read_split(path: str) -> dict:
    """``{"train": [ids], "eval": [ids]}`` from a split JSON file.

    Raises:
      DistillError: naming the file: unreadable, not JSON, or without the two lists.
    """
    if not os.path.isfile(path):
        raise DistillError(f"--split {path}: no such file; give a JSON file {{'train': [ids], 'eval': [ids]}}")
    try:
        with open(path, encoding="utf-8-sig") as f:
            split = json.load(f)
    except json.JSONDecodeError as e:
        raise DistillError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); --split needs "
                           "{'train': [ids], 'eval': [ids]}") from None
    except UnicodeDecodeError:
        raise DistillError(f"--split {path}: not valid UTF-8; save it as UTF-8") from None
    if not isinstance(split, dict) or not all(isinstance(split.get(k), list) for k in ("train", "eval")):
        raise DistillError(f"--split {path}: expected a JSON object with lists 'train' and 'eval' (question ids)")
    return split


def make_split(records: list[dict], per_category: int = 5, small_category: int = 1, seed: int = 0) -> dict:
    """Disjoint train/eval question ids: ``per_category`` eval questions per category with
    at least 4×that many questions, ``small_category`` per smaller category."""
    rng = np.random.default_rng(seed)
    by = defaultdict(list)
    for r in records:
        by[r["category"]].append(r["question_id"])
    ev = []
    for cat in sorted(by):
        ids = sorted(by[cat])
        k = per_category if len(ids) >= 4 * per_category else small_category
        ev += sorted(int(i) for i in rng.choice(ids, size=min(k, len(ids) - 1), replace=False))
    ev_set = set(ev)
    tr = sorted(int(r["question_id"]) for r in records if r["question_id"] not in ev_set)
    return {"train": tr, "eval": sorted(ev)}


# --------------------------------------------------------------------------- data
def _encode(target, rec, chat, history=None):
    tok = target.tokenizer
    if "ids" in rec:
        return list(rec["ids"])
    if tok is None:
        raise ValueError("the target has no tokenizer: give prompts as token ids ({'ids': [...]} per line)")
    if not chat:
        return tok.encode(rec["turns"][0])
    msgs = history or [{"role": "user", "content": rec["turns"][0]}]
    return tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)


def _gen_fn(target, prompt_len: int, max_new: int, topk: int):
    """Jitted generation that also returns what training needs, so no separate teacher
    pass is run: per position the target's final hidden state, top-k probabilities and
    argmax (prefill positions and generated positions).

    ``f(params, prompt [b, p] int32, lengths [b] int32, temps [b] float32, seeds [b] int32)``:
    a row with ``temps == 0`` continues greedily; otherwise it samples from
    softmax(logits / temp) with keys folded from its seed and the step (reproducible).
    The stored top-k / argmax are always the target's temperature-1 distribution."""
    import jax
    import jax.numpy as jnp

    from specjax.models import llama

    cfg, gd = target.config, target.graphdef

    def stats(logits):
        logp = jax.nn.log_softmax(logits, axis=-1)
        tv, ti = jax.lax.top_k(logp, topk)
        return jnp.exp(tv), ti.astype(jnp.int32), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def choose(logits, greedy, temps, keys, i):  # logits [b, vocab]
        ks = jax.vmap(jax.random.fold_in, (0, None))(keys, i)
        scaled = logits / jnp.where(temps > 0, temps, 1.0)[:, None]
        sampled = jax.vmap(jax.random.categorical)(ks, scaled).astype(jnp.int32)
        return jnp.where(temps > 0, sampled, greedy)

    @jax.jit
    def f(params, prompt, lengths, temps, seeds):
        b, p = prompt.shape
        keys = jax.vmap(jax.random.PRNGKey)(seeds)
        cache = llama.KVCache.create(cfg, b, p + max_new + 1, jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        out = llama.apply(gd, params, prompt, pos, cache, cfg, return_hidden=True)
        pp, pi, pa = stats(out.logits)
        last = (lengths - 1)[:, None]
        first = choose(jnp.take_along_axis(out.logits, last[:, :, None], axis=1)[:, 0],
                       jnp.take_along_axis(pa, last, axis=1)[:, 0], temps, keys, max_new)

        def step(carry, i):
            tok, cache = carry
            o = llama.apply(gd, params, tok[:, None], (lengths + i)[:, None], cache, cfg, return_hidden=True)
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

    def stats(logits):
        logp = jax.nn.log_softmax(logits, axis=-1)
        tv, ti = jax.lax.top_k(logp, topk)
        return jnp.exp(tv), ti.astype(jnp.int32), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    @jax.jit
    def f(params, dparams, prompt, lengths):
        b, p = prompt.shape
        n = p + max_new + 1
        cache = llama.KVCache.create(cfg, b, n, jnp.float32)
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
                  first_ids=(), drafter=None, log=print, samples=1, temperature=0.8, seed=0, greedy_only=()):
    """Greedy target continuations of the (chat-templated) prompts, each prompt cut to its
    last ``max_prompt_tokens`` tokens (the hidden states are then exact for that cut
    input), with the target's hidden states / top-k / argmax at every position.

    Batches are written as they finish (``parts_dir/part_NNNN.npz``, atomically) and a
    restart skips the parts already there; records in ``first_ids`` (e.g. the eval
    questions) go first. Returns nothing: read the parts with :func:`collect_parts`.
    With ``drafter = (EagleConfig, params)`` the continuations are the drafter's greedy
    first drafts instead, scored by the target (:func:`_onpolicy_fn`).

    ``samples > 1`` adds ``samples - 1`` continuations per prompt sampled at
    ``temperature`` (seeded from ``seed``, the question id and the sample index), except
    for the question ids in ``greedy_only`` (evaluation prompts keep their one greedy
    continuation). Each sequence records its ``sample`` index (0 = greedy).
    """
    import jax.numpy as jnp

    os.makedirs(parts_dir, exist_ok=True)
    rank = {q: i for i, q in enumerate(first_ids)}
    if samples < 1 or (samples > 1 and not temperature > 0):
        raise DistillError(f"samples per prompt must be >= 1 (got {samples}) and the data temperature > 0 "
                           f"(got {temperature})")
    if drafter is not None and samples != 1:
        raise DistillError("on-policy (drafter) data is greedy: one sample per prompt")
    greedy_only = set(greedy_only)
    items = []
    for r in records:
        ids = _encode(target, r, chat)[-max_prompt_tokens:]
        for k in range(1 if r["question_id"] in greedy_only else samples):
            items.append((r, ids, k))
    items.sort(key=lambda x: (x[2] > 0, rank.get(x[0]["question_id"], len(rank)), x[0]["question_id"], x[2]))
    p = max(len(x[1]) for x in items)
    f = None
    eos = set(target.config.eos_token_ids)
    t0 = time.time()
    for bi, lo in enumerate(range(0, len(items), batch)):
        part = os.path.join(parts_dir, f"part_{bi:04d}.npz")
        if os.path.exists(part):
            continue
        if f is None:
            if drafter is None:
                f = _gen_fn(target, p, max_new_tokens, topk)
            else:
                g = _onpolicy_fn(target, drafter[0], p, max_new_tokens, topk)
                f = lambda params, prompt, lens, temps, seeds: g(params, drafter[1], prompt, lens)
        chunk = items[lo: lo + batch]
        rows = chunk + [chunk[-1]] * (batch - len(chunk))
        prompt = np.zeros((batch, p), np.int32)
        lens = np.array([len(x[1]) for x in rows], np.int32)
        temps = np.array([temperature if k else 0.0 for _, _, k in rows], np.float32)
        seeds = np.array([zlib.crc32(f"{seed}/{r['question_id']}/{k}".encode()) & 0x7FFFFFFF for r, _, k in rows],
                         np.int32)
        for j, (_, ids, _) in enumerate(rows):
            prompt[j, : len(ids)] = ids
        outs = [np.asarray(x) for x in f(target.params, jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(temps),
                                         jnp.asarray(seeds))]
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
                         "prompt_len": n, "turn": 0, "sample": k, "seed": seed,
                         "source": "target" if drafter is None else "drafter"})
            hid += [ph[j, :n], gh[j, :cut]]
            tps += [pp[j, :n], gp[j, :cut]]
            tis += [pi[j, :n], gi[j, :cut]]
            ams += [pa[j, :n], ga[j, :cut]]
        tmp = part + ".tmp.npz"
        np.savez(tmp, seqs=np.array(json.dumps(seqs)), hidden=np.concatenate(hid).astype(np.float32),
                 topk_p=np.concatenate(tps).astype(np.float32), topk_idx=np.concatenate(tis).astype(np.int32),
                 argmax=np.concatenate(ams).astype(np.int32))
        os.replace(tmp, part)
        log(f"generated {min(lo + batch, len(items))}/{len(items)} sequences ({time.time() - t0:.0f}s)")


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
    fewer than ``n``."""
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


def collect_parts(parts_dir):
    """All finished parts as ``(seqs with offsets, arrays)``."""
    seqs, arrs = [], defaultdict(list)
    off = 0
    for name in sorted(os.listdir(parts_dir)):
        if not (name.startswith("part_") and name.endswith(".npz")) or ".tmp" in name:
            continue
        z = np.load(os.path.join(parts_dir, name))
        for q in json.loads(str(z["seqs"])):
            q["offset"] = off
            off += len(q["ids"])
            seqs.append(q)
        for k in ("hidden", "topk_p", "topk_idx", "argmax"):
            arrs[k].append(z[k])
    if not seqs:
        raise DistillError(f"{parts_dir}: no generated data yet")
    return seqs, {k: np.concatenate(v) for k, v in arrs.items()}


def collect_data(dirs):
    """Several data sets (``collect_parts`` of each) as one. A continuation present in more
    than one set is kept once: the greedy one of a prompt (``sample`` 0, the same for every
    seed) or a sampled one with the same seed and sample index."""
    seqs, arrs, off = [], defaultdict(list), 0
    seen = set()
    for d in dirs:
        ds, da = collect_parts(d)
        for q in ds:
            k = q.get("sample", 0)
            key = (q["question_id"], q.get("turn", 0), q.get("source"), k, q.get("seed", 0) if k else None)
            if key in seen:
                continue
            seen.add(key)
            lo, n = q["offset"], len(q["ids"])
            for name, v in da.items():
                arrs[name].append(v[lo: lo + n])
            seqs.append(dict(q, offset=off))
            off += n
    return seqs, {k: np.concatenate(v) for k, v in arrs.items()}


def save_data(path, seqs, arrays):
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for k, v in arrays.items():
        np.save(os.path.join(tmp, k + ".npy"), v)
    with open(os.path.join(tmp, "seqs.json"), "w") as f:
        json.dump(seqs, f)
    os.replace(tmp, path) if not os.path.exists(path) else (shutil.rmtree(path), os.replace(tmp, path))


def load_data(path):
    with open(os.path.join(path, "seqs.json")) as f:
        seqs = json.load(f)
    arrays = {k: np.load(os.path.join(path, k + ".npy")) for k in ("hidden", "topk_p", "topk_idx", "argmax")}
    return seqs, arrays


def choose_sub_vocab(seqs, vocab_size: int, k: int) -> np.ndarray:
    """The ``k`` most frequent token ids in ``seqs`` (ties by lowest id), filled up with the
    lowest unused ids (earliest BPE merges ≈ most frequent in the tokenizer's corpus). Sorted."""
    k = min(k, vocab_size)
    c = Counter()
    for s in seqs:
        c.update(s["ids"])
    ranked = sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [i for i, _ in ranked[:k] if i < vocab_size]
    have = set(chosen)
    i = 0
    while len(chosen) < k:
        if i not in have:
            chosen.append(i)
        i += 1
    return np.array(sorted(chosen), np.int32)


# --------------------------------------------------------------------------- windows / batches
def lookup_candidates(ids, max_n: int):
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


def make_windows(seqs, window: int, eval_only_response: bool = False):
    """``(seq index, start)`` windows tiling each sequence from its end (response first)."""
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


def build_batch(seqs, data, windows, sub_pos, window: int, d: int, eval_mask=False, copy_ngram: int = 0):
    """Arrays for a list of windows: feats_in (h_{t-1}), tokens, target h, top-k (as
    sub-vocab positions, −1 outside), target argmax as sub-vocab position (−1 outside),
    loss mask, response mask, category index. With ``copy_ngram``: also the copy
    candidate per position (``cand``, its match size ``cand_n``, its sub-vocab position
    ``cand_pos``), and the raw top-k ids ``tk`` and argmax ``amt``."""
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


# --------------------------------------------------------------------------- model/loss
def _loss_parts(cfg, params, batch, ce_weight, full_head=False, full_ce=True, second_pass=True):
    """Per-position loss of the first pass (true features) and of the unrolled second
    pass (own features), and greedy hits. The cross-entropy is over the target's top-k
    candidates inside the sub-vocabulary (a ranking loss that needs only k head rows per
    position; the feature regression keeps f near h for all other tokens). With
    ``full_head`` the hits use the argmax over the whole sub-vocabulary (evaluation)."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters import eagle

    b, w = batch["tokens"].shape
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    cache = eagle.new_cache(cfg, b, w)
    f, _ = eagle.forward(cfg, params, batch["feats"], batch["tokens"], pos, cache)
    if second_pass:  # pass 2: the drafter's own features as inputs (what drafts 2..γ see)
        feats2 = jnp.concatenate([batch["feats"][:, :1], f[:, :-1]], axis=1)
        f2, _ = eagle.forward(cfg, params, feats2, batch["tokens"], pos, cache)
    head = params["frozen"]["head"]
    ti = batch["ti"]
    valid = ti >= 0
    pp = jnp.where(valid, batch["tp"], 0.0)
    pp = pp / jnp.maximum(pp.sum(-1, keepdims=True), 1e-9)
    hk = jnp.take(head, jnp.maximum(ti, 0), axis=0)  # [B, W, k, D]

    def terms(f):
        diff = f - batch["th"]
        ad = jnp.abs(diff)
        sl1 = jnp.mean(jnp.where(ad < 1.0, 0.5 * diff * diff, ad - 0.5), axis=-1)
        if cfg.copy_ngram:
            ce, hit = _copy_terms(params, f, batch)
            return sl1 + ce_weight * ce, hit
        if full_ce:  # soft labels (target top-k inside S) against log q over the whole sub-vocabulary
            full = jax.nn.log_softmax(eagle.sub_logits(params, f), axis=-1)
            lq = jnp.take_along_axis(full, jnp.maximum(ti, 0), axis=-1)
            ce = -jnp.sum(jnp.where(valid, pp * lq, 0.0), axis=-1)
            lk = jnp.where(valid, lq, -1e30)
        else:  # ranking among the target's top-k candidates only (k head rows per position)
            lk = jnp.einsum("bwd,bwkd->bwk", f, hk)
            lk = jnp.where(valid, lk, -1e30)
            logq = jax.nn.log_softmax(lk, axis=-1)
            ce = -jnp.sum(jnp.where(valid, pp * logq, 0.0), axis=-1)
        if full_head:
            pred = jnp.argmax(eagle.sub_logits(params, f), axis=-1)
        else:
            pred = jnp.take_along_axis(ti, jnp.argmax(lk, axis=-1)[..., None], axis=-1)[..., 0]
        hit = (pred == batch["am"]).astype(jnp.float32)
        return sl1 + ce_weight * ce, hit

    l1, hit1 = terms(f)
    if not second_pass:
        return l1, jnp.zeros_like(l1), hit1, jnp.zeros_like(hit1)
    l2, hit2 = terms(f2)
    return l1, l2, hit1, hit2


def _copy_terms(params, f, batch):
    """Cross-entropy and greedy hits of a drafter with a copy term: q over the
    sub-vocabulary plus the copy candidate (:func:`specjax.drafters.eagle.copy_logit`),
    against the target's top-k probabilities on the tokens q can give (inside S, or the
    candidate). ``f [B, W, D]``; returns ``(ce [B, W], hit [B, W])``."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters import eagle

    sl = eagle.sub_logits(params, f)  # [B, W, S]
    cand, cn, cpos = batch["cand"], batch["cand_n"], batch["cand_pos"]
    has = cn > 0
    lc = eagle.copy_logit(params, f, cand, cn)  # -inf where no candidate
    in_s = jax.nn.one_hot(cpos, sl.shape[-1], dtype=bool) & has[..., None]  # cpos = -1 -> all False
    sl = jnp.where(in_s, lc[..., None], sl)
    extra = jnp.where(has & (cpos < 0), lc, -jnp.inf)
    logz = jnp.logaddexp(jax.nn.logsumexp(sl, axis=-1), extra)
    ti, tk = batch["ti"], batch["tk"]
    is_c = has[..., None] & (tk == cand[..., None])
    ok = (ti >= 0) | is_c
    lq = jnp.where(is_c, lc[..., None], jnp.take_along_axis(sl, jnp.maximum(ti, 0), axis=-1)) - logz[..., None]
    pp = jnp.where(ok, batch["tp"], 0.0)
    pp = pp / jnp.maximum(pp.sum(-1, keepdims=True), 1e-9)
    ce = -jnp.sum(jnp.where(ok, pp * lq, 0.0), axis=-1)
    best = jnp.argmax(sl, axis=-1)
    pred = jnp.where(has & (lc > jnp.max(sl, axis=-1)), cand, params["frozen"]["sub_ids"][best])
    return ce, (pred == batch["amt"]).astype(jnp.float32)


def make_train_step(cfg, opt, ce_weight, unroll_weight, full_ce=True):
    import jax
    import jax.numpy as jnp
    import optax

    def loss_fn(tp, frozen, batch):
        params = {"train": tp, "frozen": frozen}
        l1, l2, hit1, _ = _loss_parts(cfg, params, batch, ce_weight, full_ce=full_ce,
                                      second_pass=unroll_weight > 0)
        m = batch["mask"]
        den = jnp.maximum(m.sum(), 1.0)
        loss = (jnp.sum(l1 * m) + unroll_weight * jnp.sum(l2 * m)) / den
        return loss, jnp.sum(hit1 * m) / den

    @jax.jit
    def step(tp, opt_state, frozen, batch):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(tp, frozen, batch)
        upd, opt_state = opt.update(g, opt_state, tp)
        tp = optax.apply_updates(tp, upd)
        return tp, opt_state, loss, acc

    return step


def make_eval_fn(cfg):
    import jax
    import jax.numpy as jnp

    @jax.jit
    def ev(tp, frozen, batch):
        _, _, hit1, hit2 = _loss_parts(cfg, {"train": tp, "frozen": frozen}, batch, 0.0, full_head=True)
        m = batch["resp"]
        return jnp.sum(hit1 * m, axis=1), jnp.sum(hit2 * m, axis=1), jnp.sum(m, axis=1)

    return ev


COPY_BIAS_LR_MULT = 100.0  # the copy term's per-n biases need logit-sized moves (a few units) in few steps


def make_optimizer(steps, lr, warmup, weight_decay, freeze_base=False):
    """AdamW with linear warmup and cosine decay, global-norm clipping at 1. The copy
    term's biases ``copy_b`` (if any) use ``COPY_BIAS_LR_MULT`` × the learning rate and no
    weight decay: each is one scalar that must move by several logits. ``freeze_base``:
    only ``copy_w``/``copy_b`` change."""
    import jax
    import optax

    warmup = max(1, min(warmup, steps // 5 or 1))

    def sched(peak):
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1), end_value=peak * 0.05)

    def label(k):
        if k == "copy_b":
            return "bias"
        return "frozen" if freeze_base and k != "copy_w" else "base"

    labels = lambda tp: {k: jax.tree_util.tree_map(lambda _: label(k), v) for k, v in tp.items()}
    inner = optax.multi_transform({"base": optax.adamw(sched(lr), weight_decay=weight_decay),
                                   "bias": optax.adam(sched(lr * COPY_BIAS_LR_MULT)),
                                   "frozen": optax.set_to_zero()}, labels)
    return optax.chain(optax.clip_by_global_norm(1.0), inner)


# --------------------------------------------------------------------------- evaluation
def evaluate(ev, tp, frozen, seqs, data, eval_idx, sub_pos, window, d, batch_size, copy_ngram=0):
    """Greedy α of the first draft (true features) and of a second draft (own features),
    over the response positions of the eval sequences, pooled and per category."""
    import jax.numpy as jnp

    wins = make_windows([seqs[i] for i in eval_idx], window, eval_only_response=True)
    wins = [(eval_idx[i], st) for i, st in wins]
    by = defaultdict(lambda: np.zeros(3))
    tot = np.zeros(3)
    for lo in range(0, len(wins), batch_size):
        chunk = wins[lo: lo + batch_size]
        pad = chunk + [chunk[-1]] * (batch_size - len(chunk))
        bt = build_batch(seqs, data, pad, sub_pos, window, d, copy_ngram=copy_ngram)
        h1, h2, n = (np.asarray(x) for x in ev(tp, frozen, {k: jnp.asarray(v) for k, v in bt.items()}))
        for j, (i, _) in enumerate(chunk):
            v = np.array([h1[j], h2[j], n[j]])
            by[seqs[i]["category"]] += v
            tot += v
    res = {"alpha": tot[0] / max(tot[2], 1), "alpha2": tot[1] / max(tot[2], 1), "positions": int(tot[2])}
    res["by_category"] = {c: {"alpha": v[0] / max(v[2], 1), "alpha2": v[1] / max(v[2], 1), "positions": int(v[2])}
                          for c, v in sorted(by.items())}
    return res


# --------------------------------------------------------------------------- main
def _generation_order(records, ev_ids, tr_ids, batch):
    """One batch of eval questions (round-robin over categories), then the training
    questions round-robin over categories, then the other eval questions: a run stopped
    early still has held-out data and every category."""
    ev = _round_robin(records, ev_ids)
    return ev[:batch] + _round_robin(records, tr_ids) + ev[batch:]


def _round_robin(records, ids):
    """``ids`` ordered round-robin over categories (generation order of the eval questions)."""
    by = defaultdict(list)
    for r in records:
        if r["question_id"] in ids:
            by[r["category"]].append(r["question_id"])
    out = []
    while any(by.values()):
        for c in sorted(by):
            if by[c]:
                out.append(by[c].pop(0))
    return out


def latest_complete_step(mngr, ckdir):
    """The newest step orbax lists whose directory is finalized. Orbax writes a step into
    ``<step>.orbax-checkpoint-tmp-*`` and renames it when complete (such temporaries are
    never listed); as a second guard a step directory without orbax's
    ``_CHECKPOINT_METADATA`` file (written when a save completes) is skipped too."""
    for step in sorted(mngr.all_steps(), reverse=True):
        if os.path.isfile(os.path.join(ckdir, str(step), "_CHECKPOINT_METADATA")):
            return step
        _log(f"skipping incomplete checkpoint directory {os.path.join(ckdir, str(step))}")
    return None


class DistillError(ValueError):
    pass


def _log(msg):
    print(f"[distill {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# (option, smallest allowed value, what it means) for distill's numeric options
_MIN = [("steps", 0, "training steps; 0 = only generate the data set"), ("batch_size", 1, "windows per step"), ("warmup", 0, "warm-up steps"),
        ("eval_every", 0, "steps between evaluations, 0 = off"), ("checkpoint_every", 1, "steps between checkpoints"),
        ("onpolicy_after", 0, "steps"), ("gamma", 1, "draft tokens per round"), ("sub_vocab", 1, "head rows"),
        ("intermediate", 1, "MLP width"), ("copy_ngram", 0, "0 = none"), ("self_prompts", 0, "prompts"),
        ("window", 2, "positions per window"), ("max_new_tokens", 1, "tokens"), ("max_prompt_tokens", 1, "tokens"),
        ("gen_batch", 1, "prompts per batch"), ("samples_per_prompt", 1, "continuations"),
        ("topk", 1, "probabilities per position"), ("bench_per_category", 0, "0 = all"), ("bench_limit", 0, "0 = all")]
_NONNEG_FLOATS = [("lr", False), ("weight_decay", True), ("data_temperature", True), ("ce_weight", True),
                  ("unroll_weight", True)]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(s, export_only: bool = False) -> None:
    """Validate distill's options before anything is written or loaded.

    Raises:
      DistillError: a numeric option out of range, a conflicting combination, or a missing file.
    """
    import math

    for name, lo, what in _MIN:
        v = getattr(s, name, None)
        if v is None or (name == "steps" and export_only):
            continue
        if v < lo:
            raise DistillError(f"{_flag(name)} must be an integer >= {lo} ({what}), got {v}")
    for name, zero_ok in _NONNEG_FLOATS:
        v = getattr(s, name, None)
        if v is not None and not (math.isfinite(v) and (v >= 0 if zero_ok else v > 0)):
            raise DistillError(f"{_flag(name)} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {v}")
    seed = getattr(s, "seed", 0)
    if not 0 <= seed < 2**64:
        raise DistillError(f"--seed must be in [0, 2**64), got {seed}")
    if getattr(s, "copy_ngram", 0) and s.data != "target":
        raise DistillError("--copy-ngram trains on target data only (--data target): on-policy generation has no "
                           "copy term yet")
    if getattr(s, "copy_ngram", 0) and s.ce != "full":
        raise DistillError("--copy-ngram needs --ce full (the copy term competes with the whole sub-vocabulary)")
    if getattr(s, "train_only", None) == "copy" and not (s.copy_ngram and s.init_from):
        raise DistillError("--train-only copy fits the copy term of a trained drafter: give --copy-ngram N and "
                           "--init-from DRAFTER_DIR")
    if getattr(s, "data", "target") in ("drafter", "both") and not 0 < s.onpolicy_after < s.steps:
        raise DistillError(f"--data {s.data} needs 0 < --onpolicy-after < --steps (steps trained on target data "
                           "before the drafter generates its own)")
    given = [s.data_dir] if isinstance(getattr(s, "data_dir", None), str) else list(getattr(s, "data_dir", None) or [])
    for x in given:
        if not os.path.isdir(os.path.abspath(x)):
            raise DistillError(f"--data-dir {x}: no data set there (a run's DIR/data)")
    if getattr(s, "init_from", None) and not os.path.isdir(os.path.expanduser(s.init_from)):
        raise DistillError(f"--init-from {s.init_from}: no such drafter directory")
    if s.prompts is None:
        raise DistillError("--prompts FILE is required (JSONL: Spec-Bench 'turns', 'prompt' or 'ids')")
    records = read_records(s.prompts)
    if s.split:
        split = read_split(s.split)
        ids = {r["question_id"] for r in records}
        if not ids & set(x for x in split["train"] + split["eval"] if isinstance(x, (int, str))):
            raise DistillError(f"--split {s.split}: none of its question ids is in {s.prompts}")


def _not_started(out: str) -> bool:
    """A run directory holding only ``run.json``: the settings were written, then the run
    failed or was stopped before making anything (e.g. during the model load)."""
    return os.path.isdir(out) and os.listdir(out) == ["run.json"]


def run(args) -> dict:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from specjax.drafters import eagle
    from specjax.io.loading import load_model

    out = os.path.abspath(args.out)
    run_file = os.path.join(out, "run.json")
    settings = {k: getattr(args, k) for k in RUN_KEYS}
    if os.path.exists(out) and not os.path.isdir(out):
        raise DistillError(f"--out {out} is a file; give a directory for the run")
    resuming = os.path.exists(out) and bool(os.listdir(out)) and not _not_started(out)
    if resuming:
        if not args.resume:
            raise DistillError(f"{out} exists and is not empty; pass --resume to continue that run, "
                               "or choose a new --out (nothing there is overwritten)")
        if not os.path.exists(run_file):
            raise DistillError(f"{out} is not a specjax distill run (no run.json); refusing to touch it")
        with open(run_file) as f:
            saved = json.load(f)
        settings = {k: saved.get(k, v) for k, v in settings.items()}
    s = argparse.Namespace(**settings)
    check_args(s, export_only=getattr(args, "export_only", False))  # before anything is written or loaded
    if resuming:
        _log(f"resuming the run in {out}")
    else:
        if _not_started(out):
            _log(f"{out} holds only the run.json of a run that never started; starting it anew")
        elif args.resume:
            _log(f"--resume: {out} is empty, starting a new run")
        _check_out_dir(out)
        os.makedirs(out, exist_ok=True)
        with open(run_file + ".tmp", "w") as f:
            json.dump(settings, f, indent=2)
        os.replace(run_file + ".tmp", run_file)

    target = load_model(s.model, dtype="float32")
    records = read_records(s.prompts)
    if s.split:
        split = read_split(s.split)
    else:
        split = make_split(records, seed=0)
    tr_ids, ev_ids = set(split["train"]), set(split["eval"])
    if tr_ids & ev_ids:
        raise DistillError(f"the split is not disjoint: {sorted(tr_ids & ev_ids)[:5]} in both")
    chat = bool(s.chat) and target.tokenizer is not None and target.tokenizer.chat_template is not None

    # ---- data
    given = [s.data_dir] if isinstance(s.data_dir, str) else list(s.data_dir or [])
    data_dirs = [os.path.abspath(x) for x in given] or [os.path.join(out, "data")]
    data_dir = data_dirs[0]
    if not given:
        recs = [r for r in records if r["question_id"] in tr_ids or r["question_id"] in ev_ids]
        if s.data not in ("target", "both"):
            _log("--data drafter: the first data set still comes from the target (the drafter starts untrained)")
        generate_data(target, recs, max_new_tokens=s.max_new_tokens, batch=s.gen_batch, chat=chat,
                      max_prompt_tokens=s.max_prompt_tokens, topk=s.topk, parts_dir=data_dir,
                      first_ids=_generation_order(records, ev_ids, tr_ids, s.gen_batch), log=_log,
                      samples=s.samples_per_prompt, temperature=s.data_temperature, seed=s.seed, greedy_only=ev_ids)
    if s.self_prompts:
        recs = self_prompts(target, s.self_prompts, s.seed, os.path.join(out, "self_prompts.jsonl"),
                            batch=s.gen_batch, log=_log)
        generate_data(target, recs, max_new_tokens=s.max_new_tokens, batch=s.gen_batch, chat=chat,
                      max_prompt_tokens=s.max_prompt_tokens, topk=s.topk, parts_dir=os.path.join(out, "data_self"),
                      log=_log)
        data_dirs = data_dirs + [os.path.join(out, "data_self")]
    seqs, data = collect_data(data_dirs)
    for q in seqs:
        q["split"] = "eval" if q["question_id"] in ev_ids else "train"
    vocab = target.config.vocab_size
    train_idx = [i for i, q in enumerate(seqs) if q["split"] == "train"]
    eval_idx = [i for i, q in enumerate(seqs) if q["split"] == "eval" and q["turn"] == 0 and not q.get("sample")]
    init = None
    if s.init_from:  # warm start: the trained weights (and sub-vocabulary) of a saved drafter
        init = eagle.load_drafter(s.init_from, target)
        sub_ids = np.asarray(init.params["frozen"]["sub_ids"])
        s.intermediate = init.config.layer.intermediate_size
        _log(f"starting from the drafter in {s.init_from} (its sub-vocabulary of {len(sub_ids)} and MLP width "
             f"{s.intermediate})")
    else:
        sub_ids = choose_sub_vocab([seqs[i] for i in train_idx], vocab, s.sub_vocab)
    sub_pos = np.full(vocab, -1, np.int32)
    sub_pos[sub_ids] = np.arange(len(sub_ids), dtype=np.int32)
    cov = np.mean([sub_pos[t] >= 0 for i in eval_idx for t in seqs[i]["ids"][seqs[i]["prompt_len"]:]] or [1.0])
    _log(f"{len(train_idx)} train / {len(eval_idx)} eval sequences; {sum(len(seqs[i]['ids']) for i in train_idx)} "
         f"train tokens; sub-vocab {len(sub_ids)} covers {cov:.3f} of eval response tokens")

    cfg = eagle.EagleConfig.for_target(target.config, len(sub_ids), s.intermediate, copy_ngram=s.copy_ngram)
    frozen = eagle.frozen_params(target, sub_ids)
    d = cfg.hidden_size
    if init is None:
        tp = eagle.init_params(cfg, s.seed, target.params["final_norm"][...])
    else:
        # its copy term too if it has the same one; otherwise a fresh (zero) copy term, or none
        same = init.config.copy_ngram == s.copy_ngram
        tp = {k: v for k, v in init.params["train"].items() if same or k not in eagle.COPY_KEYS}
        tp.update({k: v for k, v in eagle.init_copy_params(cfg).items() if k not in tp})
    opt = make_optimizer(s.steps, s.lr, s.warmup, s.weight_decay, freeze_base=s.train_only == "copy")
    opt_state = opt.init(tp)
    step_fn = make_train_step(cfg, opt, s.ce_weight, s.unroll_weight, s.ce == "full")
    ev_fn = make_eval_fn(cfg)

    # ---- checkpoints
    ckdir = os.path.join(out, "ckpt")
    mngr = ocp.CheckpointManager(ckdir, options=ocp.CheckpointManagerOptions(
        max_to_keep=3, save_interval_steps=1, enable_async_checkpointing=False, create=True))
    start = 0
    history = []
    latest = latest_complete_step(mngr, ckdir)
    if latest is not None:
        tmpl = {"params": tp, "opt_state": opt_state, "step": np.asarray(0, np.int64)}
        restored = mngr.restore(latest, args=ocp.args.StandardRestore(tmpl))
        tp, opt_state = restored["params"], restored["opt_state"]
        start = int(restored["step"])
        hist_file = os.path.join(out, "history.json")
        if os.path.exists(hist_file):
            with open(hist_file) as f:
                history = [h for h in json.load(f) if h["step"] <= start]
        _log(f"restored checkpoint at step {start}")

    fit_idx = train_idx
    if s.train_only == "copy" and s.self_prompts:  # text the drafter has not memorized
        fit_idx = [i for i in train_idx if seqs[i]["category"] == "self"]
        _log(f"--train-only copy: fitting on the {len(fit_idx)} self-prompt sequences")
    windows = make_windows([seqs[i] for i in fit_idx], s.window)
    windows = [(fit_idx[i], st) for i, st in windows]
    bs = s.batch_size
    ds = {"seqs": seqs, "data": data, "windows": windows}
    onpolicy = s.data in ("drafter", "both") and 0 < s.onpolicy_after < s.steps

    def add_onpolicy():
        """Drafter-generated, target-scored sequences from the train prompts (params of step
        ``onpolicy_after``; parts on disk, so a resume regenerates nothing it has)."""
        od = os.path.join(out, "data_onpolicy")
        recs = [r for r in records if r["question_id"] in tr_ids]
        generate_data(target, recs, max_new_tokens=s.max_new_tokens, batch=s.gen_batch, chat=chat,
                      max_prompt_tokens=s.max_prompt_tokens, topk=s.topk, parts_dir=od,
                      first_ids=_round_robin(records, tr_ids), drafter=(cfg, {"train": tp, "frozen": frozen}),
                      log=_log)
        oseqs, odata = collect_parts(od)
        n0 = len(data["argmax"])
        base = [] if s.data == "drafter" else windows
        allseqs = seqs + [dict(q, offset=q["offset"] + n0, split="train") for q in oseqs]
        alldata = {k: np.concatenate([data[k], odata[k]]) for k in data}
        ow = make_windows(oseqs, s.window)
        ds.update(seqs=allseqs, data=alldata, windows=base + [(len(seqs) + i, st) for i, st in ow])
        _log(f"on-policy data: {len(oseqs)} drafter sequences; {len(ds['windows'])} training windows now")

    def batch_for(step):  # depends only on (seed, step): exact resume
        nw = len(ds["windows"])
        epoch, pos = divmod(step * bs, nw)
        idx = []
        while len(idx) < bs:
            perm = np.random.default_rng([s.seed, epoch]).permutation(nw)
            take = perm[pos: pos + bs - len(idx)]
            idx += take.tolist()
            epoch, pos = epoch + 1, 0
        return build_batch(ds["seqs"], ds["data"], [ds["windows"][i] for i in idx], sub_pos, s.window, d,
                           copy_ngram=s.copy_ngram)

    if getattr(args, "export_only", False):  # write DIR/drafter from the latest checkpoint, no training
        if latest is None:
            raise DistillError(f"{out}: no complete checkpoint to export")
        s.steps = start
    elif onpolicy and start >= s.onpolicy_after:
        add_onpolicy()

    def do_eval(step):
        r = evaluate(ev_fn, tp, frozen, seqs, data, eval_idx, sub_pos, s.window, d, bs, s.copy_ngram)
        r["step"] = step
        history.append(r)
        with open(os.path.join(out, "history.json.tmp"), "w") as f:
            json.dump(history, f, indent=1)
        os.replace(os.path.join(out, "history.json.tmp"), os.path.join(out, "history.json"))
        return r

    from tqdm import tqdm

    if start == 0 and s.eval_every and s.steps > 0:
        r0 = do_eval(0)
        _log(f"step 0: α = {r0['alpha']:.3f} (second draft {r0['alpha2']:.3f})")
    alpha = history[-1]["alpha"] if history else float("nan")
    bar = tqdm(range(start, s.steps), initial=start, total=s.steps, desc="distill", file=sys.stderr,
               disable=True if os.environ.get("SPECJAX_NO_PROGRESS") == "1" else None,  # None: only on a TTY
               mininterval=2.0)
    t0 = time.time()
    loss = float("nan")
    for step in bar:
        b = {k: jnp.asarray(v) for k, v in batch_for(step).items()}
        tp, opt_state, loss, acc = step_fn(tp, opt_state, frozen, b)
        done = step + 1
        if s.eval_every and (done % s.eval_every == 0 or done == s.steps):
            alpha = do_eval(done)["alpha"]
        if done % s.checkpoint_every == 0 or done == s.steps or (onpolicy and done == s.onpolicy_after):
            mngr.save(done, args=ocp.args.StandardSave({"params": tp, "opt_state": opt_state,
                                                        "step": np.asarray(done, np.int64)}))
            mngr.wait_until_finished()
        if onpolicy and done == s.onpolicy_after:
            add_onpolicy()
        bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{float(acc):.2f}", alpha=f"{alpha:.3f}")
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    train_s = time.time() - t0
    final = history[-1] if history else {}
    dd = os.path.join(out, "drafter")
    shutil.rmtree(dd + ".tmp", ignore_errors=True)
    eagle.save_drafter(dd + ".tmp", cfg, tp, sub_ids, target, extra={
        "steps": s.steps, "seed": s.seed, "train_sequences": len(train_idx),
        "train_tokens": int(sum(len(seqs[i]["ids"]) for i in train_idx)), "eval": final,
        "init_from": s.init_from, "train_only": s.train_only, "fit_sequences": len(fit_idx)})
    if os.path.exists(dd):
        shutil.rmtree(dd)
    os.replace(dd + ".tmp", dd)
    _log(f"done: {s.steps} steps ({train_s:.0f}s this session), α = {final.get('alpha', float('nan')):.3f}; "
         f"drafter in {dd}")
    return {"out": out, "final": final, "train_s": train_s}


def bench(args) -> dict:
    """Real decode loop on the evaluation split: autoregressive vs the distilled drafter at
    each γ, ``ngram`` and the untrained truncated target (first 2 layers), greedy, batch 1,
    interleaved prompt by prompt (all kinds see the same machine load); compile time excluded.
    Also checks that every speculative output equals the autoregressive one."""
    from specjax.io.loading import load_model

    out = os.path.abspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise DistillError(f"--out {out} is a file; give a directory for the benchmark results")
    if os.path.exists(out) and os.listdir(out):
        raise DistillError(f"{out} exists and is not empty; choose a new --out for the benchmark results")
    check_args(args, export_only=True)
    gammas = _parse_gammas(args.bench_gammas)
    if args.bench != "default" and not os.path.isdir(os.path.expanduser(args.bench)):
        raise DistillError(f"--bench {args.bench}: no such drafter directory (a run's DIR/drafter, or 'default')")
    _check_out_dir(out)
    os.makedirs(out, exist_ok=True)
    target = load_model(args.model, dtype="float32")
    records = read_records(args.prompts)
    ev = set(x for x in read_split(args.split)["eval"] if isinstance(x, (int, str)))
    recs = [r for r in records if r["question_id"] in ev]
    if args.bench_per_category:
        seen = Counter()
        keep = []
        for r in recs:
            if seen[r["category"]] < args.bench_per_category:
                keep.append(r)
                seen[r["category"]] += 1
        recs = keep
    if args.bench_limit:
        recs = recs[: args.bench_limit]
    prompts = [_encode(target, r, True) for r in recs]
    import specjax.runtime.decoder as sd

    saved_bucket = sd.PROMPT_BUCKET
    sd.PROMPT_BUCKET = 512  # few prompt-shape buckets: each new bucket compiles every decoder again
    try:
        return _bench_run(args, out, target, recs, prompts, gammas)
    finally:
        sd.PROMPT_BUCKET = saved_bucket


def _bench_run(args, out, target, recs, prompts, gammas):
    from specjax.api import load_drafter
    from specjax.runtime.decoder import Decoder
    from specjax.drafters import eagle
    from specjax.drafters.model import ModelDrafter
    from specjax.io.loading import truncate_model

    dr = (load_drafter("default", target) if args.bench == "default"
          else eagle.load_drafter(args.bench, target))
    kinds = [("ar", Decoder(target))]
    kinds += [(f"distilled γ={g}", Decoder(target, dr, g)) for g in gammas]
    kinds += [("ngram γ=4", Decoder(target, load_drafter("ngram", target), 4))]
    kinds += [("first2 γ=2", Decoder(target, ModelDrafter.from_model(truncate_model(target, 2), name="first2"), 2))]
    res = {k: {"new_tokens": 0, "decode_s": 0.0, "target_calls": 0, "accepted": 0, "checked": 0,
               "by_category": defaultdict(lambda: [0, 0, 0, 0])} for k, _ in kinds}
    mismatches = []
    for i, (r, ids) in enumerate(zip(recs, prompts)):
        ar_tokens = None
        for name, dec in kinds:
            g = dec.generate([ids], max_new_tokens=args.max_new_tokens)
            st = g.stats[0]
            if name == "ar":
                ar_tokens = g.tokens[0]
            elif g.tokens[0] != ar_tokens:
                mismatches.append((name, r["question_id"]))
            e = res[name]
            e["new_tokens"] += len(g.tokens[0])
            e["decode_s"] += g.decode_s
            e["target_calls"] += st["target_calls"]
            e["accepted"] += st["accepted_tokens"]
            e["checked"] += st["checked_tokens"]
            bc = e["by_category"][r["category"]]
            bc[0] += len(g.tokens[0]); bc[1] += g.decode_s; bc[2] += st["accepted_tokens"]; bc[3] += st["checked_tokens"]
        _log(f"bench {i + 1}/{len(recs)} ({r['category']}): " + ", ".join(
            f"{k} {v['new_tokens'] / max(v['decode_s'], 1e-9):.1f} tok/s" for k, v in res.items()))
    ar_tps = res["ar"]["new_tokens"] / res["ar"]["decode_s"]
    ar_cat = {c: v[0] / v[1] for c, v in res["ar"]["by_category"].items()}
    table = {}
    for k, v in res.items():
        tps = v["new_tokens"] / v["decode_s"]
        table[k] = {"tokens_per_s": tps, "speedup": tps / ar_tps, "alpha": v["accepted"] / max(v["checked"], 1),
                    "tokens_per_call": v["new_tokens"] / max(v["target_calls"], 1), "new_tokens": v["new_tokens"],
                    "by_category": {c: {"speedup": (x[0] / x[1]) / ar_cat[c], "alpha": x[2] / max(x[3], 1)}
                                    for c, x in sorted(v["by_category"].items())}}
    result = {"prompts": len(recs), "max_new_tokens": args.max_new_tokens, "dtype": "float32", "batch": 1,
              "greedy": True, "mismatches": mismatches, "table": table}
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    for k, v in table.items():
        print(f"{k:16s} {v['tokens_per_s']:6.2f} tok/s  speedup {v['speedup']:.2f}x  alpha {v['alpha']:.3f}  "
              f"tokens/call {v['tokens_per_call']:.2f}")
    if mismatches:
        print(f"MISMATCH vs autoregressive: {mismatches}")
    return result


def _parse_gammas(text: str) -> list[int]:
    try:
        gammas = [int(g) for g in str(text).split(",")]
    except ValueError:
        gammas = []
    if not gammas or min(gammas) < 1:
        raise DistillError(f"--bench-gammas must be comma-separated integers >= 1, e.g. 2,3,4; got {text!r}")
    return gammas


def _check_out_dir(out: str) -> None:
    """Fail before any work when the run directory cannot be created or written."""
    from specjax.eval.bench import check_writable

    try:
        check_writable(os.path.join(out, "run.json"))
    except ValueError as e:
        raise DistillError(str(e).replace(f"--out {os.path.join(out, 'run.json')}", f"--out {out}")) from None
