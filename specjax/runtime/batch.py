"""A batch before anything compiles: its checks (:func:`validate_batch`, γ, trees, seeds), its
shape buckets (:func:`prompt_bucket`, :func:`decode_buffer_len`), its request keys
(:func:`request_keys`), its stop ids (:func:`stop_ids_array`) and the prompts it shares
(:func:`shared_prompts`). :mod:`specjax.runtime.decoder` builds its programs from these (and
re-exports them: ``from specjax.runtime.decoder import request_keys`` keeps working).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from specjax.core.drafting import MAX_GAMMA, MAX_NEW_TOKENS, TreeShape

PROMPT_BUCKET = 32  # smallest prompt bucket; prompts pad to the next power of two ≥ this
BUFFER_BUCKET = 64
STOP_IDS_BUCKET = 8  # stop-id slots per row (EOS + stop token ids) pad to a multiple of this


def round_up(n: int, size: int) -> int:
    """``n`` rounded up to a multiple of ``size``, at least ``size``."""
    return max(size, -(-n // size) * size)


def decode_buffer_len(prompt_len: int, max_new_tokens: int, gamma: int, min_prompt_bucket: int = PROMPT_BUCKET) -> int:
    """Token/KV buffer slots of a program for prompts of up to ``prompt_len`` tokens: the
    prompt bucket (:func:`prompt_bucket` with ``min_prompt_bucket``) + ``max_new_tokens`` + γ
    + 1 spare slots, rounded up to ``BUFFER_BUCKET``. With a draft tree pass
    :func:`specjax.runtime.loop.tree_scratch` of its shape (≥ N) as ``gamma``."""
    return round_up(prompt_bucket(int(prompt_len), min_prompt_bucket) + int(max_new_tokens) + int(gamma) + 1,
                   BUFFER_BUCKET)


def prompt_bucket(n: int, minimum: int = PROMPT_BUCKET) -> int:
    """Padded prompt length for a prompt of ``n`` tokens: the next power of two, at least
    ``minimum`` (default ``PROMPT_BUCKET``). Each bucket compiles its own prefill and decode
    programs, so geometric buckets keep the number of programs logarithmic in the prompt
    lengths seen (at most 2× prefill padding; the decode loop never attends to the padding);
    a larger ``minimum`` means fewer buckets (fewer compiles) for more padding."""
    return max(int(minimum), 1 << max(0, int(n) - 1).bit_length())


SEED_LIMIT = 2 ** 64


def seed_key(seed) -> np.ndarray:
    """The raw threefry key ``[2] uint32`` of a seed in ``[0, 2**64)``: ``[seed >> 32, seed & 0xFFFFFFFF]``,
    all 64 bits (``jax.random.PRNGKey(seed)`` with 64-bit ints enabled; for seeds < 2**32 the
    same key as ``PRNGKey(seed)`` without them).

    Raises:
      ValueError: a seed that is not an integer in ``[0, 2**64)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    s = int(seed)
    return np.array([s >> 32, s & 0xFFFFFFFF], np.uint32)


def request_keys(seed: int | Sequence[int], batch: int, offset: int = 0) -> jax.Array:
    """Per-row request keys ``[B, 2]`` uint32: ``fold_in(seed_key(seed), offset + i)`` for an int
    seed (row identity = its index in the request list, not its batch slot), or
    ``seed_key(seed_i)`` for a list of per-row seeds. Seeds are integers in ``[0, 2**64)``
    and every bit counts (distinct seeds give distinct keys).

    Raises:
      ValueError: a seed outside ``[0, 2**64)``, or a list whose length is not ``batch``.
    """
    if isinstance(seed, (list, tuple, np.ndarray)):
        if len(seed) != batch:
            raise ValueError(f"got {len(seed)} seeds for {batch} prompts; pass one per prompt or a single int")
        # device_put is a plain transfer; jnp.asarray of a numpy array compiles a small program per
        # shape (jax 0.10), which tests/test_compile_count.py would count as a recompilation
        return jax.device_put(np.stack([seed_key(s) for s in seed]))
    base = jax.device_put(seed_key(seed))
    # one vectorized fold_in (a Python loop of B eager fold_ins took 142 s for B = 4000)
    rows = jax.device_put(np.arange(offset, offset + batch, dtype=np.uint32))
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(rows)


def tree_shape(nodes=None, depth=None, topk=None) -> TreeShape | None:
    """The :class:`~specjax.core.drafting.TreeShape` of the keywords ``tree_nodes``,
    ``tree_depth``, ``tree_topk`` (``None`` when none is given: chains).

    Raises:
      ValueError: some but not all three given, or sizes outside the ranges of ``TreeShape``.
    """
    given = {"tree_nodes": nodes, "tree_depth": depth, "tree_topk": topk}
    if all(v is None for v in given.values()):
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"a draft tree needs tree_nodes, tree_depth and tree_topk together; missing "
                         f"{', '.join(missing)}")
    return TreeShape(nodes, depth, topk)


def check_tree_drafter(tree: TreeShape | None, drafter) -> None:
    """Refuse a tree the drafter cannot propose: no drafter, or K > 1 for a drafter that proposes
    chains only (``proposes_trees`` false: a draft model). Raises ValueError."""
    if tree is None:
        return
    if drafter is None:
        raise ValueError("a draft tree needs a drafter (ngram, default or an EAGLE drafter path)")
    if tree.topk > 1 and not drafter.proposes_trees:
        raise ValueError(f"drafter {drafter.name!r} proposes chains only (a tree needs "
                         "--draft ngram, default or an EAGLE drafter); use tree topk 1 or --gamma")


