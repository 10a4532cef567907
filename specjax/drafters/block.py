"""The block drafter (DFlash-style parallel drafting, Chen et al. 2026, arXiv 2602.06036): ONE
drafter pass per round gives q_1..q_γ for a whole block of drafts (the network:
:mod:`specjax.drafters.block_net`), chains and trees, at any temperature.

Decode-loop protocol (:mod:`specjax.core.drafting`). Let L = committed length, n =
last_accepted, L0 = L − n − 1. Each round:

1. the context K/V of the last target call's fused features ``target_hidden[:, j]`` (position
   L0 − 1 + j; the valid ones reach L − 2) are written at their positions (the stale ones past
   L − 2 are never read and are overwritten by a later round before they are);
2. one block call: the anchor (the last committed token, position L − 1) and γ mask slots,
   attending to the context at positions < L − 1 and to the whole block; slot i gives q_i, the
   drafter's distribution of the token at position L − 1 + i (the i-th draft).

The prefill writes the prompt's context (positions 0 .. P − 1); the first round writes nothing
(there is no target call yet: ``fresh``). With ``anchor_feature`` the state also keeps ``prev``, the
context vector at position L − 2 that the anchor's input reads: the prefill's (position P − 2, used
while L is still P), else that of ``target_hidden[:, n]`` (also after the serving engine's plain
rounds, which leave the drafter's state as it was but ``target_hidden`` at index 0 = L − 2).

**Exactness at T > 0** (a chain). The drafts are x_i ~ q_i, each with its own PRNG key
(``keys[:, i]``: no noise shared across block positions), and ``Proposal.probs[:, i]`` is exactly
that q_i (made once by ``sampling.process`` from the one pass; no later pass re-samples a
position given another's sample), and the draft keys are independent of the acceptance keys.
Then, given the context and x_1..x_{i−1}, x_i is distributed as q_i (q_i does not depend on
x_{<i}, and x_i's noise is independent of theirs), which is all the proof of Leviathan et al.
(2023, appendix A.1) uses at position i: accepting x_i with probability min(1, p_i(x_i)/q_i(x_i))
and otherwise drawing from norm(max(0, p_i − q_i)) emits a token distributed as p_i. So the
output is distributed exactly as the target's, position by position. Greedy: x_i = argmax q_i.

**Trees from one pass** (:meth:`BlockDrafter.propose_tree`): the candidates at depth i are the
top-K of the drafter's temperature-1 distribution at slot i (the same for every parent: the slots
are conditionally independent), paths ranked by the product of these marginals, the N best kept
(:func:`specjax.core.tree.build_dynamic_tree`). The children are a deterministic function of the
context, so the tree is verified with the ``"deterministic"`` scheme (accept child c with
probability p(c), else remove it and renormalize, next sibling), which is exact; using q in the
ratio would not be (:mod:`specjax.core.tree`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.drafting import DraftContext, Drafter, Proposal, TreeProposal, TreeShape
from specjax.core.dynamic_tree import build_dynamic_tree
from specjax.core.sampling import sample
from specjax.drafters import block_net
from specjax.drafters.block_net import BlockConfig
from specjax.drafters.eagle_files import check_trained_for, target_fingerprint
from specjax.drafters.eagle_net import full_logits
from specjax.drafters.eagle_params import block_weights, frozen_params
from specjax.models import weights

MARKER = "block_drafter.json"  # the file that marks a block drafter's directory


@dataclasses.dataclass(frozen=True, eq=False)
class BlockDrafter(Drafter):
    """A block (parallel) drafter (static part; ``params`` = ``{"train", "frozen"}``): one pass per
    round drafts the whole block (module docstring: protocol and exactness)."""

    config: BlockConfig
    params: Any = dataclasses.field(repr=False, default=None)
    name: str = "block"

    proposes_trees = True
    always_proposes = True

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.feature_layers)

    @property
    def context_limit(self) -> int:
        return self.config.max_position_embeddings

    def chain_passes(self, gamma: int) -> int:
        """One pass per round, whatever γ (the cost model c_block(γ), not γ·c)."""
        return 1

    def tree_passes(self, shape: TreeShape) -> int:
        """One pass per round: every depth's candidates come from the same block call."""
        return 1

    def scratch_slots(self, gamma: int, tree: TreeShape | None = None) -> int:
        """The context write reaches slot L − 1 + γ (a tree: + D)."""
        return gamma if tree is None else tree.depth

    def _key(self):
        return (self.config, self.name)

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, BlockDrafter) and self._key() == other._key()

    def init_state(self, params, context: DraftContext, max_len: int):
        b = context.tokens.shape[0]
        cache = block_net.new_cache(self.config, b, max_len)
        cache = block_net.write_context(self.config, params["train"], cache, context.target_hidden,
                                        jnp.zeros((b,), jnp.int32))
        state = {"cache": cache, "fresh": jnp.ones((b,), bool)}
        if self.config.anchor_feature:  # c at P − 2 (zeros for a one-token prompt: no position before)
            idx = jnp.maximum(context.lengths - 2, 0)
            h = jnp.take_along_axis(context.target_hidden, idx[:, None, None], axis=1)[:, 0]
            prev = block_net.context(self.config, params["train"], h)
            state["prev"] = jnp.where((context.lengths >= 2)[:, None], prev, 0.0)
            state["prev_len"] = context.lengths  # the L at which ``prev`` is c_{L−2}
        return state

    def block_logits(self, params, state, context: DraftContext, gamma: int):
        """Steps 1 and 2 of a round (the drafter's one pass, before anything is drawn): ``(logits
        [B, γ, V] float32 over the target vocabulary, one row per block slot, new state)``;
        :meth:`propose` and :meth:`propose_tree` draw from / rank these."""
        lengths = context.lengths
        n = context.last_accepted
        fresh = state["fresh"]
        # the first round has no target call yet: its (zero) features go to the anchor's slot and
        # beyond, which are never read before a later round rewrites them
        start = jnp.where(fresh, lengths - 1, lengths - n - 2)
        cache = block_net.write_context(self.config, params["train"], state["cache"], context.target_hidden, start)
        anchor = jnp.take_along_axis(context.tokens, (lengths - 1)[:, None], axis=1)[:, 0]
        new = {"cache": cache, "fresh": jnp.zeros_like(fresh)}
        prev = None
        if self.config.anchor_feature:  # c at L − 2: the prefill's before any target call, else target_hidden[:, n]
            h = jnp.take_along_axis(context.target_hidden, n[:, None, None], axis=1)[:, 0]
            first = fresh & (lengths == state["prev_len"])
            prev = jnp.where(first[:, None], state["prev"], block_net.context(self.config, params["train"], h))
            new.update(prev=prev, prev_len=lengths)
        f = block_net.block_forward(self.config, params, cache, anchor, lengths - 1, gamma, prev)  # [B, γ, D]
        logits = full_logits(params, f, self._vocab)
        return logits, new

    @property
    def _vocab(self) -> int:
        return self.config.layer.vocab_size

    def propose(self, params, state, context: DraftContext, keys, gamma: int, vocab_size: int) -> Proposal:
        logits, state = self.block_logits(params, state, context, gamma)
        q = context.sampling.process(logits)  # [B, γ, V]: q_i, exactly what x_i is drawn from
        tokens = jax.vmap(jax.vmap(sample))(keys, q)  # x_i with its own key keys[:, i]
        b = tokens.shape[0]
        return Proposal(tokens.astype(jnp.int32), q, jnp.full((b,), gamma, jnp.int32), state)

    def propose_tree(self, params, state, context: DraftContext, keys, shape: TreeShape,
                     vocab_size: int) -> TreeProposal:
        """The block's per-slot top-K as a tree (module docstring), ``"deterministic"`` scheme. With
        K = 1 it is the greedy chain (each slot's argmax)."""
        logits, state = self.block_logits(params, state, context, shape.depth)
        ranks = jax.nn.softmax(logits, axis=-1)  # [B, D, V]: the temperature-1 marginals that rank paths
        k = shape.topk

        def expand(level, frontier, pool):
            return jnp.broadcast_to(ranks[:, level][:, None], (frontier.shape[0], frontier.shape[1], ranks.shape[-1]))

        tree, _ = build_dynamic_tree(ranks[:, 0], expand, depth=shape.depth, children=k, expand_width=k,
                                     num_nodes=shape.nodes)
        return TreeProposal(tree, "deterministic", state)


