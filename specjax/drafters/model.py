"""A separate draft model (any Llama-family checkpoint sharing the target's tokenizer)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.models.config import CheckpointError
from specjax.core.drafting import CausalModel, DraftContext, Drafter, Proposal, TreeShape
from specjax.models import llama
from specjax.core.sampling import sample


def check_vocab_compatible(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a drafter whose tokenizer differs from the target's.

    Ids present in both tokenizers must map to the same token strings; a drafter
    vocabulary longer than the target's is allowed only where the extra rows are
    padding (no token string behind them).

    Without a tokenizer on either side the vocabulary sizes must be equal.

    Raises:
      CheckpointError: naming the first id that differs, the real tokens beyond the target's
        vocab, or (a side without a tokenizer) both vocabulary sizes.
    """
    if target_tok is None or draft_tok is None:
        if target_vocab != draft_vocab:  # nothing to compare ids with: the sizes must agree
            which = "the drafter" if draft_tok is None else "the target"
            raise CheckpointError(
                f"the drafter's vocabulary has {draft_vocab} tokens but the target's has {target_vocab}, and "
                f"{which} has no tokenizer to check that they share token ids; use a drafter with the "
                "target's vocabulary (and its tokenizer.json), or --draft ngram"
            )
        return
    tv = {i: t for t, i in target_tok.vocab().items()}
    dv = {i: t for t, i in draft_tok.vocab().items()}
    for i in sorted(set(tv) & set(dv)):
        if tv[i] != dv[i]:
            raise CheckpointError(
                f"the drafter's tokenizer differs from the target's (id {i}: {dv[i]!r} vs {tv[i]!r}); "
                "a draft model must share the target's tokenizer — use --draft ngram or a drafter trained "
                "for this target (specjax distill)"
            )
    extra = sorted(i for i in dv if i >= target_vocab)
    if extra:
        raise CheckpointError(
            f"the drafter's vocabulary has {len(extra)} real token(s) beyond the target's {target_vocab} "
            f"(first: id {extra[0]} = {dv[extra[0]]!r}); they could be proposed but never emitted by the "
            "target — use a drafter with the target's tokenizer"
        )
    missing = sorted(i for i in tv if i not in dv and i < draft_vocab)
    if missing:
        raise CheckpointError(f"the drafter's tokenizer lacks target token id {missing[0]} ({tv[missing[0]]!r})")