def shared_prompts(prompts) -> tuple[list[list[int]], np.ndarray, np.ndarray] | None:
    """How a batch with repeated prompts shares one prefill per distinct prompt (n samples of a
    prompt, best-of-n, a chi-square over thousands of rows of one prompt: one prefill, not n).

    Returns ``None`` when sharing saves nothing (every prompt distinct, after rounding), else
    ``(distinct prompts padded with copies of the first to a power of two U, source [B] int32:
    row → its prompt's index, first [U] int32: prompt → a row that has it)`` — the ``shared``
    argument of :func:`specjax.runtime.prefill.prefill`. U is a power of two so that the number of
    prefill programs per bucket stays logarithmic in the batch."""
    index: dict = {}
    source = np.array([index.setdefault(tuple(int(t) for t in p), len(index)) for p in prompts], np.int32)
    u = len(index)
    width = 1 << max(0, u - 1).bit_length()
    if width >= len(prompts):
        return None
    first = np.zeros(width, np.int32)
    first[:u] = np.unique(source, return_index=True)[1]  # each distinct prompt's first row (ids 0..u-1)
    keys = list(index)
    return [list(k) for k in keys + keys[:1] * (width - u)], source, first


def validate_batch(prompts, max_new_tokens, gamma, drafter, ctx_limit, vocab_size: int | None = None):
    """Raises ValueError (one line naming the problem and the fix) for a batch the decoder cannot
    run: no prompts, a prompt that is not a list of token ids, empty, too long for the context or
    with an id outside ``[0, vocab_size)``; ``max_new_tokens`` not an integer in [1,
    :data:`MAX_NEW_TOKENS`]; γ out of range."""
    if isinstance(prompts, (str, bytes)) or not prompts:
        raise ValueError("no prompts given; pass a list of prompts, each a list of token ids")
    if all(isinstance(p, (int, np.integer)) for p in prompts):
        raise ValueError("prompts must be a list of token-id lists, one per prompt, got a flat list of ints; "
                         "wrap it: [[...]]")
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes, int, np.integer)) or not hasattr(p, "__len__"):
            raise ValueError(f"prompt {i} is {type(p).__name__}, not a list of token ids; encode text first "
                             "(specjax.generate_text takes text)")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; give at least one token (text) per prompt")
        ids = np.asarray(p)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"prompt {i} holds {ids.dtype} values, not integer token ids")
        if vocab_size is not None and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise ValueError(f"prompt {i} has token id {bad}, outside the vocabulary [0, {vocab_size}); "
                             "use ids from the model's tokenizer")
        if len(p) >= ctx_limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens, longer than the model's context of {ctx_limit} "
                "(it must leave room for at least one new token); shorten the prompt"
            )
    mn = np.asarray(max_new_tokens).reshape(-1)
    if (mn.dtype.kind not in "iuf" or np.any(mn < 1) or np.any(mn != np.round(mn))
            or np.any(mn > MAX_NEW_TOKENS)):
        raise ValueError(f"max_new_tokens must be an integer >= 1 (at most {MAX_NEW_TOKENS}), got {max_new_tokens!r}")
    if drafter is not None:
        check_gamma(gamma)


def check_gamma(gamma) -> None:
    """Raises ValueError unless ``gamma`` is an integer in [1, ``MAX_GAMMA``]."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float, np.integer, np.floating)) \
            or not np.isfinite(gamma) or int(gamma) != gamma or gamma < 1:
        raise ValueError(f"gamma (num_draft_tokens) must be an integer >= 1, got {gamma!r}")
    if gamma > MAX_GAMMA:
        raise ValueError(f"gamma (num_draft_tokens) must be <= {MAX_GAMMA} draft tokens per round, got {gamma!r}; "
                         f"use gamma={MAX_GAMMA} or less")


def check_rounds_per_chunk(rounds_per_chunk):
    if isinstance(rounds_per_chunk, bool) or int(rounds_per_chunk) != rounds_per_chunk or rounds_per_chunk < 1:
        raise ValueError(f"rounds_per_chunk must be an integer >= 1, got {rounds_per_chunk!r}")


def stop_ids_array(eos: list, stop_token_ids, batch: int, vocab: int) -> np.ndarray:
    """``[B, E]`` int32 ids that end each row (−1 = unused): ``eos`` plus the stop token ids
    (one list for all rows, or one list per row). E is a shape of the compiled programs, so it
    is padded to a multiple of ``STOP_IDS_BUCKET``: a request with a different number of stop
    ids reuses the programs of its bucket."""
    if stop_token_ids is None or len(stop_token_ids) == 0:
        per_row = [[] for _ in range(batch)]
    elif all(isinstance(x, (list, tuple, np.ndarray)) for x in stop_token_ids):
        if len(stop_token_ids) != batch:
            raise ValueError(f"got {len(stop_token_ids)} stop_token_ids lists for {batch} prompts; "
                             "pass one list for all prompts or one per prompt")
        per_row = [list(x) for x in stop_token_ids]
    else:
        per_row = [list(stop_token_ids)] * batch
    rows = [list(eos) + list(r) for r in per_row]
    for r in rows:
        for t in r:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab:
                raise ValueError(f"stop token id {t!r} is not an id of the model's vocabulary [0, {vocab})")
    out = np.full((batch, round_up(max(len(r) for r in rows), STOP_IDS_BUCKET)), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
