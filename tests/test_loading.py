"""Loading: the real SmolLM2 GGUF against transformers (logits, tokenizer, greedy decoding),
checkpoint errors that name the problem, save/load round trips, truncation, packaging."""

from __future__ import annotations

import json
import os
import pickle

import jax
import numpy as np
import pytest
from conftest import tiny_model

import specjax
from specjax import CheckpointError, UnsupportedModelError
from specjax.runtime.decoder import Decoder, generate
from specjax.io.loading import default_model_path, load_model, save_model, truncate_model
from specjax.io.tokenizer import Tokenizer
from specjax.models import llama
from specjax.core.sampling import SamplingParams


def full_logits(model, tokens) -> np.ndarray:
    """Logits ``[B, T, V]`` of one forward pass over ``tokens [B, T]`` (positions 0..T-1)."""
    import jax.numpy as jnp

    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    cache = llama.KVCache.create(model.config, b, t)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return np.asarray(llama.apply(model.graphdef, model.params, tokens, pos, cache, model.config).logits)


# --------------------------------------------------------------------------- the real model vs transformers

# chat-templated (with a short system prompt: ≤ 32 tokens, so 64 new tokens fit the same
# 128-slot program as the determinism test in test_models.py: one compile for both)
SYSTEM = "You are a concise assistant."
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in one sentence.",
    "Give me three tips for sleeping better at night.",
]


def _messages(text):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def chat_ids(tok, text):
    return tok.encode(tok.apply_chat_template(_messages(text)), add_special_tokens=False)


TRICKY = [
    "1234567890 3.14159 1,000,000 and 2024-01-31",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🤖🚀 and Ω≈ç√",
    "  leading spaces\n\n\ttabs\r\nand   runs    of spaces   ",
    "a  1", "line\n\n3", "x = 3.14\n\n\ny",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "inline<|im_end|>special and <|im_start|>again",
    "",
    "a",
]


