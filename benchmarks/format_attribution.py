"""Where a reduced weight format's error comes from: fake-quantized variants of the float32 model.

    python benchmarks/format_attribution.py [--prompts tests/data/spec_bench/question_excerpt.jsonl] \
        [--limit 20] [--max-new-tokens 32] [--variants all]

Every variant runs the float32 model with some matmul inputs rounded as a format would round
them (weights per output channel or per block of 32 inputs, activations per row or per block
of 32 inputs; int8, symmetric, scale = max|x| / 127) and the products in float32, so only the
rounding differs from float32. For each variant: mean KL(p_float32 ‖ p_variant) in nats and top-1
agreement over the float32 greedy continuation of each prompt (teacher forced: the prompt's last
position and every continuation position), chat template on. ``--only KINDS`` limits the rounding
to some matmuls (qkv, o, gate_up, down, head).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from specjax.api import encode_prompts
from specjax.io.loading import load_model
from specjax.io.prompts import read_prompts
from specjax.models import llama
from specjax.runtime.decoder import Decoder

BLK = 32
_real_matmul = llama.matmul


def _q(x, axis):
    """Symmetric int8 fake quantization of ``x`` reduced over ``axis`` (tuple)."""
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    s = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / s), -127, 127) * s


def _blocks(x, axis):
    """Fake-quantize ``x`` in blocks of 32 along ``axis``."""
    x = jnp.moveaxis(x, axis, -1)
    k = x.shape[-1]
    y = _q(x.reshape(*x.shape[:-1], k // BLK, BLK), (-1,)).reshape(x.shape)
    return jnp.moveaxis(y, -1, axis)


def _rows2(x):
    """Two-level per-row int8 (x ≈ s1·q1 + s2·q2, q2 the rounded residual)."""
    hi = _q(x, (-1,))
    return hi + _q(x - hi, (-1,))


def _kind(w, transposed):
    if transposed:
        return "head"
    if w.ndim == 4:
        return "qkv"
    if w.ndim == 3:
        return "gate_up"
    return "down" if w.shape[0] > w.shape[-1] else "o"


def make_matmul(weights: str, acts: str, only: set[str]):
    def mm(x, w, scale=None, transposed=False):
        kind = _kind(w, transposed)
        if kind in only:
            kaxis = 1 if transposed else 0
            if weights == "channel":
                w = _q(w, (kaxis,))
            elif weights == "block":
                w = _blocks(w, kaxis)
            if acts == "row":
                x = _q(x, (-1,))
            elif acts == "block":
                x = _blocks(x, -1)
            elif acts == "row2":
                x = _rows2(x)
        return _real_matmul(x, w, scale, transposed)
    return mm


VARIANTS = {  # name: (weights, activations)
    "int8 today (W channel, A row)": ("channel", "row"),
    "W channel, A float": ("channel", "float"),
    "W float, A row": ("float", "row"),
    "W block32, A float": ("block", "float"),
    "W float, A block32": ("float", "block"),
    "W block32, A block32": ("block", "block"),
    "W channel, A row two-level": ("channel", "row2"),
}
KINDS = ("qkv", "o", "gate_up", "down", "head")


def logits_fn(model, size):
    cfg = model.config

    @jax.jit
    def f(params, toks):
        cache = llama.KVCache.create(cfg, toks.shape[0], size, jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32)[None], toks.shape)
        out = llama.apply(model.graphdef, params, toks, pos, cache, cfg).logits
        return jax.nn.log_softmax(out, -1)
    return f


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="tests/data/spec_bench/question_excerpt.jsonl")
    ap.add_argument("--limit", type=int, default=20, help="prompts (the first N, at most 384 tokens each)")
    ap.add_argument("--split", default="configs/spec_bench_split.json", help="only its evaluation questions")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--variants", default="all")
    ap.add_argument("--per-kind", action="store_true", help="also: today's int8 on one matmul kind at a time")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model = load_model(None, dtype="float32")
    with open(a.split, encoding="utf-8") as f:
        held_out = set(json.load(f)["eval"])
    texts = [r["prompt"] for r in read_prompts(a.prompts) if r["question_id"] in held_out]
    ids = [x for x in encode_prompts(model, texts, chat=True) if len(x) <= 384][: a.limit]
    res = Decoder(model).generate(ids, max_new_tokens=a.max_new_tokens, eos_ids=[])
    seqs = [list(p) + list(t) for p, t in zip(ids, res.tokens)]
    size = -(-max(map(len, seqs)) // 64) * 64
    toks = np.zeros((len(seqs), size), np.int32)
    mask = np.zeros((len(seqs), size), bool)
    for i, (p, s) in enumerate(zip(ids, seqs)):
        toks[i, : len(s)] = s
        mask[i, len(p) - 1: len(s) - 1] = True
    toks = jnp.asarray(toks)

    def run(mm):
        llama.matmul = mm
        try:
            outs = [np.asarray(logits_fn(model, size)(model.params, toks[i: i + 4])) for i in range(0, len(seqs), 4)]
        finally:
            llama.matmul = _real_matmul
        return np.concatenate(outs)

    ref = run(_real_matmul)
    variants = dict(VARIANTS) if a.variants == "all" else {k: VARIANTS[k] for k in a.variants.split(";")}
    jobs = [(name, w, x, set(KINDS)) for name, (w, x) in variants.items()]
    if a.per_kind:
        jobs += [(f"int8 today, {k} only", "channel", "row", {k}) for k in KINDS]
        jobs += [(f"int8 today, all but {k}", "channel", "row", set(KINDS) - {k}) for k in KINDS]
    report = {}
    print(f"{len(seqs)} prompts, {int(mask.sum())} positions\n")
    print("| variant | mean KL(p_f32 ‖ p) [nats] | top-1 agreement |\n|---|---:|---:|")
    for name, w, x, only in jobs:
        lp = run(make_matmul(w, x, only))
        kl = np.sum(np.exp(ref) * (ref - lp), -1)[mask]
        agree = (ref.argmax(-1) == lp.argmax(-1))[mask]
        report[name] = {"mean_kl": float(kl.mean()), "top1": float(agree.mean())}
        print(f"| {name} | {kl.mean():.5f} | {agree.mean():.4f} |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