# --------------------------------------------------------------------------- files
def flat_trainable(tp: dict, cfg: BlockConfig) -> dict[str, np.ndarray]:
    """``{file name: array}``: ``fuse``, ``hidden_norm``, ``mask_embed``, ``out_norm``, ``anchor_proj``
    (``anchor_feature`` drafters) and per layer ``layers.{i}.{part}`` (a fused weight as its
    checkpoint parts, ``wq``, ``wk``, …)."""
    out = {k: tp[k] for k in ("fuse", "hidden_norm", "mask_embed", "out_norm", "anchor_proj") if k in tp}
    for i, layer in enumerate(tp["layers"]):
        for spec in block_weights():
            for t, a in weights.split(spec, cfg.layer, np.asarray(layer[spec.name])):
                out[f"layers.{i}.{t.name}"] = a
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in out.items()}


def unflat_trainable(flat: dict, cfg: BlockConfig) -> dict:
    """The inverse of :func:`flat_trainable`."""
    f32 = lambda a: jnp.asarray(np.asarray(a, np.float32))  # noqa: E731
    layers = []
    for i in range(cfg.num_layers):
        layer = {}
        for spec in block_weights():
            parts = [f32(flat[f"layers.{i}.{t.name}"]) for t in spec.tensors()]
            layer[spec.name] = weights.fuse(spec, cfg.layer, parts) if spec.parts else parts[0]
        layers.append(layer)
    tp = {k: f32(flat[k]) for k in ("fuse", "hidden_norm", "mask_embed", "out_norm")}
    tp["layers"] = layers
    if cfg.anchor_feature:
        tp["anchor_proj"] = f32(flat["anchor_proj"])  # a KeyError: the file lacks it (a CheckpointError)
    return tp


