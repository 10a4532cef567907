"""The drafter protocol: what the speculative decode loop needs from any drafter.

A drafter is a *static* (hashable) object — it becomes part of the compiled
program — plus two pytrees the loop carries as arguments: ``params`` (weights, or
``None``) and a ``state`` (e.g. its own KV cache). Every drafter subclasses :class:`Drafter`
and declares there what the loop, measurement and training need (the target features it reads,
whether it proposes trees, its cost shape, …). The kinds a ``--draft`` value names (a separate
draft model, n-gram prompt lookup, EAGLE feature drafters) are declared in
:mod:`specjax.drafters.registry`.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, NamedTuple

import jax
from jaxtyping import Array, Float, Int

from specjax.core.sampling import SamplingParams

# Upper bounds of the static decode shapes, checked before anything loads (the CLI, ``Decoder``,
# ``NgramDrafter``, :class:`TreeShape`): every round's programs, buffers and tree masks grow with
# them, and they leave room for accelerators (a target call verifies at most 513 tokens).
MAX_GAMMA = 64  # γ, draft tokens per round of a chain (--gamma)
MAX_NEW_TOKENS = 2 ** 31 - 1  # new tokens per row: int32 counters (the context caps a row far below)
MAX_NGRAM = 16  # N of the n-gram drafter (--draft ngram:N)
MAX_TREE_NODES = 512  # N, nodes per draft tree (--tree-nodes)
MAX_TREE_DEPTH = 64  # D, the deepest tree node (--tree-depth; a tree's γ)
MAX_TREE_TOPK = 32  # K, children per tree node (--tree-topk)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What a drafter may read each round (a pytree).

    Attributes:
      tokens: ``[B, L]`` int32 committed token buffer (prompt + generated); slots at
        or beyond ``lengths`` are stale and must be ignored.
      lengths: ``[B]`` int32 committed tokens per row (≥ 1).
      sampling: per-row sampling settings; a drafter must make q with
        ``sampling.process`` (the same processor that makes the target's p).
      target_hidden: ``[B, γ+1, F]`` float32 final hidden states (after the final norm, F = D),
        or for a drafter whose ``feature_layers`` names target blocks the fused block outputs
        (:func:`specjax.models.llama.target_features`, F = len·D), of the target's last call, whose inputs were ``[last committed, x_1..x_γ]`` at
        positions ``lengths_before-1 ..``; index ``last_accepted`` holds the state at
        position ``lengths-2`` (the input before the last committed token). In
        ``init_state`` it is the prompt's hidden states ``[B, P, D]`` (positions 0..P-1).
        All zeros before the first round.
      last_accepted: ``[B]`` int32, n of the last round (0 before the first round and
        after a plain one-token step).
    """

    tokens: Int[Array, "batch buf"]
    lengths: Int[Array, "batch"]
    sampling: SamplingParams
    target_hidden: Float[Array, "batch block hidden"] | None = None
    last_accepted: Int[Array, "batch"] | None = None