def fit_vocab(logits, vocab_size: int):
    """Drafter logits ``[..., V_d]`` → ``[..., V]`` over the target vocab: padded drafter
    rows beyond V are dropped; missing rows get ``-inf`` (probability 0)."""
    vd = logits.shape[-1]
    if vd == vocab_size:
        return logits
    if vd > vocab_size:
        return logits[..., :vocab_size]
    pad = [(0, 0)] * (logits.ndim - 1) + [(0, vocab_size - vd)]
    return jnp.pad(logits, pad, constant_values=-jnp.inf)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDrafter(Drafter):
    """Draft with a small autoregressive model.

    Each round starts by feeding the drafter the last two committed tokens at their
    positions (re-writing an existing KV entry is harmless): that brings it up to
    date after a fully accepted round (x_γ and the bonus token were never fed) and
    yields q_1; then γ − 1 one-token steps (``lax.scan``). A one-token context
    feeds positions 0 and 1 (slot 1 is stale and overwritten by x_1).
    """

    config: Any
    graphdef: Any
    params: Any = dataclasses.field(repr=False, default=None)
    name: str = "draft"
    cache_dtype: Any = jnp.float32
    # its declarations (specjax.core.drafting.Drafter)
    feature_layers = ()  # reads only the committed tokens
    proposes_trees = False  # chains only (a tree of top-k 1: its chain)
    always_proposes = True  # γ drafts every round

    @property
    def context_limit(self) -> int:
        """Its own context (its KV cache holds the row)."""
        return self.config.max_position_embeddings

    @property
    def causal_model(self) -> CausalModel:
        """A whole causal LM over the target vocabulary (sharded by its config; teacher-forced in
        measurement)."""
        return CausalModel(self.graphdef, self.config, self.cache_dtype)

    def chain_passes(self, gamma: int) -> int:
        """γ: the call over the last two committed tokens (q_1), then γ − 1 one-token steps."""
        return gamma

    def tree_passes(self, shape: TreeShape) -> int:
        """Its chain of γ = D (trees of top-k 1 only)."""
        return shape.depth

    def scratch_slots(self, gamma: int, tree: TreeShape | None = None) -> int:
        """γ − 1: the steps write x_1..x_{γ−1} after the last committed token."""
        return max(gamma - 1, 0)

    def _key(self):
        return (self.config, self.graphdef, self.name, jnp.dtype(self.cache_dtype).name)

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, ModelDrafter) and self._key() == other._key()

    @classmethod
    def from_model(cls, model, name: str | None = None) -> "ModelDrafter":
        from specjax.models.llama import kv_cache_dtype

        return cls(model.config, model.graphdef, model.params, name or model.name or "draft",
                   cache_dtype=jnp.dtype(kv_cache_dtype(model.dtype)))

    def _ids(self, tokens):
        """Committed ids the drafter's vocabulary lacks (a drafter vocab smaller than the
        target's) are fed as id 0: an embedding lookup out of range gives NaN, which would
        poison the drafter's KV cache (q = NaN ever after). The proposal is then only less
        likely to be accepted; the output is the target's either way."""
        return jnp.where(tokens < self.config.vocab_size, tokens, 0)

    def init_state(self, params, context: DraftContext, max_len: int):
        b, s = context.tokens.shape
        cache = llama.KVCache.create(self.config, b, max_len, self.cache_dtype)
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        _, cache = llama.forward(self.graphdef, params, self._ids(context.tokens), pos, cache, self.config)
        return cache

    def propose(self, params, state, context: DraftContext, keys, gamma: int, vocab_size: int) -> Proposal:
        cfg = self.config
        lengths = context.lengths
        start = jnp.maximum(lengths - 2, 0)
        pos2 = start[:, None] + jnp.arange(2, dtype=jnp.int32)
        toks2 = self._ids(jnp.take_along_axis(context.tokens, pos2, axis=1))
        out = llama.apply(self.graphdef, params, toks2, pos2, state, cfg)
        last = (lengths - 1 - start)[:, None, None]
        logits = jnp.take_along_axis(out.logits, last, axis=1)[:, 0]

        def draw(logits, key_col):
            probs = context.sampling.process(fit_vocab(logits, vocab_size))
            tok = jax.vmap(sample)(key_col, probs)
            return tok, probs

        x1, q1 = draw(logits, keys[:, 0])

        def step(carry, inp):
            tok, cache = carry
            i, key_col = inp
            pos = (lengths - 1 + i)[:, None]
            o = llama.apply(self.graphdef, params, tok[:, None], pos, cache, cfg)
            nxt, probs = draw(o.logits[:, 0], key_col)
            return (nxt, o.cache), (nxt, probs)

        cache = out.cache
        if gamma > 1:
            idx = jnp.arange(1, gamma, dtype=jnp.int32)
            (_, cache), (toks, probs) = jax.lax.scan(step, (x1, cache), (idx, jnp.swapaxes(keys[:, 1:], 0, 1)))
            tokens = jnp.concatenate([x1[:, None], jnp.swapaxes(toks, 0, 1)], axis=1)
            q = jnp.concatenate([q1[:, None], jnp.swapaxes(probs, 0, 1)], axis=1)
        else:
            tokens, q = x1[:, None], q1[:, None]
        num_valid = jnp.full(lengths.shape, gamma, jnp.int32)
        return Proposal(tokens.astype(jnp.int32), q, num_valid, cache)
