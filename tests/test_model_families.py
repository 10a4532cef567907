"""GATE (issue 30): model families beyond the Llama shape, each checked against transformers.

Per family (Qwen3, Gemma 2, Gemma 3 text): a tiny random model built and saved by transformers' own classes
(its config class, safetensors) and loaded by specjax: logits within 1e-4 (float32) of
transformers' over a 64-token prompt, and the greedy 32-token continuation identical to
transformers' ``generate``; the same weights written as a GGUF file with the ``gguf`` package and
read by BOTH specjax and transformers (``gguf_file=``), with the same logits (Qwen3); greedy speculative
decoding equal to autoregressive with the n-gram drafter and an (untrained) EAGLE-3-style drafter,
chains and trees; a row decoded alone equal to the same row in a batch (chains). The Gemma models have a
sliding window (16) shorter than the prompts (64 tokens), soft-capping (Gemma 2) and a separate
local RoPE base with a scaled global RoPE (Gemma 3).
"""

from __future__ import annotations

import numpy as np
import pytest

import torch  # the reference; the test extra installs it (missing is an error, not a skip)
import transformers
from test_models import full_logits, randomize_
from test_tokenizer import ALPHABET
from test_weight_table import write_gguf

from specjax.drafters import eagle
from specjax.drafters.ngram import NgramDrafter
from specjax.io.loading import load_model
from specjax.runtime.decoder import Decoder

VOCAB = 96
QWEN3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=128,  # ≠ hidden / heads; transformers reads a
             # qwen3 GGUF with head_dim 128 whatever its key_length says (every released Qwen3 has 128)
             max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)
GEMMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, query_pre_attn_scalar=24, sliding_window=16, max_position_embeddings=256,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    # name: (config class, model class, config)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(GEMMA, num_hidden_layers=2, attn_logit_softcapping=5.0, final_logit_softcapping=4.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(GEMMA, num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})),
}
PROMPT_LEN, NEW = 64, 32