class Proposal(NamedTuple):
    """A drafter's output for one round.

    tokens: ``[B, γ]`` int32 draft ids x_1..x_γ (all < the target vocab).
    probs: ``[B, γ, V]`` float32, q_i: exactly the distribution x_i was sampled from
      (one-hot for deterministic drafters), over the TARGET vocabulary.
    num_valid: ``[B]`` int32 in [0, γ]: how many leading drafts may be accepted
      (0 = no proposal: the round is a plain target step for that row).
    state: the drafter's updated state.
    """

    tokens: Int[Array, "batch gamma"]
    probs: Float[Array, "batch gamma vocab"]
    num_valid: Int[Array, "batch"]
    state: Any


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """The static shape of the draft trees of a decode program (hashable; part of the program).

    nodes: N, draft nodes per round and row (the target call verifies ``N + 1`` tokens: the
      last committed token, then the nodes).
    depth: D, the deepest node (at most D drafts are accepted per round; D plays γ's role).
    topk: K, at most K children per node (the root included).

    ``1 <= D <= N <= K + (D − 1)·K²`` (the last bound: the candidates of EAGLE-2's dynamic tree
    expanding K nodes per level, :func:`specjax.core.tree.build_dynamic_tree`). K = 1 forces
    N = D: a chain of γ = D drafts. And N ≤ ``MAX_TREE_NODES`` (512), D ≤ ``MAX_TREE_DEPTH`` (64),
    K ≤ ``MAX_TREE_TOPK`` (32).

    Raises ValueError (on construction) for sizes outside these ranges.
    """

    nodes: int
    depth: int
    topk: int

    def __post_init__(self):
        for name in ("nodes", "depth", "topk"):
            v = getattr(self, name)
            try:
                iv = operator.index(v)  # int or numpy integer, not a float or bool
            except TypeError:
                iv = None
            if iv is None or isinstance(v, bool) or iv < 1:
                raise ValueError(f"tree {name} must be an integer >= 1, got {v!r} (e.g. --tree-nodes 8 "
                                 "--tree-depth 4 --tree-topk 2)")
            object.__setattr__(self, name, int(iv))
        for name, limit in (("nodes", MAX_TREE_NODES), ("depth", MAX_TREE_DEPTH), ("topk", MAX_TREE_TOPK)):
            v = getattr(self, name)
            if v > limit:
                raise ValueError(f"tree {name} must be <= {limit} (the largest tree a round verifies), got {v}; "
                                 f"lower --tree-{name} to at most {limit}")
        n, d, k = self.nodes, self.depth, self.topk
        if d > n:
            raise ValueError(f"tree depth ({d}) must be <= tree nodes ({n}): a path of depth D holds D nodes; "
                             f"raise --tree-nodes to at least {d} or lower --tree-depth")
        if k > n:
            raise ValueError(f"tree topk ({k}) must be <= tree nodes ({n}): a node has at most N children; "
                             f"lower --tree-topk to at most {n} or raise --tree-nodes")
        if n > self.max_nodes(d, k):
            raise ValueError(f"tree nodes ({n}) must be <= K + (D-1)·K² = {self.max_nodes(d, k)} for depth {d} and "
                             f"topk {k} (the candidates of a dynamic tree); lower --tree-nodes or raise "
                             "--tree-depth/--tree-topk")

    @staticmethod
    def max_nodes(depth: int, topk: int) -> int:
        """The most nodes a tree of this depth and top-k may have: ``K + (D − 1)·K²``."""
        return topk + (depth - 1) * topk * topk

    @property
    def label(self) -> str:
        """``"tree(N8,D4,K2)"``: how progress lines, tables and JSON name the shape."""
        return f"tree(N{self.nodes},D{self.depth},K{self.topk})"


class TreeProposal(NamedTuple):
    """A drafter's tree for one round (:meth:`Drafter.propose_tree`).

    tree: a :class:`specjax.core.tree.DraftTree` ``[B, N]`` with ``max_depth = D`` and
      ``max_children = K`` of the program's :class:`TreeShape` (invalid nodes: never accepted;
      their ``parents``/``depth`` must still describe a tree, e.g. ``-1`` / ``1``), and
      ``draft_probs [B, N+1, V]`` when ``scheme`` needs them (``None`` for ``"deterministic"``).
    scheme: how the children were drawn, one of :data:`specjax.core.tree.SCHEMES` (a Python
      string, static): it selects the exact acceptance rule (:func:`specjax.core.tree.verify_tree`).
    state: the drafter's updated state.
    """

    tree: Any
    scheme: str
    state: Any


class CausalModel(NamedTuple):
    """What a drafter that IS a whole causal language model over the target vocabulary (a draft
    model) declares as :attr:`Drafter.causal_model`: its NNX ``graphdef``, its ``config`` (a
    :class:`~specjax.models.config.ModelConfig`) and its KV-cache dtype. Its ``params`` are that
    model's parameters and its state that model's ``KVCache``, so sharding places them by the
    config's rules; q at every position is the model's next-token distribution there, so
    measurement teacher-forces it in one forward (:func:`specjax.eval.measure.measure_alpha`)."""

    graphdef: Any
    config: Any
    cache_dtype: Any


