"""Hugging Face checkpoints (part of :mod:`specjax.io.loading`, which re-exports them): safetensors
tensors mapped by the weight table (:data:`specjax.models.weights.WEIGHTS`), ``config.json`` read
with errors naming the file, hub downloads, the refusal of pickle files, and the ``config.json``
of a saved model (:func:`hf_config_dict`)."""

from __future__ import annotations

import glob
import json
import os

from specjax.io.files import read_utf8
from specjax.models import llama
from specjax.models.config import GEMMA_TYPES, CheckpointError, ModelConfig

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
CHECKPOINT_FORMATS = ("a .gguf file, a Hugging Face model directory (config.json + model.safetensors) or a hub id "
                      "like 'HuggingFaceTB/SmolLM2-135M-Instruct'")
# a multimodal checkpoint's language model (Gemma 3 4b/12b/27b): its tensor names, in the layouts of
# transformers before and after 5.0, and the vision parts that are skipped
LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                           ("model.language_model.", "model."))
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def hf_tensor_path(name: str, cfg: ModelConfig, names: dict | None = None):
    """Map a HF tensor name to ``(specjax path, transpose, offset)`` by the weight table
    (:data:`specjax.models.weights.WEIGHTS`; a part of a fused weight at the part's path);
    ``None`` for tensors to skip (RoPE buffers, the copy of a tied head). ``offset``: what to add to
    the tensor (in float32) for specjax's value (:meth:`~specjax.models.weights.WeightSpec.norm_offset`:
    Gemma's norm weights), else 0. ``names``:
    ``llama.checkpoint_names(cfg, "hf")`` if already built.

    Raises:
      CheckpointError: a name the table does not have for this config.
    """
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if cfg.multimodal:  # the language model of a multimodal checkpoint; the vision tower is not read
        if name.startswith(VISION_PREFIXES):
            return None
        for prefix, to in LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = to + name[len(prefix):]
                break
    hit = (names if names is not None else llama.checkpoint_names(cfg, "hf")).get(name)
    if hit is None:
        raise CheckpointError(f"unexpected tensor {name!r} for a {cfg.model_type} model")
    path, spec, tensor = hit
    if spec.tied_to is not None and not spec.present(cfg):
        return None
    return path, tensor.hf_transpose, spec.norm_offset("hf", cfg)


