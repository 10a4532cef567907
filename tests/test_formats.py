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
from specjax.models import llama, weights

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
            assert base in llama.matmul_weights() and x.dtype == jnp.uint8, name
    if fmt == "int8":
        assert "embed_scale" in leaves and "layers.0.w_qkv_scale" in leaves


def test_int8_quantization_roundtrip_is_idempotent():
    m = convert(tiny_model(), "int8")
    again = convert(m, "int8")
    for a, b in zip(jax.tree_util.tree_leaves(m.params), jax.tree_util.tree_leaves(again.params)):
        if a.dtype == jnp.uint8:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:  # scales and offsets: the same up to float32 roundings
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


def no_slow_path(txt, fmt, weight_shapes):
    """Every dot with bf16 operands has >= 2 lhs rows, and no dot multiplies a float32 array of a
    weight's shape (XLA CPU's one-row fallback converts the whole bf16 weight to float32 and runs a
    float32 dot: the slow path). int8: every matmul is the block kernel's custom call (no dot on
    a weight at all)."""
    if fmt == "int8":
        for lt, rt, line in _dots(txt):
            for t in (lt, rt):
                assert t is None or t[1] not in weight_shapes, f"int8 weight in a dot: {line.strip()[:200]}"
        assert re.search(r'custom_call_target="specjax_q8block_(kn|nk)"', txt), "no int8 kernel call in the program"
        return
    low = {"bfloat16": "bf16"}[fmt]
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
    bf16 dots with >= 2 rows and never convert a weight to float32; int8 runs the block kernel
    (on x86 with a C++ compiler; elsewhere its jnp reference, and this test is skipped with the reason)."""
    from specjax.models import q8

    if fmt == "int8" and not q8.available():
        pytest.skip(f"the int8 kernel is not available here: {q8.unavailable_reason()}")
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
            no_slow_path(compiled.as_text(), fmt, weight_shapes)


def test_hlo_check_catches_the_slow_path():
    """Negative control: a raw one-row bf16 dot is flagged."""
    w = jnp.ones((64, 128), jnp.bfloat16)
    f = jax.jit(lambda x, w: jax.lax.dot_general(x.astype(jnp.bfloat16), w, (((1,), (0,)), ((), ())),
                                                   preferred_element_type=jnp.float32))
    txt = f.lower(jnp.ones((1, 64)), w).compile().as_text()
    with pytest.raises(AssertionError):
        no_slow_path(txt, "bfloat16", {(64, 128)})


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


# int8 (8-bit block codes x two-level block activations, issue 26) must meet the fidelity bar of
# specjax.eval.fidelity on these 10 prompts x 32 tokens (330 positions), as bfloat16 does: mean KL
# <= 1e-3 nats and top-1 >= 98%. The int8 of turns 1-14 (per-channel weights x per-row
# activations) measured top-1 0.876, mean KL 0.041 here: it fails both by far.
INT8_MIN_TOP1 = 0.98
INT8_MAX_KL = 1e-3


@pytest.mark.gate_matrix  # real model in 3 formats: .ci/run's gate-matrix phase (the suite keeps the tiny-model checks)
def test_real_accuracy_against_float32(default_model, formats_models, real_prompts):
    """bfloat16 top-1 agreement with float32 >= 98% on real prompts; int8 meets the fidelity bar:
    top-1 >= INT8_MIN_TOP1 and mean KL <= INT8_MAX_KL (BENCHMARKS.md "Issue 26")."""
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


@pytest.mark.parametrize("shape,axis", [((64, 96), 0), ((112, 3, 16), 0), ((40, 72), 1), ((8, 16), 0)])
def test_int8_block_codes_round_trip(shape, axis):
    """The int8 format of a float weight (issue 26): per block of 32 along the input axis (the last
    block partial where 32 does not divide), codes 0..255 with a scale and offset; every element
    within half a step of its block (|w - (d·code + m)| <= d/2 plus a float32 rounding), a
    constant block exact, and a weight already on a 4-bit grid of its block's scale and minimum
    (GGUF Q4_1: w = d·q + m) reproduced within float32 roundings."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32)
    w[(slice(None),) * axis + (slice(0, min(32, shape[axis])),)] = 0.25  # a constant block
    codes, scale = llama.quantize_int8(w, axis)
    assert codes.dtype == jnp.uint8 and codes.shape == w.shape
    assert scale.shape == weights.scale_shape(shape, axis)
    deq = np.asarray(llama.dequantize_int8(codes, scale, axis))
    d = np.repeat(np.asarray(scale[0]), 32, axis=axis)[tuple(slice(0, n) for n in shape)]
    assert np.all(np.abs(w - deq) <= d / 2 * (1 + 1e-5) + 1e-7)
    const = (slice(None),) * axis + (slice(0, min(32, shape[axis])),)
    np.testing.assert_array_equal(deq[const], w[const])
    # a Q4_1-like weight: every block spans codes 0..15 of its own scale and minimum
    k = shape[axis]
    blocks = -(-k // 32)
    dq = rng.uniform(0.01, 0.1, size=(blocks,)).astype(np.float32)
    mq = rng.uniform(-1, 0, size=(blocks,)).astype(np.float32)
    q = rng.integers(0, 16, size=(k,))
    q[::32] = 0
    q[1::32] = 15
    line = (dq[np.arange(k) // 32] * q + mq[np.arange(k) // 32]).astype(np.float32)
    deq4 = np.asarray(llama.dequantize_int8(*llama.quantize_int8(line[:, None], 0), 0))[:, 0]
    np.testing.assert_allclose(deq4, line, rtol=0, atol=1e-6)


def test_int8_block_matmul_close_to_float():
    """The int8 matmul (two-level activations per block x block codes) against the float32 product
    of the dequantized weight: relative error below 1e-4 on random data with outliers (two-level
    activations have ~15 bits per block; the weight's rounding is not in this comparison)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    x[:, 7] *= 40.0  # an outlier channel sets its blocks' scales
    w = rng.standard_normal((96, 48)).astype(np.float32)
    codes, scale = llama.quantize_int8(w, 0)
    deq = np.asarray(llama.dequantize_int8(codes, scale, 0), np.float64)
    ref = x.astype(np.float64) @ deq
    y = np.asarray(llama.matmul(jnp.asarray(x), codes, scale))
    assert np.max(np.abs(y - ref)) / np.max(np.abs(ref)) < 1e-4
    # the transposed (tied-embedding) layout: the same product
    ct, st = llama.quantize_int8(w.T, 1)
    yt = np.asarray(llama.matmul(jnp.asarray(x), ct, st, transposed=True))
    ref_t = x.astype(np.float64) @ np.asarray(llama.dequantize_int8(ct, st, 1), np.float64).T
    assert np.max(np.abs(yt - ref_t)) / np.max(np.abs(ref_t)) < 1e-4