class Drafter:
    """The drafter protocol, as a base class: every drafter subclasses it and declares what the
    loop, measurement and training need; the defaults below are those of a chain drafter that
    reads the target's final hidden state (or nothing) and may propose nothing.

    A drafter is static (hashable: it keys compiled programs) — subclass it with a frozen
    dataclass, or define ``__hash__``/``__eq__`` — plus two pytrees the loop carries as
    arguments: ``params`` and the state of :meth:`init_state`. This class adds no field, no
    ``__hash__`` and no ``__eq__``: a subclass hashes and compares as it defines.

    Attributes (class attributes or properties of a subclass):
      name: short label for stats and tables.
      params: weight pytree passed to the jitted loop as an argument (or ``None``).
      feature_layers: the target blocks whose fused outputs it reads as ``context.target_hidden``
        (:func:`specjax.models.llama.target_features`, width ``len·D``); ``()``: the target's final
        hidden state (width D), which a drafter may also ignore.
      raw_features: ``True``: the blocks of ``feature_layers`` are handed over RAW (the residual
        streams as they are, concatenated) instead of each scaled to unit RMS (published EAGLE-3
        heads were trained on raw streams, :mod:`specjax.drafters.eagle3_head`); ``False`` (default).
      proposes_trees: ``True``: it implements :meth:`propose_tree` for any top-k; ``False``: chains
        only (a tree of top-k 1 is decoded with its chain, :meth:`propose` with γ = D).
      always_proposes: it drafts in every round: a chain's ``num_valid`` is always γ, a tree has
        at least one valid node in every row (a draft model, the block drafter, an EAGLE drafter
        without a confidence cut-off; ``False`` for the n-gram drafter: no match, no drafts). The
        decode loop then compiles only the verification call (γ+1 tokens, or the tree call); a
        round where no row may accept a draft (near ``max_new_tokens``, rows done or not
        speculating) verifies with ``num_allowed = 0``, which is a plain step's distribution.
        ``False`` (the default): the loop also compiles a one-token target step and runs it
        instead (``lax.cond``) in rounds where no row has a draft (n-gram misses), so such a round
        costs a plain step rather than a verification, at the price of a second target program
        in the compile.
      context_limit: the most positions its own state holds (e.g. a draft model's context), or
        ``None`` (no limit of its own); a row holds at most the smaller of the target's and this.
      causal_model: a :class:`CausalModel` when the drafter is a whole causal LM over the target
        vocabulary (a draft model), else ``None``.

    Cost shape and scratch: :meth:`chain_passes`, :meth:`tree_passes`, :meth:`scratch_slots`.
    """

    name: str
    params: Any
    feature_layers: tuple[int, ...] = ()
    raw_features: bool = False
    proposes_trees: bool = False
    always_proposes: bool = False
    context_limit: int | None = None
    causal_model: CausalModel | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        has_tree = cls.propose_tree is not Drafter.propose_tree
        if isinstance(cls.proposes_trees, bool) and cls.proposes_trees != has_tree:
            raise TypeError(f"drafter class {cls.__qualname__}: proposes_trees = {cls.proposes_trees} but it "
                            f"{'defines' if has_tree else 'does not define'} propose_tree; declare "
                            f"proposes_trees = {has_tree}")

    # ---- cost shape: the drafter's forward passes per round (0: no model pass, e.g. a lookup)
    def chain_passes(self, gamma: int) -> int:
        """Drafter forward passes in one round of a chain of γ drafts. Default γ: one pass per
        draft (an autoregressive drafter)."""
        return gamma

    def tree_passes(self, shape: TreeShape) -> int:
        """Drafter forward passes in one round of a tree of ``shape``. Default: its chain of γ = D
        (what a chain drafter runs for a tree of top-k 1)."""
        return self.chain_passes(shape.depth)

    def scratch_slots(self, gamma: int, tree: TreeShape | None = None) -> int:
        """Slots beyond the last committed token that one round may write in the drafter's own
        state (a chain of γ drafts, or a tree of shape ``tree`` with γ = its depth). The buffers
        keep the larger of this and what the target's call writes (γ; a tree:
        :func:`specjax.runtime.loop.tree_scratch`), + 1 spare slot. Default γ."""
        return gamma

    # ---- the traced calls
    def init_state(self, params, context: DraftContext, max_len: int) -> Any:
        """The drafter's state after the prompt (a pytree the loop carries), traced inside the
        jitted prefill.

        Args:
          params: the drafter's weight pytree (``self.params`` as passed to the loop) or ``None``.
          context: the prompt: ``tokens [B, L]`` int32, ``lengths [B]`` int32 prompt lengths,
            ``sampling``, and ``target_hidden [B, P, F]`` float32 (the target's final hidden
            states of the prompt, or its fused features, for feature-level drafters).
          max_len: L, the buffer slots a KV cache of the drafter must hold (static int).

        Returns:
          any pytree of arrays with shapes fixed by (B, L) — e.g. a KV cache of the prompt — or
          ``()`` for a stateless drafter.
        """
        raise NotImplementedError(f"{type(self).__qualname__} must define init_state")

    def absorb(self, params, state, context: DraftContext) -> Any:
        """The drafter's state before a plain round (a one-token target call with no drafts, the
        serving engine's rounds when no row speculates), which replaces ``context.target_hidden``
        (as for :meth:`propose`) without a drafter call: keep what later rounds need of it.
        Default: ``state`` unchanged (a drafter that reads the committed tokens only, or one that
        accepts lower acceptance after plain rounds). Never changes what is sampled."""
        return state

    def propose(self, params, state, context: DraftContext, keys, gamma: int, vocab_size: int) -> Proposal:
        """Propose γ draft tokens per row, traced inside the jitted loop (one call per round).

        Args:
          params, state: as from :meth:`init_state` (and the previous round's ``Proposal.state``).
          context: the committed tokens ``[B, L]``, ``lengths [B]``, ``sampling``, the target's
            last-call hidden states ``[B, γ+1, D]`` float32 and ``last_accepted [B]`` int32.
          keys: ``[B, γ, 2]`` uint32 PRNG keys, one per row and draft position (a sampling
            drafter draws x_i with ``keys[:, i]``).
          gamma: γ (static int). vocab_size: the target's vocabulary size V (static int).

        Returns:
          a :class:`Proposal`: ``tokens [B, γ]`` int32, ``probs [B, γ, V]`` float32 (q_i, exactly
          the distribution x_i was drawn from, made with ``context.sampling.process``),
          ``num_valid [B]`` int32 in [0, γ], and the new state.
        """
        raise NotImplementedError(f"{type(self).__qualname__} proposes trees only (no propose)")

    def propose_tree(self, params, state, context: DraftContext, keys, shape: TreeShape,
                     vocab_size: int) -> TreeProposal:
        """Propose a draft tree of ``shape`` per row, traced inside the jitted loop (one call per
        round); defined exactly by the drafters that declare ``proposes_trees = True``.

        Args:
          params, state: as for :meth:`propose`.
          context: as for :meth:`propose`, except that ``target_hidden`` is ``[B, D+1, D_h]``: the
            target's hidden states at the root and the accepted path of the last round (index
            ``last_accepted`` holds the state at position ``lengths-2``, as for a chain).
          keys: ``[B, N, 2]`` uint32 PRNG keys, one per row and node (a sampling drafter draws
            node i with ``keys[:, i]``; a chain of K = 1 gets the keys :meth:`propose` gets).
          shape: the program's :class:`TreeShape` (static). vocab_size: the target's V (static).

        Returns:
          a :class:`TreeProposal`; node tokens must be ``< vocab_size``. With K = 1 a drafter
          should propose its chain (then tree decoding equals chain decoding with γ = D).
        """
        raise NotImplementedError(f"{type(self).__qualname__} proposes chains only (no propose_tree)")


def row_context(target_context: int, drafter) -> int:
    """The tokens a row may hold: ``target_context`` (the target's), or the drafter's own
    :attr:`Drafter.context_limit` when it is shorter."""
    own = drafter.context_limit if drafter is not None else None
    return target_context if own is None else min(target_context, int(own))


def require_drafter(drafter) -> None:
    """Raises TypeError unless ``drafter`` is ``None`` or a :class:`Drafter` (whose declarations
    the loop reads)."""
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"drafter {drafter!r} must subclass specjax.core.drafting.Drafter (it declares what the "
                        "decode loop needs: feature_layers, proposes_trees, always_proposes, …)")