@pytest.fixture(scope="module")
def hf_gguf():
    """transformers' own loading of the shipped GGUF (dequantized to float32) + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # One intra-op thread: on the shared 2-core machine a second torch thread only spins
    # (measured: batch-4 greedy generate 98 s of CPU with 2 threads, 9 s with 1).
    torch.set_num_threads(1)
    d, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    # transformers' GGUF conversion ignores tokenizer.ggml.pre = "smollm" (plain GPT-2 regex);
    # use the pre-tokenizer of SmolLM2's own tokenizer.json: digits split off, then GPT-2's.
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    return model, tok


def test_tokenizer_matches_transformers(default_model, hf_gguf):
    _, hf_tok = hf_gguf
    tok = default_model.tokenizer
    for msgs in [_messages(p) for p in CHAT_PROMPTS] + [[{"role": "user", "content": CHAT_PROMPTS[0]}]]:
        rendered = tok.apply_chat_template(msgs)
        assert rendered == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(rendered, add_special_tokens=False)
        assert ids == hf_tok(rendered, add_special_tokens=False)["input_ids"]
        assert ids[0] == 1 and ids[-1] == 198  # <|im_start|> matched whole ... "assistant\n"
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template("hi")  # the default system prompt
    for s in TRICKY + CHAT_PROMPTS:
        for special in (True, False):
            want = hf_tok(s, add_special_tokens=special)["input_ids"]
            assert tok.encode(s, add_special_tokens=special) == want, (s, special)
        ids = hf_tok(s, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False), s
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), s
    # special tokens in text are single ids, not split into pieces
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert default_model.config.eos_token_ids == (2,) and tok.bos_token_id == 1


def test_gguf_logits_match_transformers(default_model, hf_gguf):
    import torch

    hf, _ = hf_gguf
    tok = default_model.tokenizer
    ids = [chat_ids(tok, p) for p in CHAT_PROMPTS[:3]]
    t = max(len(i) for i in ids)
    batch = np.zeros((len(ids), t), np.int64)  # right padding: causal, so it changes nothing before it
    for r, i in enumerate(ids):
        batch[r, : len(i)] = i
    got = full_logits(default_model, batch)
    for r, i in enumerate(ids):
        with torch.no_grad():
            want = hf(torch.tensor([i])).logits[0].float().numpy()
        diff = np.abs(got[r, : len(i)] - want).max()
        assert diff <= 1e-3, f"prompt {r}: max |Δlogits| = {diff:.2e}"
        assert np.abs(want).max() > 5  # real logits, not zeros


def test_greedy_matches_transformers_generate(default_model, hf_gguf):
    """64 new tokens for a batch of 4 chat prompts, EOS disabled on both sides, token for
    token (transformers runs the batch left-padded with an attention mask)."""
    import torch
    from transformers import GenerationConfig

    hf, _ = hf_gguf
    tok = default_model.tokenizer
    prompts = [chat_ids(tok, p) for p in CHAT_PROMPTS]
    assert max(len(p) for p in prompts) <= 32
    dec = Decoder(default_model)
    ours = dec.generate(prompts, max_new_tokens=64, eos_ids=[]).tokens
    assert len(dec.compiled) == 2

    t = max(len(p) for p in prompts)
    inp = torch.full((len(prompts), t), 2, dtype=torch.long)
    mask = torch.zeros((len(prompts), t), dtype=torch.long)
    for r, p in enumerate(prompts):
        inp[r, t - len(p):] = torch.tensor(p)
        mask[r, t - len(p):] = 1
    # transformers fills a None eos_token_id from the model's generation config, and
    # min_new_tokens would *suppress* EOS (not ignore it): unset it on the model itself.
    gc = GenerationConfig(do_sample=False, max_new_tokens=64, eos_token_id=None, pad_token_id=2)
    saved_eos = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = hf.generate(inp, attention_mask=mask, generation_config=gc)
    finally:
        hf.generation_config.eos_token_id = saved_eos
    for r, p in enumerate(prompts):
        theirs = out[r, t:].tolist()
        assert len(ours[r]) == len(theirs) == 64
        if ours[r] != theirs:
            j = next(k for k in range(64) if ours[r][k] != theirs[k])
            with torch.no_grad():
                lg = hf(torch.tensor([p + theirs[:j]])).logits[0, -1].float().numpy()
            top2 = np.sort(lg)[-2:]
            margin = float(top2[1] - top2[0])
            assert margin < 1e-3, f"prompt {r}: first difference at new token {j} ({ours[r][j]} vs {theirs[j]}), margin {margin:.3g}"
            print(f"near-tie reported, not failed: prompt {r} differs at token {j}, margin {margin:.2e}")
    # EOS (id 2) was generated somewhere and decoding went on past it on both sides
    assert any(2 in o[:-1] for o in ours)


# --------------------------------------------------------------------------- errors that name the problem


def _one_line(e) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Llama checkpoint written by specjax (config.json + model.safetensors)."""
    path = str(tmp_path_factory.mktemp("tiny") / "ckpt")
    save_model(tiny_model(seed=11), path)
    return path


def _copy_ckpt(src, dst, edit_config=None, edit_tensors=None):
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if edit_config:
        edit_config(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_load_tiny_checkpoint_ok(tiny_dir):
    m = load_model(tiny_dir)
    assert m.config.num_layers == 2 and m.tokenizer is None


def test_missing_model_path(tmp_path):
    with pytest.raises(CheckpointError) as e:
        load_model(str(tmp_path / "no_such_model"))
    assert "not found" in _one_line(e) and "no_such_model" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        load_model(str(tmp_path / "missing.gguf"))
    assert "not found" in _one_line(e)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError) as e:
        load_model(str(empty))
    assert "config.json" in _one_line(e)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(CheckpointError) as e:
        load_model(str(bad))
    assert "GGUF" in str(e.value) and "junk.gguf" in str(e.value)


