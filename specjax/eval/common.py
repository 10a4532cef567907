"""What the measurements of :mod:`specjax.eval.measure` share: prompt records, the sampling
settings of a run (every declared field: the measurement cache keys hold them all), the
drafter's feature layers, and the jitted target and drafter calls as the decode loop makes them
(timed by :mod:`specjax.eval.costs`, reused by :mod:`specjax.eval.alpha`'s decoded α)."""

from __future__ import annotations

import functools

import jax

from specjax.core.sampling import SamplingParams
from specjax.core.settings import as_dict
from specjax.models import llama
from specjax.runtime.settings import DecodeSettings


# --------------------------------------------------------------------------- prompts
def prompt_records(prompts, target=None, chat: bool = False, parse_special: bool = True) -> list[dict]:
    """Normalise prompts to ``{"ids", "category", "question_id"}`` (text encoded with
    ``target``'s tokenizer, with its chat template when ``chat``; ``parse_special``: see
    :func:`specjax.api.encode_prompts`)."""
    from specjax.api import encode_prompts

    recs = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            p = {"prompt": p}
        elif not isinstance(p, dict):
            p = {"ids": [int(t) for t in p]}
        rec = {"category": p.get("category", "all"), "question_id": p.get("question_id", i)}
        if "ids" in p:
            rec["ids"] = [int(t) for t in p["ids"]]
        else:
            if target is None:
                raise ValueError("text prompts need the target model (its tokenizer)")
            rec["ids"] = encode_prompts(target, [p["prompt"]], chat, parse_special=parse_special)[0]
        if not rec["ids"]:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        recs.append(rec)
    if not recs:
        raise ValueError("no prompts given; pass at least one prompt")
    return recs


def sampling_key(settings: DecodeSettings) -> dict:
    """Every declared sampling field of ``settings`` (the measurement cache keys include them all:
    a new field can never reuse a stale measurement)."""
    return as_dict(settings.sampling)


def sampling_params(batch, temperature=0.0, top_k=0, top_p=1.0, **fields):
    return SamplingParams.create(batch, temperature, top_k, top_p, **fields)


def features_of(drafter) -> tuple[int, ...]:
    """The target blocks ``drafter`` reads (its ``feature_layers``: fused features), or ``()``."""
    return tuple(drafter.feature_layers) if drafter is not None else ()


def raw_features_of(drafter) -> bool:
    """Whether ``drafter`` reads its feature blocks unnormalized (its ``raw_features``)."""
    return bool(drafter.raw_features) if drafter is not None else False


# --------------------------------------------------------------------------- the loop's calls
@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "feature_layers", "raw_features"),
                   donate_argnames=("cache",))
def target_call(graphdef, cfg, params, tokens, positions, cache, sampling, tree_mask=None, feature_layers=(),
                raw_features=False):
    """One target call as the loop makes it: ``llama.apply`` over ``tokens [B, T]`` (with
    ``tree_mask [B, T, T]`` for a verification block: :func:`specjax.runtime.loop.verification_mask`
    for a chain, ``tree.block_attention_mask`` for a tree; ``None`` for a prefill or one token),
    then ``SamplingParams.process``: ``(p [B, T, V], hidden [B, T, D], cache)`` (``hidden``: the fused
    features of ``feature_layers`` when given, unnormalized with ``raw_features``)."""
    out = llama.apply(graphdef, params, tokens, positions, cache, cfg, return_hidden=True, tree_mask=tree_mask,
                      feature_layers=feature_layers, raw_features=raw_features)
    return sampling.process(out.logits), out.hidden, out.cache


@functools.partial(jax.jit, static_argnames=("drafter", "gamma", "vocab"), donate_argnames=("state",))
def draft_call(drafter, params, state, ctx, keys, gamma, vocab):
    """One whole ``propose`` call: ``(tokens [B, γ], q [B, γ, V], num_valid [B], state)``."""
    prop = drafter.propose(params, state, ctx, keys, gamma, vocab)
    return prop.tokens, prop.probs, prop.num_valid, prop.state


@functools.partial(jax.jit, static_argnames=("drafter", "max_len"))
def draft_init(drafter, params, ctx, max_len):
    return drafter.init_state(params, ctx, max_len)
