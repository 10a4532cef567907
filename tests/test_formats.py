"""Weight formats (float32, bfloat16, int8): parameter dtypes, no slow CPU paths in the
compiled HLO, accuracy against float32, and greedy speculative == greedy autoregressive
within each format."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, tiny_model
from specjax.runtime import decoder as decode
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.io.loading import Model, assemble_params, float_tensors, load_model, truncate_model
from specjax.models import llama

FORMATS = ["float32", "bfloat16", "int8"]
NEAR_TIE = 0.05  # top-2 logit margin below which a format's greedy choice is a near-tie


def convert(model: Model, fmt: str) -> Model:
    """The same weights in another format (int8 re-quantized from float32)."""
    g, p = assemble_params(model.config, float_tensors(model), fmt, source="convert")
    return model.replace(graphdef=g, params=p, dtype=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_parameter_dtypes(fmt):
    m = convert(tiny_model(tie_word_embeddings=True), fmt)
    leaves = {".".join(str(k.key) for k in path if hasattr(k, "key")): x
              for path, x in jax.tree_util.tree_leaves_with_path(m.params)}
    for name, x in leaves.items():
        base = name.split(".")[-1]
        if fmt == "float32":
            assert x.dtype == jnp.float32, name
        elif fmt == "bfloat16":
            assert x.dtype == jnp.bfloat16, name
        elif base.endswith("_scale") or "norm" in base or base.startswith("b"):
            assert x.dtype == jnp.float32, name
        else:
            assert base in llama.matmul_weights() and x.dtype == jnp.int8, name
    if fmt == "int8":
        assert "embed_scale" in leaves and "layers.0.w_qkv_scale" in leaves


def test_int8_quantization_roundtrip_is_idempotent():
    m = convert(tiny_model(), "int8")
    again = convert(m, "int8")
    for a, b in zip(jax.tree_util.tree_leaves(m.params), jax.tree_util.tree_leaves(again.params)):
        if a.dtype == jnp.int8:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:  # scales: max|q * s| / 127 == s up to one float32 rounding
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def _hlo_types(txt):
    """name -> (dtype, shape) for every instruction of a compiled HLO module."""
    out = {}
    for m in re.finditer(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]", txt):
        out[m.group(1)] = (m.group(2), tuple(int(d) for d in m.group(3).split(",") if d))
    return out


def _dots(txt):
    """``(lhs type, rhs type, line)`` for every dot instruction."""
    types = _hlo_types(txt)
    for line in txt.splitlines():
        m = re.search(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", line)
        if m:
            yield types.get(m.group(1)), types.get(m.group(2)), line


def _no_slow_path(txt, fmt, weight_shapes):
    """Every dot with bf16/int8 operands has >= 2 lhs rows, and no dot multiplies a float32
    array of a weight's shape (XLA CPU's one-row fallback converts the whole bf16/int8
    weight to float32 and runs a float32 dot: the slow path)."""
    low = {"bfloat16": "bf16", "int8": "s8"}[fmt]
    n_low = 0
    for lt, rt, line in _dots(txt):
        if lt is None or rt is None:
            continue
        for t in (lt, rt):
            assert not (t[0] == "f32" and t[1] in weight_shapes), f"{fmt} weight converted to f32 for a dot: {line.strip()[:200]}"
        if lt[0] == low or rt[0] == low:
            n_low += 1
            contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line).group(1)
            batch = re.search(r"lhs_batch_dims=\{([\d,]*)\}", line)
            skip = {int(d) for d in contract.split(",") if d} | (
                {int(d) for d in batch.group(1).split(",") if d} if batch else set())
            rows = int(np.prod([s for i, s in enumerate(lt[1]) if i not in skip]))
            assert rows >= 2, f"one-row {fmt} dot (slow path): {line.strip()[:200]}"
    assert n_low > 0, f"no {fmt} dot in the program: the format is not really used"


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_no_slow_path_in_compiled_decode(fmt):
    """The compiled AR and speculative decode programs at batch 1 (the one-row case) use
    bf16/int8 dots with >= 2 rows and never convert a weight to float32."""
    target = convert(tiny_model(seed=0, tie_word_embeddings=True), fmt)
    drafter = ModelDrafter.from_model(convert(tiny_model(seed=1, num_layers=1), fmt))
    cfg = target.config
    weight_shapes = {tuple(x.shape) for x in jax.tree_util.tree_leaves(target.params) if x.ndim == 2}
    weight_shapes |= {s[::-1] for s in weight_shapes}
    for dr in (None, drafter):
        d = decode.Decoder(target, dr, gamma=3)
        prog, args = d.prepare([[3, 4, 5]], max_new_tokens=8)
        st = decode.prefill_jit(prog, *args)
        for compiled in (decode.prefill_jit.lower(prog, *args).compile(),
                         decode.run_rounds_jit.lower(prog, args[0], args[1], st, jnp.int32(4)).compile()):
            _no_slow_path(compiled.as_text(), fmt, weight_shapes)


def test_hlo_check_catches_the_slow_path():
    """Negative control: a raw one-row bf16 dot is flagged."""
    w = jnp.ones((64, 128), jnp.bfloat16)
    f = jax.jit(lambda x, w: jax.lax.dot_general(x.astype(jnp.bfloat16), w, (((1,), (0,)), ((), ())),
                                                   preferred_element_type=jnp.float32))
    txt = f.lower(jnp.ones((1, 64)), w).compile().as_text()
    with pytest.raises(AssertionError):
        _no_slow_path(txt, "bfloat16", {(64, 128)})


def _first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _margin(model, ids):
    """Top-2 logit margin of ``model`` at the next position after ``ids``."""
    from specjax.eval.formats import teacher_forced_logits

    lg = np.sort(teacher_forced_logits(model, ids)[-1])
    return float(lg[-1] - lg[-2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_greedy_speculative_equals_autoregressive(fmt):
    target = convert(tiny_model(seed=3, scale=4.0), fmt)
    drafter = ModelDrafter.from_model(truncate_model(target, 1))
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [20]]
    ar = decode.Decoder(target).generate(prompts, max_new_tokens=24, eos_ids=[])
    for dr, g in ((drafter, 3), (NgramDrafter(2), 4)):
        sp = decode.Decoder(target, dr, gamma=g).generate(prompts, max_new_tokens=24, eos_ids=[])
        for p, a, s in zip(prompts, ar.tokens, sp.tokens):
            i = _first_divergence(a, s)
            if i is not None:
                m = _margin(target, p + a[:i])
                assert m < NEAR_TIE, f"{fmt}: divergence at {i} with top-2 margin {m:.4f}"
                print(f"{fmt}: near-tie divergence at {i} (margin {m:.4g})")


# ----------------------------------------------------------------- real default model
@pytest.fixture(scope="module")
def real_prompts(default_model):
    from specjax.api import encode_prompts
    from specjax.io.prompts import read_prompts

    rows = read_prompts(_bench_file())
    by_cat: dict = {}
    for r in rows:  # the first 10 categories in file order
        if r["category"] in by_cat or len(by_cat) < 10:
            by_cat.setdefault(r["category"], []).append(r["prompt"])
    # the shortest prompt of each category (chat-templated ≤ 256 tokens: one 256-token prompt
    # bucket, a 320-slot buffer; the first prompt of each had a 671-token summarization one, whose
    # 1024 bucket made these three real-model tests cost 220 s of the suite's 16 minutes)
    ids = [min(encode_prompts(default_model, ps, chat=True), key=len) for ps in by_cat.values()]
    assert len(ids) == 10 and max(map(len, ids)) <= 256
    return ids


def _bench_file():
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "data", "spec_bench", "question_excerpt.jsonl")  # carried in the repository


@pytest.fixture(scope="module")
def formats_models(default_model):
    return {"bfloat16": load_model(dtype="bfloat16"), "int8": load_model(dtype="int8")}


# int8 (per-channel weights x per-row activations) against float32 on these 10 prompts x 32 tokens
# (330 positions), measured: top-1 0.876, mean KL 0.041 nats (the fidelity measurement of
# BENCHMARKS.md, 8 other prompts: 0.911 / 0.046). The bounds leave ~3 standard errors of top-1 and
# ~20% of KL; one bit of weight precision lost (7-bit weights, planted: top-1 0.867, KL 0.058) fails.
INT8_MIN_TOP1 = 0.82
INT8_MAX_KL = 0.05


@pytest.mark.gate_matrix  # real model in 3 formats: .ci/run's gate-matrix phase (the suite keeps the tiny-model checks)
def test_real_accuracy_against_float32(default_model, formats_models, real_prompts):
    """bfloat16 top-1 agreement with float32 >= 98% on real prompts; int8 within its stated bound:
    top-1 >= INT8_MIN_TOP1 and mean KL <= INT8_MAX_KL (int8 is not faithful — BENCHMARKS.md "The
    fidelity bar" — but a regression of the format must not pass unnoticed)."""
    from specjax.eval.formats import accuracy_report, format_report

    # all 10 prompts, 32 tokens: the same autoregressive programs as the exactness test below
    # (compiled once, then read from the persistent compilation cache)
    rep = accuracy_report(default_model, formats_models, real_prompts, max_new_tokens=32)
    print("\n" + format_report(rep, 32))
    assert rep["bfloat16"]["top1_agreement"] >= 0.98, rep["bfloat16"]
    assert rep["bfloat16"]["mean_kl"] < rep["int8"]["mean_kl"] + 1.0  # both finite and reported
    i8 = rep["int8"]
    assert i8["top1_agreement"] >= INT8_MIN_TOP1 and i8["mean_kl"] <= INT8_MAX_KL, (
        f"int8 vs float32: top-1 {i8['top1_agreement']:.3f} (bound >= {INT8_MIN_TOP1}), mean KL "
        f"{i8['mean_kl']:.4f} nats (bound <= {INT8_MAX_KL}) on {i8['positions']} positions")


@pytest.mark.gate_matrix  # the gate matrix compares speculative and autoregressive bit for bit in every format
@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_real_greedy_speculative_equals_autoregressive_in_format(fmt, formats_models, real_prompts):
    """Within a format, greedy speculative == greedy autoregressive on 10 real prompts, except
    divergences at near-ties (top-2 margin < 0.05), counted: at most 1 prompt in 10."""
    target = formats_models[fmt]
    ar = decode.Decoder(target).generate(real_prompts, max_new_tokens=32, eos_ids=[])
    sp = decode.Decoder(target, NgramDrafter(3), gamma=4).generate(real_prompts, max_new_tokens=32, eos_ids=[])
    diverged = []
    for p, a, s in zip(real_prompts, ar.tokens, sp.tokens):
        i = _first_divergence(a, s)
        if i is not None:
            m = _margin(target, p + a[:i])
            assert m < NEAR_TIE, f"{fmt}: divergence at token {i} with top-2 margin {m:.4f} >= {NEAR_TIE}"
            diverged.append((i, m))
    print(f"{fmt}: {len(diverged)} near-tie divergences in {len(real_prompts)} prompts: {diverged}")
    assert len(diverged) <= len(real_prompts) // 10