def save_drafter(path: str, cfg: BlockConfig, trainable: dict, sub_ids, target, extra: dict | None = None) -> None:
    """Write ``model.safetensors`` (trainable weights + ``sub_ids``) and :data:`MARKER` (config,
    target fingerprint, ``extra``) into the directory ``path``."""
    import os

    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = flat_trainable(trainable, cfg)
    tensors["sub_ids"] = np.asarray(sub_ids, np.int32)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "specjax-block"})
    meta = {"config": cfg.to_json(), "target_fingerprint": target_fingerprint(target), "target_name": target.name}
    meta.update(extra or {})
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump(meta, f, indent=2)


def make_drafter(cfg: BlockConfig, trainable: dict, target, sub_ids, dtype: str = "float32",
                 name: str = "block") -> BlockDrafter:
    """A :class:`BlockDrafter` of trainable parameters for ``target`` (the embedding and head rows of
    ``sub_ids`` taken from it), in the weight format ``dtype`` (float32, bfloat16: weights rounded,
    computed in float32; int8: :func:`block_net.quantize_params`)."""
    if dtype not in ("float32", "bfloat16", "int8"):
        raise ValueError(f"drafter dtype must be float32, bfloat16 or int8, got {dtype!r}")
    tp = trainable
    if dtype == "bfloat16":
        tp = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), tp)
    params = {"train": tp, "frozen": frozen_params(target, sub_ids)}
    if dtype == "int8":
        params = block_net.quantize_params(params)
    return BlockDrafter(cfg, params, name=name)


def load_drafter(path, target, dtype: str = "float32", name: str | None = None, check: bool = True) -> BlockDrafter:
    """Load a block drafter saved by :func:`save_drafter` for ``target``.

    Raises:
      CheckpointError: missing files, a config that does not fit the target, or a drafter trained
        for another target (fingerprint mismatch).
      ValueError: an unknown ``dtype``.
    """
    import os
    import pathlib

    from safetensors.numpy import load as st_load

    from specjax.models.config import CheckpointError

    p = pathlib.Path(path) if isinstance(path, str) else path
    try:
        meta = json.loads((p / MARKER).read_text())
        tensors = st_load((p / "model.safetensors").read_bytes())
    except (FileNotFoundError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a block drafter directory ({e})") from None
    if check:
        check_trained_for(meta, target, path, "block drafter", " --arch block")
    try:
        cfg = BlockConfig.from_json(meta["config"], target.config)
        tp = unflat_trainable({k: v for k, v in tensors.items() if k != "sub_ids"}, cfg)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: {MARKER} or the weights do not describe a block drafter for this target ({e})"
                              ) from None
    return make_drafter(cfg, tp, target, tensors["sub_ids"], dtype,
                        name or os.path.basename(os.path.normpath(str(path))))
