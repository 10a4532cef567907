"""The decode loop's data: the state it carries (:class:`DecodeState`, with its counters
:class:`Stats` and log-probabilities :class:`Logprobs`) and the static description of one compiled
program (:class:`Program`). The rounds that change the state are :mod:`specjax.runtime.loop`'s
(which re-exports these: ``from specjax.runtime.loop import DecodeState`` keeps working).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.core.drafting import Drafter, TreeShape, require_drafter
from specjax.core.sampling import SamplingParams
from specjax.models import llama
from specjax.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Stats:
    """Per-row counters (all int32 ``[B]`` unless noted), defined exactly:

    target_calls: target forward calls after prefill (verify calls and plain one-token steps).
    draft_calls: drafter ``propose`` calls: every round of a speculative decoder (the drafter
      runs each round, also when it proposes nothing and the round is a plain step); 0 for
      plain autoregressive decoding.
    drafted_tokens: draft tokens offered for checking (after the per-row cap near
      ``max_new_tokens``; 0 for a row with no n-gram match; a tree: its valid nodes).
    accepted_tokens: draft tokens accepted by the rejection test.
    checked_tokens: draft tokens the test examined: accepted ones plus the first rejected one
      (a tree: the accepted path, plus 1 when the round ended on a rejection).
    new_tokens: tokens committed after the prompt (EOS included, nothing after it).
    accept_hist: ``[B, γ+1]`` rounds by number of accepted draft tokens (a tree: ``[B, D+1]``).
    """

    target_calls: jax.Array
    draft_calls: jax.Array
    drafted_tokens: jax.Array
    accepted_tokens: jax.Array
    checked_tokens: jax.Array
    new_tokens: jax.Array
    accept_hist: jax.Array

    @classmethod
    def zeros(cls, batch: int, gamma: int) -> "Stats":
        z = jnp.zeros((batch,), jnp.int32)
        return cls(z, z, z, z, z, z, jnp.zeros((batch, gamma + 1), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the loop carries (a pytree). ``B`` batch, ``L`` buffer slots.

    tokens: ``[B, L]`` int32 committed tokens (slots ≥ lengths are stale).
    lengths: ``[B]`` int32 committed tokens per row (prompt + new).
    prompt_lengths, max_new: ``[B]`` int32.
    done: ``[B]`` bool; a finished row stops changing.
    eos: ``[B, E]`` int32 stop ids per row (−1 = unused).
    keys: ``[B, 2]`` uint32 request keys; a row's j-th round draws with ``fold_in(key, j)``
      (``j = round - first_round``: a row's draws never depend on when it joined the batch).
    round: int32 scalar rounds run so far.
    first_round: ``[B]`` int32, the ``round`` at which each row started (0 for rows prefilled
      together; a row inserted into a running batch, :mod:`specjax.runtime.engine`, gets the
      batch's ``round`` then).
    speculate: ``[B]`` bool, rows whose drafts are verified; a row with ``False`` is offered no
      draft (every round commits one target token, drawn from p like a plain step).
    sampling: per-row sampling settings.
    seen: ``[B, V]`` bool, ids present in the prompt or the committed output (repetition penalty).
    counts: ``[B, V]`` int32, occurrences of each id in the committed output (presence and
      frequency penalties). Both are kept for every program (one program whether or not a row
      uses penalties; :func:`specjax.core.sampling.penalize` skips them when none does).
    target_cache, drafter_state: KV cache pytrees.
    target_hidden: ``[B, γ+1, F]`` hidden states (or fused features, :attr:`Program.feature_size`) of
      the last target call, or None.
    last_accepted: ``[B]`` int32 draft tokens accepted in the last round (n).
    stats: :class:`Stats`.
    emit_round: ``[B, L]`` int32, per committed slot, the round that committed it.
    emit_info: ``[B, L]`` int32, per committed slot: bit 0 = an accepted draft token;
      bit 1 = its round rejected a draft; bit 2 = its round was a plain one (the drafter did not
      run, :func:`specjax.runtime.loop._plain_round`); bits 3.. = draft tokens its round offered
      (accepted, rejected and offered counted only up to the row's first EOS).
      :func:`specjax.runtime.results.row_stats` derives every counter of a row from these two, also
      for a row cut short on the host (stop strings).
    logprobs: :class:`Logprobs` buffers, or ``None`` when not requested.
    """

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    max_new: jax.Array
    done: jax.Array
    eos: jax.Array
    keys: jax.Array
    round: jax.Array
    first_round: jax.Array
    speculate: jax.Array
    sampling: SamplingParams
    seen: jax.Array
    counts: jax.Array
    target_cache: llama.KVCache
    drafter_state: Any
    target_hidden: Any
    last_accepted: jax.Array
    stats: Stats
    emit_round: jax.Array
    emit_info: jax.Array
    logprobs: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of committed tokens (a pytree; slot-aligned with ``tokens``).

    token: ``[B, L]`` float32, ``log p(x_t)`` of the committed token in each slot.
    top_ids: ``[B, L, N]`` int32, the N most likely ids at that position (descending).
    top_logprobs: ``[B, L, N]`` float32, their log-probabilities.

    ``p`` is the target's processed distribution (logit bias, penalties, ``min_tokens``, then
    temperature, top-k, top-p, min-p: what the token was sampled from, exactly as in
    :func:`specjax.core.sampling.penalize` and :func:`~specjax.core.sampling.process_logits`;
    filtered ids have ``-inf``); for a greedy row (temperature 0), whose processed distribution
    is one-hot, ``log_softmax`` of the penalized logits (the logit bias, penalties and
    ``min_tokens`` mask applied; no temperature or filters) instead. In a speculative
    round every emitted position's ``p`` comes from the one verify call, so autoregressive
    and speculative decoding report the same values (up to float32 kernel rounding).
    """

    token: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array

    @classmethod
    def zeros(cls, batch: int, length: int, top: int) -> "Logprobs":
        return cls(jnp.zeros((batch, length), jnp.float32), jnp.zeros((batch, length, top), jnp.int32),
                   jnp.zeros((batch, length, top), jnp.float32))


@dataclasses.dataclass(frozen=True)
class Program:
    """Static description of one compiled decode program (hashable).

    ``tree``: ``None`` (chains of γ drafts: the program of every decoder without a tree) or the
    :class:`~specjax.core.drafting.TreeShape` of draft trees
    (:func:`specjax.runtime.loop._tree_round`); then ``gamma`` is the tree's depth D (at most D
    drafts are accepted per round, and every ``[B, γ+1, ·]`` array of the state is ``[B, D+1, ·]``)."""

    cfg: ModelConfig
    graphdef: Any
    drafter: Drafter | None  # None for plain autoregressive decoding
    gamma: int
    buffer_len: int
    cache_dtype: str = "float32"
    logprobs: int = -1  # top alternatives recorded per token; -1 = no log-probabilities
    tree: TreeShape | None = None
    # the target attends over the first kv_view cache slots (None: all); see specjax.runtime.loop.run_rounds
    kv_view: int | None = None
    plain: bool = False  # every round a one-token target call, the drafter idle (loop._plain_round)

    def __post_init__(self):
        require_drafter(self.drafter)
        if self.tree is not None and (self.drafter is None or self.gamma != self.tree.depth):
            raise ValueError(f"a tree program needs a drafter and gamma = the tree's depth {self.tree.depth}, "
                             f"got drafter {self.drafter!r}, gamma {self.gamma}")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target blocks the drafter reads (its ``feature_layers``; ``()``: the final hidden state)."""
        return tuple(self.drafter.feature_layers) if self.drafter is not None else ()

    @property
    def raw_features(self) -> bool:
        """Whether the drafter reads its blocks' outputs unnormalized (its ``raw_features``)."""
        return bool(self.drafter.raw_features) if self.drafter is not None else False

    @property
    def feature_args(self) -> dict:
        """The target call's feature arguments (``llama.apply(..., **prog.feature_args)``)."""
        return {"feature_layers": self.feature_layers, "raw_features": self.raw_features}

    @property
    def feature_size(self) -> int:
        """Width of ``target_hidden``: the final hidden state, or the fused features."""
        return self.cfg.hidden_size * max(1, len(self.feature_layers))

    @property
    def block(self) -> int:
        """Tokens one round may commit: γ + 1 with a drafter (a tree: D + 1), else 1."""
        return self.gamma + 1 if self.drafter is not None else 1

    @property
    def round_span(self) -> int:
        """Target cache slots a round's target call writes and reads beyond the committed tokens,
        counting the last committed one: N + 1 with a tree, else :attr:`block`. A round of a row
        of length ``n`` attends over slots ``< n - 1 + round_span``."""
        return self.tree.nodes + 1 if self.tree is not None else self.block


def tree_scratch(shape: TreeShape) -> int:
    """Slots a tree round writes beyond the root (the last committed token): the target call's
    N nodes, and a drafter's forest calls (:meth:`specjax.drafters.eagle.EagleDrafter.propose_tree`:
    K paths of up to D − 1 nodes). Buffers keep this many + 1 spare slots."""
    return max(shape.nodes, shape.topk * (shape.depth - 1))
