"""Accuracy of the reduced-precision weight formats against float32.

For each format (``bfloat16``, ``int8``) and each prompt, with float32's greedy
continuation as the common text:

* ``top1_agreement``: fraction of positions (prompt's last token and every continuation
  position) where the format's argmax equals float32's;
* ``mean_kl``: mean KL(p_float32 ‖ p_format) in nats over the same positions
  (temperature 1, full vocabulary);
* ``greedy_agreement_len``: length of the common prefix of the format's own greedy
  continuation and float32's (tokens; = ``max_new_tokens`` when identical).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.runtime.decoder import Decoder
from specjax.models import llama


def teacher_forced_logits(model, ids: Sequence[int]) -> np.ndarray:
    """Logits ``[len(ids), V]`` float32 of one full forward over ``ids`` (no cache reuse)."""
    cfg = model.config
    n = len(ids)
    size = -(-n // 64) * 64
    toks = np.zeros((1, size), np.int32)
    toks[0, :n] = ids
    cache = llama.KVCache.create(cfg, 1, size, jnp.float32)
    pos = jnp.arange(size, dtype=jnp.int32)[None]
    out = _apply(model.graphdef, model.params, jnp.asarray(toks), pos, cache, cfg)
    return np.asarray(out)[0, :n]


def teacher_forced_batch(model, seqs: Sequence[Sequence[int]], rows: int = 4) -> list[np.ndarray]:
    """Logits float32 ``[len(seq), V]`` of one full forward over each of ``seqs``, run ``rows``
    sequences per call, all padded to one length (a multiple of 64): one compiled program for
    the whole list (a padded row's logits at its own positions are those of its own tokens)."""
    cfg = model.config
    size = -(-max(map(len, seqs)) // 64) * 64
    out = []
    for lo in range(0, len(seqs), rows):
        chunk = list(seqs[lo: lo + rows])
        toks = np.zeros((rows, size), np.int32)
        for i, s in enumerate(chunk):
            toks[i, : len(s)] = s
        cache = llama.KVCache.create(cfg, rows, size, jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32)[None], (rows, size))
        logits = np.asarray(_apply(model.graphdef, model.params, jnp.asarray(toks), pos, cache, cfg))
        out += [logits[i, : len(s)] for i, s in enumerate(chunk)]
    return out


@jax.jit
def _kl_top1(a, b):
    la = jax.nn.log_softmax(a, -1)
    lb = jax.nn.log_softmax(b, -1)
    kl = jnp.sum(jnp.exp(la) * (la - lb), -1)
    return kl, jnp.argmax(a, -1) == jnp.argmax(b, -1)


def _apply(graphdef, params, toks, pos, cache, cfg):
    return _apply_jit(graphdef, params, toks, pos, cache, cfg)


_apply_jit = jax.jit(lambda g, p, t, pos, c, cfg: llama.apply(g, p, t, pos, c, cfg).logits, static_argnums=(0, 5))


def accuracy_report(reference, others: dict, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64) -> dict:
    """Compare models in other formats with the float32 ``reference``.

    Args:
      reference: the float32 :class:`~specjax.io.loading.Model`.
      others: ``{format name: Model}``.
      prompts: token-id prompts.
      max_new_tokens: greedy continuation length (EOS ignored).

    Returns:
      ``{format: {"top1_agreement", "mean_kl", "greedy_agreement_len" (mean),
      "greedy_identical" (prompts), "positions", "per_prompt": [...]}}``.
    """
    ref_dec = Decoder(reference)
    ref = ref_dec.generate(list(prompts), max_new_tokens=max_new_tokens, eos_ids=[])
    ref_logits = [teacher_forced_logits(reference, list(p) + t) for p, t in zip(prompts, ref.tokens)]
    report = {}
    for name, model in others.items():
        own = Decoder(model).generate(list(prompts), max_new_tokens=max_new_tokens, eos_ids=[])
        per = []
        for p, rt, ot, rl in zip(prompts, ref.tokens, own.tokens, ref_logits):
            fl = teacher_forced_logits(model, list(p) + rt)
            sl = slice(len(p) - 1, None)  # positions that predict a continuation token
            kl, agree = _kl_top1(jnp.asarray(rl[sl]), jnp.asarray(fl[sl]))
            common = next((i for i, (a, b) in enumerate(zip(rt, ot)) if a != b), min(len(rt), len(ot)))
            per.append({"top1_agreement": float(np.mean(agree)), "mean_kl": float(np.mean(kl)),
                        "positions": int(agree.shape[0]), "greedy_agreement_len": int(common)})
        w = np.array([x["positions"] for x in per], float)
        report[name] = {
            "top1_agreement": float(np.average([x["top1_agreement"] for x in per], weights=w)),
            "mean_kl": float(np.average([x["mean_kl"] for x in per], weights=w)),
            "greedy_agreement_len": float(np.mean([x["greedy_agreement_len"] for x in per])),
            "greedy_identical": int(sum(x["greedy_agreement_len"] == max_new_tokens for x in per)),
            "prompts": len(per),
            "positions": int(w.sum()),
            "per_prompt": per,
        }
    return report


def format_report(report: dict, max_new_tokens: int) -> str:
    """Markdown table of :func:`accuracy_report`."""
    lines = ["| format | top-1 agreement | mean KL(p_f32 ‖ p_fmt) [nats] | greedy agreement length | identical greedy |",
             "|---|---|---|---|---|"]
    for name, r in report.items():
        lines.append(f"| {name} | {r['top1_agreement']:.4f} | {r['mean_kl']:.5f} | "
                     f"{r['greedy_agreement_len']:.1f} / {max_new_tokens} | {r['greedy_identical']}/{r['prompts']} |")
    return "\n".join(lines)