def is_pickle(path: str) -> bool:
    """Whether the file ``path`` is a pickle by its first bytes: the protocol opcode (0x80,
    protocols 2 and later) or a zip archive (PyTorch's ``torch.save`` format). Nothing is unpickled."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head[:1] == b"\x80" or head == b"PK\x03\x04"


def check_model_file(path: str) -> None:
    """A file given as a model that is not a ``.gguf`` file: refused, as a pickle only when it is
    one (:func:`is_pickle`), a file of a model directory (``config.json``, ``*.safetensors``) by
    pointing at the directory, anything else as not a format specjax reads.

    Raises:
      CheckpointError: always, naming the file and what specjax reads.
    """
    if is_pickle(path):
        raise CheckpointError(f"{path} is a pickle file; specjax never unpickles. Convert it to safetensors.")
    if path.endswith((".safetensors", ".json")):
        raise CheckpointError(f"{path} is a file but not .gguf; pass the model directory holding it instead")
    raise CheckpointError(f"{path} is not a checkpoint format specjax reads; pass {CHECKPOINT_FORMATS}")


def safetensor_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise CheckpointError(f"{path}: shard(s) named in the index are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        return files
    pickles = [f for f in os.listdir(path) if f.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise CheckpointError(
            f"{path} holds only pickle weight files ({', '.join(sorted(pickles))}); specjax never unpickles "
            "(it can run arbitrary code). Convert to safetensors: "
            "`AutoModelForCausalLM.from_pretrained(path).save_pretrained(path, safe_serialization=True)`."
        )
    raise CheckpointError(f"{path} has no model.safetensors (or sharded index)")


def iter_hf_tensors(path: str, cfg: ModelConfig):
    """Yield ``(specjax path, array in specjax layout)`` from the safetensors files in ``path``, one
    tensor at a time: each is read when asked for, and this generator drops its reference before
    reading the next (a consumer that does too holds one source tensor at a time)."""
    from safetensors import safe_open

    names = llama.checkpoint_names(cfg, "hf")
    for file in safetensor_files(path):
        try:
            with safe_open(file, framework="flax") as f:
                for name in f.keys():
                    target = hf_tensor_path(name, cfg, names)
                    if target is None:
                        continue
                    p, tr, offset = target
                    t = f.get_tensor(name)
                    if offset:  # as the model adds it: in float32 (transformers' (1.0 + w.float()))
                        t = t.astype("float32") + offset
                    if tr:
                        t = t.T
                    yield p, t
                    del t  # not held while the next tensor is read
        except CheckpointError:
            raise
        except Exception as e:  # safetensors.SafetensorError, or an OSError from the mmap
            if type(e).__name__ != "SafetensorError" and not isinstance(e, (OSError, ValueError)):
                raise
            raise CheckpointError(f"{file}: not a readable safetensors file, truncated or corrupt "
                                  f"({' '.join(str(e).split())}); re-download or re-save the checkpoint") from None


def resolve_hub(model_id: str) -> str:
    """The local Hugging Face cache's snapshot of a hub checkpoint (nothing is downloaded).

    Raises:
      CheckpointError: the id is not in the local cache (says how to get it there), or the
        cache cannot be read.
    """
    fetch = (f"fetch it once where there is a network (`huggingface-cli download {model_id}`), or pass a local "
             "directory with config.json, model.safetensors and tokenizer.json (or a .gguf file)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover  (a dependency)
        raise CheckpointError(f"{model_id!r} looks like a hub id, and huggingface_hub is not installed; {fetch}") from None
    try:
        return snapshot_download(model_id, local_files_only=True,
                                 allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"])
    except LocalEntryNotFoundError:
        raise CheckpointError(f"{model_id!r} is not in the local Hugging Face cache (specjax reads hub ids from it and "
                              f"downloads nothing); {fetch}") from None
    except Exception as e:  # an unreadable cache, a malformed id, …
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"could not read {model_id!r} from the local Hugging Face cache ({type(e).__name__}: "
                              f"{first}); {fetch}") from None


def read_hf_config(cfg_file: str) -> ModelConfig:
    """``ModelConfig`` from a ``config.json``; a file that is not UTF-8 JSON, not an object, or
    lacks / mistypes a key raises :class:`CheckpointError` naming the file (and the line)."""
    text = read_utf8(cfg_file, CheckpointError, "re-download or re-save the checkpoint")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno}); "
                              "fix the file or re-download the checkpoint") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object (a Hugging Face config), got {type(d).__name__}")
    if "model_type" not in d:
        raise CheckpointError(f"{cfg_file}: missing key 'model_type'; not a complete Hugging Face config (re-download "
                              "the checkpoint or add the model's config.json)")
    try:
        cfg = ModelConfig.from_hf_config(d)
        if cfg.multimodal:
            import warnings

            warnings.warn(f"{cfg_file}: a multimodal {d.get('model_type')} checkpoint: its language model is loaded "
                          "and the vision tower is ignored (text prompts only)", stacklevel=2)
        return cfg
    except CheckpointError:
        raise
    except KeyError as e:
        raise CheckpointError(f"{cfg_file}: missing key {e.args[0]!r}; not a complete Hugging Face config") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"{cfg_file}: a value has the wrong type or range ({e})") from None


def looks_like_hub_id(s: str) -> bool:
    parts = str(s).split("/")
    return len(parts) == 2 and all(parts) and not str(s).startswith((".", "/", "~"))


def hf_config_dict(cfg: ModelConfig) -> dict:
    """A Hugging Face ``config.json`` dict for ``cfg`` (round-trips through ``from_hf_config``)."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[cfg.model_type]
    d = {
        "architectures": [arch],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if cfg.model_type in ("llama", "qwen3"):
        d["attention_bias"] = cfg.attention_out_bias
    if cfg.model_type == "mistral":
        d["sliding_window"] = None
    if cfg.model_type in GEMMA_TYPES:
        d.pop("hidden_act")
        d.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                 attn_logit_softcapping=cfg.attn_logit_softcapping, final_logit_softcapping=cfg.final_logit_softcapping,
                 sliding_window=cfg.sliding_window, attention_bias=cfg.attention_out_bias,
                 layer_types=["sliding_attention" if i in cfg.sliding_layers else "full_attention"
                              for i in range(cfg.num_layers)])
        if cfg.rope_local_theta is not None:
            d["rope_local_base_freq"] = cfg.rope_local_theta
    if cfg.rope_scaling:
        d["rope_scaling"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.rope_scaling}
    if cfg.bos_token_id is not None:
        d["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        d["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)
    return d
