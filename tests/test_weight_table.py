"""GATE (issue 16, "one fact, one place"): every weight is declared once, in
``specjax.models.weights.WEIGHTS``. A weight added to that table is initialised, saved and
loaded from safetensors AND from GGUF, sharded and int8-quantized without editing any
other module; the EAGLE drafter runs the model's own public block function."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from conftest import tiny_model
from specjax.drafters import eagle
from specjax.io import gguf as gguf_loader
from specjax.io.loading import assemble_params, float_tensors, load_model, save_model
from specjax.models import llama, weights
from specjax.runtime import sharding

MESH = AbstractMesh((1, 2), ("data", "model"))

# two weights no module but this test knows about: a per-layer matrix and a model-level vector
EXTRA = (
    llama.WeightSpec("w_extra", lambda c: (c.hidden_size, c.intermediate_size), (None, "mlp"), quant_axis=0,
                     per_layer=True, hf_name="model.layers.{i}.mlp.extra_proj.weight", hf_transpose=True,
                     gguf_name="blk.{i}.ffn_extra.weight", gguf_transpose=True),
    llama.WeightSpec("extra_norm", lambda c: (c.hidden_size,), (None,), init="ones",
                     hf_name="model.extra_norm.weight", gguf_name="extra_norm.weight"),
)


@pytest.fixture
def extra_weights(monkeypatch):
    monkeypatch.setattr(weights, "WEIGHTS", weights.WEIGHTS + EXTRA)


def _flat(params) -> dict:
    return dict(llama.flatten_params(nnx.to_pure_dict(params)))


def _randomize(model, names):
    """``model`` with the parameters called ``names`` set to random values (so a weight that is
    dropped or mapped to the wrong tensor shows)."""
    params = jax.tree_util.tree_map(lambda x: x, model.params)
    k = 0
    for path, v in _flat(params).items():
        if path[-1] in names:
            node = params
            for p in path:
                node = node[p]
            node[...] = 0.3 * jax.random.normal(jax.random.PRNGKey(k), v.shape) + 1.0
            k += 1
    assert k, names
    return model.replace(params=params)


def _permute_qk(w, n_heads):
    """llama.cpp's Q/K row permutation (the converter's), the inverse of ``unpermute_qk``."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, out // n_heads // 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def write_gguf(model, path: str, arch: str, tokenizer=None) -> str:
    """``model`` as a float32 GGUF file; tensor names (a fused weight's parts), transposes and the
    Q/K permutation from the weight table (the writer side of the loader's rules). ``tokenizer``:
    a function that writes tokenizer fields into the writer (default: only the config's bos/eos ids)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    for key, val in [("vocab_size", cfg.vocab_size), ("embedding_length", cfg.hidden_size),
                     ("feed_forward_length", cfg.intermediate_size), ("block_count", cfg.num_layers),
                     ("attention.head_count", cfg.num_heads), ("attention.head_count_kv", cfg.num_kv_heads),
                     ("attention.key_length", cfg.head_dim), ("context_length", cfg.max_position_embeddings)]:
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    if tokenizer is None:
        w.add_uint32("tokenizer.ggml.bos_token_id", cfg.bos_token_id)
        w.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_ids[0])
    else:
        tokenizer(w)
    for p, whole in float_tensors(model):
        spec = llama.weight_spec(p[-1])
        for t, a in llama.split(spec, cfg, np.asarray(whole, np.float32)):
            if t.gguf_transpose:
                a = a.T
            if arch == "llama" and t.gguf_permute:
                a = _permute_qk(a, getattr(cfg, t.gguf_permute))
            w.add_tensor(t.checkpoint_name("gguf", p[1] if spec.per_layer else None), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_gguf(path: str, dtype="float32"):
    """``(config, params)`` of a GGUF file through the GGUF loader (no tokenizer needed)."""
    reader = gguf_loader.open_gguf(path)
    cfg = gguf_loader.config_from_gguf(reader)
    _, params = assemble_params(cfg, gguf_loader.iter_gguf_tensors(reader, cfg), dtype, source=path)
    return cfg, params


def _same_weights(model, params, names=None):
    want = {p: np.asarray(a) for p, a in float_tensors(model)}
    got = _flat(params)
    assert set(got) == set(want)
    for p, a in want.items():
        if names is None or p[-1] in names:
            np.testing.assert_array_equal(np.asarray(got[p]), a, err_msg=str(p))


def _same_config(a, b):
    """Equal but for rms_norm_eps (GGUF stores it as float32)."""
    assert dataclasses.replace(a, rms_norm_eps=b.rms_norm_eps) == b
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps)


def _check_int8_and_sharding(cfg, params8, quantized, plain):
    """``quantized`` weights are int8 codes with a float32 ``_scale`` (``[2, blocks of the input
    axis, output axes]``), ``plain`` ones stay float32 without a scale; every one gets its sharding
    from the table (a scale its weight's, the blocks split where whole blocks fall on each device)."""
    flat = _flat(params8)
    for path, v in flat.items():
        name = path[-1]
        if name in quantized:
            assert v.dtype == jnp.uint8, path
            assert path[:-1] + (name + "_scale",) in flat, path
        if name in plain:
            assert v.dtype == jnp.float32 and path[:-1] + (name + "_scale",) not in flat, path
        base = name[:-len("_scale")] if name.endswith("_scale") else name
        spec = llama.weight_spec(base)
        assert spec is not None, path
        want = tuple(sharding.AXIS_RULES.get(a) if a else None for a in spec.logical_axes)  # the tiny sizes divide 2
        if name.endswith("_scale"):
            q = spec.quant_axis
            k = spec.shape(cfg)[q]
            whole = want[q] is not None and k % 32 == 0 and (k // 32) % 2 == 0
            want = (None,) + want[:q] + (want[q] if whole else None,) + want[q + 1:]
            assert v.shape == weights.scale_shape(spec.shape(cfg), q), path
        assert tuple(sharding.param_spec(path, v.shape, cfg, MESH)) == want, path


# ----------------------------------------------------------------------------- table entries
@pytest.mark.parametrize("arch,kw", [("llama", dict()), ("qwen2", dict(model_type="qwen2", attention_bias=True))])
def test_table_weights_load_from_safetensors_and_gguf(tmp_path, arch, kw):
    """Llama (GGUF Q/K permuted) and Qwen2 (attention biases, gated by ``cfg.attention_bias``):
    the same weights back from a safetensors directory and from a GGUF file; int8 quantizes
    the matrices (not the biases) and every parameter is sharded by the table's axes."""
    m = tiny_model(seed=21, **kw)
    biases = ("b_qkv",)
    if m.config.attention_bias:
        m = _randomize(m, biases)
    back = load_model(save_model(m, str(tmp_path / "hf")))
    assert back.config == m.config
    _same_weights(m, back.params)
    cfg, params = load_gguf(write_gguf(m, str(tmp_path / "m.gguf"), arch))
    # the files hold the formats' own names and layouts (written here literally, not from the table)
    from safetensors.numpy import load_file

    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    raw = {t.name: np.asarray(t.data) for t in gguf_loader.open_gguf(str(tmp_path / "m.gguf")).tensors}
    parts = dict((t.name, a) for t, a in llama.split(llama.weight_spec("w_qkv"), m.config,
                                                     np.asarray(m.params["layers"][0]["w_qkv"][...])))
    wq = parts["wq"]
    np.testing.assert_array_equal(hf["model.layers.0.self_attn.k_proj.weight"], parts["wk"].T)
    np.testing.assert_array_equal(hf["model.layers.0.self_attn.v_proj.weight"], parts["wv"].T)
    np.testing.assert_array_equal(hf["model.layers.0.self_attn.q_proj.weight"], wq.T)
    np.testing.assert_array_equal(raw["blk.0.attn_q.weight"],
                                  _permute_qk(wq.T, m.config.num_heads) if arch == "llama" else wq.T)
    np.testing.assert_array_equal(raw["blk.0.ffn_down.weight"], hf["model.layers.0.mlp.down_proj.weight"])
    assert ("model.layers.1.self_attn.k_proj.bias" in hf) == ("blk.1.attn_k.bias" in raw) == m.config.attention_bias
    _same_config(cfg, m.config)
    _same_weights(m, params)
    assert (("layers", 0, "b_qkv") in _flat(params)) == m.config.attention_bias
    _, params8 = load_gguf(str(tmp_path / "m.gguf"), "int8")
    _check_int8_and_sharding(cfg, params8, quantized=llama.matmul_weights(), plain=biases + ("attn_norm",))
    if m.config.attention_bias:  # KV groups on the model axis (2 KV heads divide 2)
        assert tuple(sharding.param_spec(("layers", 0, "b_qkv"), (2, 6, 8), cfg, MESH)) == ("model", None, None)
    assert tuple(sharding.param_spec(("layers", 0, "w_qkv"), (64, 2, 6, 8), cfg, MESH)) == (None, "model", None, None)
    assert tuple(sharding.param_spec(("layers", 0, "w_gate_up"), (64, 2, 128), cfg, MESH)) == (None, None, "model")


def test_gguf_qk_permutation_round_trip():
    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    assert not np.array_equal(_permute_qk(w, 4), w)
    np.testing.assert_array_equal(gguf_loader.unpermute_qk(_permute_qk(w, 4), 4), w)


# ----------------------------------------------------------------------------- a new entry
def test_a_weight_added_to_the_table_is_loaded_sharded_and_quantized(tmp_path, extra_weights):
    """Two new :class:`WeightSpec` entries and nothing else: initialised, saved with their HF
    names, loaded back from safetensors and from GGUF, int8 per the table (the matrix
    quantized on its input axis, the vector not) and sharded by their logical axes."""
    names = {s.name for s in EXTRA}
    m = tiny_model(seed=22)
    flat = _flat(m.params)
    assert flat[("layers", 1, "w_extra")].shape == (64, 128) and flat[("extra_norm",)].shape == (64,)
    m = _randomize(m, names)

    path = save_model(m, str(tmp_path / "hf"))
    from safetensors.numpy import load_file

    on_disk = load_file(f"{path}/model.safetensors")
    assert on_disk["model.layers.0.mlp.extra_proj.weight"].shape == (128, 64)  # [out, in], as HF
    back = load_model(path)
    _same_weights(m, back.params)

    cfg, params = load_gguf(write_gguf(m, str(tmp_path / "m.gguf"), "llama"))
    _same_config(cfg, m.config)
    _same_weights(m, params)

    m8 = load_model(path, dtype="int8")
    _check_int8_and_sharding(m8.config, m8.params, quantized=("w_extra",), plain=("extra_norm",))
    assert tuple(sharding.param_spec(("layers", 0, "w_extra"), (64, 128), m.config, MESH)) == (None, "model")
    assert tuple(sharding.param_spec(("layers", 0, "w_extra_scale"), (2, 2, 128), m.config, MESH)) == (None, None, "model")
    assert sharding.PARAM_LOGICAL_AXES["w_extra"] == (None, "mlp") and "extra_norm" in sharding.PARAM_LOGICAL_AXES
    q, s = llama.quantize_int8(_flat(back.params)[("layers", 0, "w_extra")], 0)
    np.testing.assert_array_equal(np.asarray(_flat(m8.params)[("layers", 0, "w_extra")]), np.asarray(q))
    deq = dict(float_tensors(m8))[("layers", 0, "w_extra")]
    np.testing.assert_allclose(np.asarray(deq), np.asarray(llama.dequantize_int8(q, s, 0)), rtol=1e-6)


def test_without_the_entry_the_tensor_is_refused(tmp_path, monkeypatch):
    """The loaders know a tensor only through the table: the same checkpoint without the entry
    is refused by name (safetensors and GGUF)."""
    from specjax.models.config import CheckpointError

    monkeypatch.setattr(weights, "WEIGHTS", weights.WEIGHTS + EXTRA)
    m = tiny_model(seed=23)
    path = save_model(m, str(tmp_path / "hf"))
    g = write_gguf(m, str(tmp_path / "m.gguf"), "llama")
    monkeypatch.setattr(weights, "WEIGHTS", weights.WEIGHTS[:-len(EXTRA)])
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        load_model(path)
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        load_gguf(g)


# ----------------------------------------------------------------------------- the block
def test_eagle_block_is_the_model_block():
    """The drafter's block weights are the table's unconditional per-layer entries, and its
    forward is ``llama.decoder_block`` (a one-layer model with the drafter's block weights
    gives the same block output)."""
    assert eagle.layer_keys() == tuple(s.name for s in weights.WEIGHTS if s.per_layer and s.when is None)
    assert set(eagle.layer_matmuls()) == {"w_qkv", "wo", "w_gate_up", "w_down"}
    target = tiny_model(4, model_type="qwen2", attention_bias=True)  # the drafter's block has no biases
    cfg = eagle.EagleConfig.for_target(target.config, 32, 48)
    tp = eagle.init_params(cfg, 6)
    assert set(tp["layer"]) == set(eagle.layer_keys())
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 3, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
    cache = eagle.new_cache(cfg, 2, 8)
    y, kc, vc = llama.decoder_block(tp["layer"], x, pos, cache.k[0], cache.v[0], cfg.layer)
    assert y.shape == x.shape and y.dtype == jnp.float32 and kc.shape == cache.k[0].shape
    assert float(jnp.abs(kc[:, :, 3:]).max()) == 0.0 and float(jnp.abs(kc[:, :, :3]).max()) > 0
    # the same block inside the model's own forward: a one-layer model whose block is the drafter's
    lcfg = dataclasses.replace(cfg.layer, attention_bias=False, attention_out_bias=False)
    g, params = llama.init_model(lcfg, seed=0)
    for k, v in tp["layer"].items():
        params["layers"][0][k][...] = v
    emb = params["embed"][...]
    ids = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    h, c = llama.forward(g, params, ids, pos, llama.KVCache.create(lcfg, 2, 8), lcfg)
    y2, _, _ = llama.decoder_block(tp["layer"], jnp.take(emb, ids, axis=0), pos, cache.k[0], cache.v[0], lcfg)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(llama.rms_norm(y2, params["final_norm"][...],
                                                                            lcfg.rms_norm_eps)))


def test_num_params_from_the_table():
    """llama.num_params (from the table) == the leaves of an initialised model."""
    import jax
    import numpy as np

    from conftest import tiny_config
    from specjax.models import llama, weights

    for kw in ({}, {"tie_word_embeddings": True}, {"attention_bias": True}):
        cfg = tiny_config(**kw)
        _, params = llama.init_model(cfg)
        assert llama.num_params(cfg) == sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


def test_fused_weights_split_into_the_checkpoint_tensors():
    """``w_qkv [D, KV, G + 2, hd]`` holds, per KV group g, query heads g·G .. g·G + G - 1, then
    key and value head g (the checkpoints' head order); ``split`` inverts ``fuse``; one fused
    matmul is one dot; a random init draws the parts as a split layout would."""
    from conftest import tiny_config

    cfg = tiny_config()  # H = 8, KV = 2, hd = 8
    spec = llama.weight_spec("w_qkv")
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rng = np.random.default_rng(0)
    wq, wk, wv = (rng.standard_normal((d, n * hd)).astype(np.float32) for n in (h, kv, kv))
    w = llama.fuse(spec, cfg, [wq, wk, wv])
    assert w.shape == (d, kv, h // kv + 2, hd)
    np.testing.assert_array_equal(w[:, 1, 2], wq[:, (1 * 4 + 2) * hd:(1 * 4 + 3) * hd])  # group 1, query 2: head 6
    np.testing.assert_array_equal(w[:, 1, 4], wk[:, hd:2 * hd])
    np.testing.assert_array_equal(w[:, 0, 5], wv[:, :hd])
    assert [t.name for t, _ in llama.split(spec, cfg, w)] == ["wq", "wk", "wv"]
    for (_, a), b in zip(llama.split(spec, cfg, w), (wq, wk, wv)):
        np.testing.assert_array_equal(a, b)
    x = jnp.asarray(rng.standard_normal((3, d)), jnp.float32)
    hlo = jax.jit(lambda x, w: llama.matmul(x, w)).lower(x, jnp.asarray(w)).compile().as_text()
    assert hlo.count(" dot(") == 1
    np.testing.assert_allclose(np.asarray(llama.matmul(x, jnp.asarray(w)))[:, 0, :4].reshape(3, -1),
                               np.asarray(x) @ wq[:, :4 * hd], rtol=1e-5, atol=1e-5)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 3))
    init = llama.init_weight(spec, cfg, lambda: next(keys))
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 3))
    parts = [0.02 * jax.random.normal(next(keys), t.shape(cfg)) for t in spec.parts]
    np.testing.assert_array_equal(np.asarray(init), np.asarray(llama.fuse(spec, cfg, parts)))


def test_drafter_file_keeps_the_split_names_bitwise(tmp_path):
    """An EAGLE drafter's file holds the block's parts (``layer.wq`` …, ``layer.w_up``) as every
    drafter file so far; saving what was loaded writes the same bytes (the parts are contiguous:
    ``safetensors`` writes a strided view's raw buffer)."""
    from safetensors.numpy import load_file

    target = tiny_model(4)
    cfg = eagle.EagleConfig.for_target(target.config, 32, 48)
    tp = eagle.init_params(cfg, 6)
    eagle.save_drafter(str(tmp_path / "a"), cfg, tp, np.arange(32), target)
    first = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert {"layer.wq", "layer.wk", "layer.wv", "layer.w_gate", "layer.w_up"} <= set(first)
    gate_up = np.asarray(tp["layer"]["w_gate_up"])
    np.testing.assert_array_equal(first["layer.w_up"], gate_up[:, 1])
    d = eagle.load_drafter(str(tmp_path / "a"), target)
    eagle.save_drafter(str(tmp_path / "b"), cfg, d.params["train"], np.arange(32), target)
    second = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(first) == set(second)
    for k in first:
        np.testing.assert_array_equal(first[k], second[k], err_msg=k)