def _build(name, tmp_path_factory):
    cfg_cls, model_cls, kw = FAMILIES[name]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw)).eval()
    randomize_(hf, seed=30 + sorted(FAMILIES).index(name))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(str(path), safe_serialization=True)
    return hf, load_model(str(path)), path


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """``(HF model, specjax model, checkpoint dir)`` of a tiny random Qwen3."""
    return _build("qwen3", tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, qwen3):
    """``(name, HF model, specjax model, checkpoint dir)`` of each family (Qwen3 shared)."""
    return (request.param, *(qwen3 if request.param == "qwen3" else _build(request.param, tmp_path_factory)))


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    """A prompt with repeats (so prompt lookup finds n-grams), no BOS/EOS ids."""
    rng = np.random.default_rng(seed)
    base = rng.integers(3, VOCAB, size=12).tolist()
    return (base * (n // 12 + 1))[:n - 5] + rng.integers(3, VOCAB, size=5).tolist()


def test_qwen3_config_and_weights_are_the_checkpoints(qwen3):
    hf, m, _ = qwen3
    cfg = m.config
    assert cfg.model_type == "qwen3" and cfg.qk_norm and cfg.head_dim == 128 and cfg.hidden_size == 64
    assert not cfg.attention_bias and not cfg.tie_word_embeddings and cfg.rope_theta == 1e6
    got = np.asarray(m.params["layers"][1]["k_norm"][...])
    want = hf.model.layers[1].self_attn.k_norm.weight.detach().numpy()
    assert np.abs(want - 1).max() > 0.05  # randomized: a weight left at ones would show
    np.testing.assert_array_equal(got, want)


def test_gemma_configs_are_the_checkpoints(family):
    name, hf, m, _ = family
    cfg = m.config
    if name == "qwen3":
        return
    assert cfg.sandwich_norms and cfg.scale_embeddings and cfg.hidden_act == "gelu_tanh"
    assert cfg.sliding_window == 16 and cfg.query_pre_attn_scalar == 24 and cfg.norm_weight_offset == 1.0
    if name == "gemma2":
        assert cfg.sliding_layers == (0,) and cfg.attn_logit_softcapping == 5.0 and cfg.final_logit_softcapping == 4.0
        assert not cfg.qk_norm and cfg.rope_local_theta is None
    else:
        assert cfg.sliding_layers == (0, 1) and cfg.qk_norm and cfg.rope_local_theta == 10000.0
        assert cfg.rope_theta == 1e6 and dict(cfg.rope_scaling) == {"factor": 2.0, "rope_type": "linear"}
    # specjax keeps the (1 + w) multiplier; the checkpoint holds w
    w = hf.model.layers[0].post_feedforward_layernorm.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(m.params["layers"][0]["mlp_post_norm"][...]), 1.0 + w)


def test_logits_and_greedy_match_transformers(family):
    name, hf, m, _ = family
    ids = np.asarray([_prompt(0), _prompt(1)])
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.float().numpy()
    got = full_logits(m, ids)
    assert np.abs(want).max() > 1.0
    assert np.abs(got - want).max() <= 1e-4, f"{name}: max |Δlogits| = {np.abs(got - want).max():.2e}"
    prompt = _prompt(2)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    res = Decoder(m).generate([prompt], max_new_tokens=NEW, eos_ids=[])
    assert res.tokens[0] == ref


def _byte_level_tokenizer(w) -> None:
    """A VOCAB-token byte-level BPE vocabulary (one merge; bos 1, eos 2) in GGUF writer ``w``."""
    tokens = ["<|endoftext|>", "<s>", "</s>"] + ALPHABET[: VOCAB - 4] + [ALPHABET[0] + ALPHABET[1]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (VOCAB - 3))
    w.add_token_merges([f"{ALPHABET[0]} {ALPHABET[1]}"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def test_qwen3_gguf_is_read_alike_by_specjax_and_transformers(qwen3, tmp_path):
    hf, m, _ = qwen3
    path = write_gguf(m, str(tmp_path / "qwen3.gguf"), "qwen3", tokenizer=_byte_level_tokenizer)
    g = load_model(path)
    assert g.config.model_type == "qwen3" and g.config.qk_norm and g.config.head_dim == 128
    ids = np.asarray([_prompt(3)])
    ours = full_logits(g, ids)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="qwen3.gguf",
                                                                     torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = theirs_model(torch.tensor(ids)).logits.float().numpy()
        ref = hf(torch.tensor(ids)).logits.float().numpy()
    assert np.abs(theirs - ref).max() <= 1e-4  # transformers reads the file as the original
    assert np.abs(ours - theirs).max() <= 1e-4, f"max |Δlogits| = {np.abs(ours - theirs).max():.2e}"


def _eagle3(target):
    """An untrained EAGLE-3-style drafter (fused features of both blocks, half the vocabulary)."""
    cfg = eagle.EagleConfig.for_target(target.config, VOCAB // 2, 48, copy_ngram=3, feature_layers=(0, 1))
    tp = eagle.init_params(cfg, 7)
    tp["copy_b"] = tp["copy_b"] + 8.0  # copy where prompt lookup finds a candidate: drafts get accepted
    sub = np.arange(0, VOCAB, 2, dtype=np.int32)
    return eagle.EagleDrafter(cfg, {"train": tp, "frozen": eagle.frozen_params(target, sub)}, name="eagle3")


_AR: dict = {}


@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
def test_speculative_greedy_equals_autoregressive_and_batch_invariant(family, kind):
    name, _, m, _ = family
    prompts = [_prompt(4), _prompt(5, 40), _prompt(6, 23)]
    if name not in _AR:  # one autoregressive reference per family, for both drafter kinds
        _AR[name] = Decoder(m).generate(prompts, max_new_tokens=NEW, eos_ids=[]).tokens
    ar = _AR[name]
    drafter = NgramDrafter(3) if kind == "ngram" else _eagle3(m)
    for tree in (None, (6, 3, 2)):
        kw = {} if tree is None else dict(tree_nodes=tree[0], tree_depth=tree[1], tree_topk=tree[2])
        dec = Decoder(m, drafter, 3, **kw)
        res = dec.generate(prompts, max_new_tokens=NEW, eos_ids=[])
        assert res.tokens == ar, (kind, tree)
        assert sum(s["accepted_tokens"] for s in res.stats) > 0, (kind, tree)  # drafts were accepted
        if tree is None:  # a row alone == in the batch (the chain's program at batch 1: one compile, CI minutes)
            alone = dec.generate([prompts[1]], max_new_tokens=NEW, eos_ids=[])
            assert alone.tokens[0] == res.tokens[1], (kind, tree)


def test_multimodal_gemma3_loads_its_language_model(tmp_path):
    """Gemma 3 4b/12b/27b checkpoints are Gemma3ForConditionalGeneration: the language model's tensors
    under ``language_model.``, plus a vision tower that is skipped (with one warning); text-only
    logits equal transformers' (no image)."""
    _, _, kw = FAMILIES["gemma3"]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    cfg = transformers.Gemma3Config(text_config=kw, vision_config=vision, mm_tokens_per_image=4, boi_token_index=90,
                                    eoi_token_index=91, image_token_index=92)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    randomize_(hf, seed=40)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    with pytest.warns(UserWarning, match="vision tower is ignored"):
        m = load_model(str(tmp_path))
    assert m.config.multimodal and m.config.model_type == "gemma3_text" and m.config.sliding_layers == (0, 1)
    ids = np.asarray([_prompt(7)])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids)).logits.float().numpy()
    got = full_logits(m, ids)
    assert np.abs(want).max() > 1.0
    assert np.abs(got - want).max() <= 1e-4, f"max |Δlogits| = {np.abs(got - want).max():.2e}"


def test_config_identity_of_earlier_models_is_unchanged():
    """Fields added for the new families are left out of a config's identity (what a drafter's
    trained-for fingerprint hashes) while at their defaults, so drafters trained before them still load;
    a model that uses one is told apart."""
    import dataclasses

    from conftest import tiny_config
    from specjax.models.config import LATER_FIELDS

    cfg = tiny_config()
    before = {f.name for f in dataclasses.fields(cfg)} - set(LATER_FIELDS)
    assert set(cfg.identity()) == before
    assert cfg.identity()["eos_token_ids"] == [1]  # tuples as JSON lists, as the fingerprint always wrote them
    assert dataclasses.replace(cfg, qk_norm=True).identity()["qk_norm"] is True