def test_missing_tensor(tiny_dir, tmp_path):
    bad = _copy_ckpt(tiny_dir, str(tmp_path / "bad"),
                     edit_tensors=lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    msg = _one_line(e)
    assert "missing" in msg and "layers.1.wk" in msg and "1 missing" in msg


def test_config_without_model_type(tiny_dir, tmp_path):
    """A config.json without ``model_type`` (e.g. ``{}``; turn 18's new-user pass got "model_type=None
    is not supported") names the file and the missing key."""
    bad = _copy_ckpt(tiny_dir, str(tmp_path / "bad"), edit_config=lambda c: c.pop("model_type"))
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    msg = _one_line(e)
    assert "config.json" in msg and "missing key 'model_type'" in msg


def test_wrong_shape(tiny_dir, tmp_path):
    def edit(t):
        w = t["model.layers.0.mlp.up_proj.weight"]
        t["model.layers.0.mlp.up_proj.weight"] = np.concatenate([w, w[:1]], axis=0)

    bad = _copy_ckpt(tiny_dir, str(tmp_path / "bad"), edit_tensors=edit)
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    msg = _one_line(e)
    assert "layers.0.w_up" in msg and "shape" in msg and "(64, 129)" in msg and "(64, 128)" in msg


def test_unexpected_tensor(tiny_dir, tmp_path):
    bad = _copy_ckpt(tiny_dir, str(tmp_path / "bad"),
                     edit_tensors=lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    assert "unexpected tensor" in _one_line(e) and "model.layers.0.mlp.extra.weight" in str(e.value)


class _Trap:
    """Unpickling this creates a marker file: proof that a pickle was (not) loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_weights_are_never_unpickled(tiny_dir, tmp_path):
    marker = str(tmp_path / "UNPICKLED")
    d = tmp_path / "pickled"
    d.mkdir()
    with open(os.path.join(tiny_dir, "config.json")) as f:
        (d / "config.json").write_text(f.read())
    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Trap(marker)}, f)
    with pytest.raises(CheckpointError) as e:
        load_model(str(d))
    msg = _one_line(e)
    assert "pytorch_model.bin" in msg and "pickle" in msg and "safetensors" in msg
    with pytest.raises(CheckpointError) as e:
        load_model(str(d / "pytorch_model.bin"))
    assert "pickle" in _one_line(e)
    assert not os.path.exists(marker), "the pickle was unpickled"
    # the trap works (the assertion above can fail)
    with open(d / "pytorch_model.bin", "rb") as f:
        pickle.load(f)
    assert os.path.exists(marker)


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]), ["gpt2", "not supported"]),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 64}), ["yarn", "not supported"]),
        (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                             "original_max_position_embeddings": 64}), ["yarn", "not supported"]),
        (lambda c: c.update(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
         ["per-layer-type", "not supported"]),
        (lambda c: c.update(hidden_act="gelu"), ["gelu", "not supported"]),
        (lambda c: c.update(mlp_bias=True), ["mlp_bias", "not supported"]),
        (lambda c: c.update(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
         ["sliding-window", "use_sliding_window=false"]),
        (lambda c: c.update(num_key_value_heads=3), ["num_key_value_heads=3", "multiple"]),
        (lambda c: c.update(model_type="qwen3_moe", num_experts=8, architectures=["Qwen3MoeForCausalLM"]),
         ["mixture-of-experts", "num_experts=8", "dense"]),
        (lambda c: c.update(model_type="qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1),
         ["qwen3 sliding-window", "use_sliding_window=false"]),
        (lambda c: c.update(model_type="llava", architectures=["LlavaForConditionalGeneration"], text_config={}),
         ["multimodal", "llava", "text-only"]),
        (lambda c: c.update(model_type="gemma2", hidden_activation="gelu"), ["gemma2", "gelu", "not supported"]),
        (lambda c: c.update(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
         ["local-layer RoPE", "linear"]),
    ],
    ids=["gpt2", "yarn", "yarn-v5", "per-layer-rope", "gelu", "mlp_bias", "qwen2-sliding", "gqa", "moe",
         "qwen3-sliding", "llava-multimodal", "gemma2-gelu", "gemma3-local-rope"],
)
def test_unsupported_architecture(tiny_dir, tmp_path, edit, words):
    bad = _copy_ckpt(tiny_dir, str(tmp_path / "bad"), edit_config=edit)
    with pytest.raises(UnsupportedModelError) as e:
        load_model(bad)
    msg = _one_line(e)
    for w in words:
        assert w in msg, (w, msg)


@pytest.fixture(scope="module")
def ctx16():
    return tiny_model(seed=12, max_position_embeddings=16)


def test_prompt_and_sampling_errors(ctx16):
    m = ctx16
    with pytest.raises(ValueError) as e:
        generate(m, [[3, 4], []])
    assert "prompt 1 is empty" in _one_line(e)
    with pytest.raises(ValueError) as e:
        generate(m, [])
    assert "no prompts" in _one_line(e)
    with pytest.raises(ValueError) as e:
        generate(m, [list(range(3, 19))])  # 16 tokens: no room for a new one
    msg = _one_line(e)
    assert "16 tokens" in msg and "context of 16" in msg and "shorten" in msg
    with pytest.raises(ValueError) as e:
        generate(m, [[3, 4]], max_new_tokens=0)
    assert "max_new_tokens" in _one_line(e) and ">= 1" in str(e.value)
    for kw, name in [(dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"),
                     (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k")]:
        with pytest.raises(ValueError) as e:
            SamplingParams.create(1, **kw)
        assert name in _one_line(e), kw
    # the longest prompt that fits still decodes (one new token, clipped to the context)
    r = generate(m, [list(range(3, 18))], max_new_tokens=5, eos_ids=[])
    assert len(r.tokens[0]) == 1


def test_text_api_errors(default_model):
    with pytest.raises(ValueError) as e:
        specjax.generate_text(default_model, ["hello", "   "])
    assert "prompt 1 is empty" in _one_line(e)
    with pytest.raises(ValueError) as e:
        specjax.generate_text(default_model, ["hello"], temperature=-1.0)
    assert "temperature" in _one_line(e)
    with pytest.raises(ValueError) as e:
        specjax.generate_text(default_model, ["hello"], top_p=2.0)
    assert "top_p" in _one_line(e)
    with pytest.raises(ValueError) as e:
        specjax.generate_text(default_model, ["hello"], top_k=-3)
    assert "top_k" in _one_line(e)
    with pytest.raises(ValueError) as e:
        specjax.generate_text(default_model, ["hello"], max_new_tokens=0)
    assert "max_new_tokens" in _one_line(e)
    with pytest.raises(ValueError) as e:
        specjax.generate_text(default_model, ["word " * 9000])
    assert "context" in _one_line(e)
    with pytest.raises(CheckpointError) as e:
        specjax.generate_text(default_model.replace(tokenizer=None), ["hello"])
    assert "no tokenizer" in _one_line(e)


# --------------------------------------------------------------------------- save / load / truncate


def _same_params(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(p))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(tie_word_embeddings=True, attention_bias=True, attention_out_bias=True, rope_theta=500000.0,
             rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                           ("original_max_position_embeddings", 64), ("rope_type", "llama3"))),
        dict(model_type="qwen2", attention_bias=True, rope_theta=1e6),
        dict(model_type="mistral", eos_token_ids=(1, 5)),
        dict(model_type="qwen3", qk_norm=True, head_dim=32, rope_theta=1e6),
        dict(model_type="gemma3_text", qk_norm=True, hidden_act="gelu_tanh", sandwich_norms=True, norm_weight_offset=1.0,
             scale_embeddings=True, query_pre_attn_scalar=24.0, sliding_window=8, sliding_layers=(0,),
             rope_local_theta=1e4, rope_theta=1e6, tie_word_embeddings=True),
    ],
    ids=["llama", "llama3-tied-bias", "qwen2", "mistral", "qwen3", "gemma3"],
)
def test_save_load_round_trip(tmp_path, kw):
    m = tiny_model(seed=13, **kw)
    if m.config.attention_bias or m.config.qk_norm:  # non-default biases / norms, so a dropped one would show
        for layer in m.params["layers"].values():
            for k in ("b_qkv", "bo", "q_norm", "k_norm"):
                if k in layer:  # norms: multipliers near 1, as trained ones are
                    layer[k][...] = jax.random.normal(jax.random.PRNGKey(len(k)), layer[k][...].shape) * 0.3 + (
                        1.0 if k.endswith("norm") else 0.0)
    path = save_model(m, str(tmp_path / "saved"))
    back = load_model(path)
    assert back.config == m.config
    _same_params(m.params, back.params)
    ids = np.random.default_rng(0).integers(0, m.config.vocab_size, size=(2, 9))
    np.testing.assert_array_equal(full_logits(back, ids), full_logits(m, ids))
    # never overwrite a non-empty directory
    with pytest.raises(CheckpointError) as e:
        save_model(m, path)
    assert "not empty" in _one_line(e)


def test_truncate_and_round_trip_with_tokenizer(default_model, tmp_path):
    """The real model cut to one layer, saved as a HF directory (tokenizer.json, chat
    template) and loaded back: same config, weights, logits, token ids and chat rendering."""
    tr = truncate_model(default_model, 1)
    assert tr.config.num_layers == 1 and len(tr.params["layers"]) == 1
    assert tr.tokenizer is default_model.tokenizer
    np.testing.assert_array_equal(np.asarray(tr.params["layers"][0]["w_qkv"][...]),
                                  np.asarray(default_model.params["layers"][0]["w_qkv"][...]))
    path = save_model(tr, str(tmp_path / "first1"))
    back = load_model(path)
    assert back.config == tr.config
    _same_params(tr.params, back.params)
    a, b = tr.tokenizer, back.tokenizer
    assert b is not None and b.fingerprint() == a.fingerprint()
    assert (b.bos_token_id, b.eos_token_ids, b.add_bos) == (a.bos_token_id, a.eos_token_ids, a.add_bos)
    for s in TRICKY:
        assert b.encode(s) == a.encode(s), s
    assert b.apply_chat_template("Hi there") == a.apply_chat_template("Hi there")
    ids = [a.encode(a.apply_chat_template("Hi there"), add_special_tokens=False)]
    np.testing.assert_array_equal(full_logits(back, ids), full_logits(tr, ids))


def test_truncate_model_math():
    m = tiny_model(seed=14)
    ids = np.random.default_rng(1).integers(0, m.config.vocab_size, size=(2, 7))
    # all layers: the same model
    np.testing.assert_array_equal(full_logits(truncate_model(m, 2), ids), full_logits(m, ids))
    # one layer == the two-layer model whose second block adds nothing to the residual stream
    silent = jax.tree_util.tree_map(lambda x: x, m.params)
    silent["layers"][1]["wo"][...] = silent["layers"][1]["wo"][...] * 0
    silent["layers"][1]["w_down"][...] = silent["layers"][1]["w_down"][...] * 0
    want = full_logits(m.replace(params=silent), ids)
    got = full_logits(truncate_model(m, 1), ids)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.abs(got - full_logits(m, ids)).max() > 1e-3  # the second layer mattered
    for n in (0, 3):
        with pytest.raises(ValueError) as e:
            truncate_model(m, n)
        assert "num_layers" in _one_line(e)


# --------------------------------------------------------------------------- packaging


def test_shipped_resources_resolve():
    from importlib import resources

    for pkg in ("specjax.shipped_configs", "specjax.shipped_models"):
        root = resources.files(pkg)
        assert root.is_dir(), pkg
        names = [p.name for p in root.iterdir()]
        assert names, pkg
    configs = resources.files("specjax.shipped_configs")
    from specjax.api import load_pair_config

    for p in configs.iterdir():
        if p.name.endswith(".toml"):
            cfg = load_pair_config(p.name[: -len(".toml")])
            assert isinstance(cfg, dict)
    with pytest.raises(ValueError) as e:
        load_pair_config("no-such-pair-config")
    assert "not found" in _one_line(e) and "shipped configs" in str(e.value)


def test_default_model_path_is_the_shipped_gguf():
    p = default_model_path()
    assert p.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(p)


def test_tokenizer_from_dir_needs_tokenizer_json(tmp_path):
    with pytest.raises(CheckpointError) as e:
        Tokenizer.from_dir(str(tmp_path))
    assert "tokenizer.json" in _one_line(e)
