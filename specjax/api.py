"""High-level Python API: text in, text out (used by the CLI and the notebooks).

>>> import specjax
>>> target = specjax.load_model()                      # embedded SmolLM2-135M-Instruct
>>> drafter = specjax.load_drafter("ngram:3", target)
>>> out = specjax.generate_text(target, ["Summarize: ..."], drafter=drafter, gamma=4, chat=True)
>>> out[0]["text"], out[0]["stats"]["mean_accepted_tokens"]
"""

from __future__ import annotations

import json
import os
import tomllib
from typing import Any, Sequence

from specjax.config import CheckpointError
from specjax.decode import Decoder
from specjax.drafters.model import ModelDrafter, check_vocab_compatible
from specjax.drafters.ngram import NgramDrafter
from specjax.loading import Model, load_model
from specjax.sampling import SamplingParams

DRAFT_CHOICES = "none, ngram[:N], default, or a drafter PATH_OR_ID"


def load_drafter(spec: str | None, target: Model, dtype: str = "float32"):
    """Build a drafter from a ``--draft`` value.

    Args:
      spec: ``None``/``"none"`` (no drafter), ``"ngram"`` or ``"ngram:N"`` (prompt lookup,
        n-grams up to N), ``"default"`` (the trained drafter shipped for the default
        model), or a checkpoint path / hub id of a draft model with the target's tokenizer.
      target: the loaded target model (its tokenizer and vocab are checked).

    Raises:
      ValueError: an unknown spec (names the accepted values).
      CheckpointError: a drafter whose tokenizer differs, or real tokens beyond the target vocab.
    """
    if spec is None or spec == "none":
        return None
    if spec == "ngram" or spec.startswith("ngram:"):
        n = spec.split(":", 1)[1] if ":" in spec else "3"
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--draft {spec!r}: the n-gram size must be an integer >= 1, e.g. ngram:3")
        return NgramDrafter(max_ngram=int(n))
    if spec == "default":
        from specjax import shipped

        return shipped.load_default_drafter(target, dtype=dtype)
    looks_like_path = os.path.exists(os.path.expanduser(spec)) or spec.endswith(".gguf") or spec.count("/") == 1
    if not looks_like_path:
        raise ValueError(f"unknown --draft value {spec!r}; use {DRAFT_CHOICES}")
    dm = load_model(spec, dtype=dtype)
    check_vocab_compatible(target.tokenizer, dm.tokenizer, target.config.vocab_size, dm.config.vocab_size)
    return ModelDrafter.from_model(dm, name=os.path.basename(os.path.normpath(spec)))


def read_prompts(path: str) -> list[dict]:
    """Read a JSONL prompts file: each line an object with ``prompt`` (a string) or Spec-Bench
    ``turns`` (a list of strings; the first turn is used). Optional: ``question_id``, ``category``.

    Returns a list of dicts ``{"prompt", "question_id", "category"}``.

    Raises:
      ValueError: naming the file and line of an empty file, invalid JSON, a missing or
        wrongly typed ``prompt``/``turns`` field, or an empty prompt.
    """
    if not os.path.exists(path):
        raise ValueError(f"prompts file not found: {path}")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with 'prompt' or 'turns'")
            if "prompt" in obj:
                text = obj["prompt"]
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: 'prompt' must be a string")
            elif "turns" in obj:
                turns = obj["turns"]
                if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                    raise ValueError(f"{path}:{lineno}: 'turns' must be a non-empty list of strings")
                text = turns[0]
            else:
                raise ValueError(f"{path}:{lineno}: missing field 'prompt' (a string) or 'turns' (Spec-Bench)")
            if not text.strip():
                raise ValueError(f"{path}:{lineno}: the prompt is empty")
            out.append({"prompt": text, "question_id": obj.get("question_id", len(out)),
                        "category": obj.get("category", "all")})
    if not out:
        raise ValueError(f"{path}: no prompts in the file (it is empty)")
    return out


def encode_prompts(target: Model, texts: Sequence[str], chat: bool, parse_special: bool = True) -> list[list[int]]:
    """Token ids of each text (with the model's chat template when ``chat``).

    Args:
      target: a model with a tokenizer (only ``target.tokenizer`` and ``target.name`` are read).
      texts: the prompts (non-empty strings).
      chat: render each text as one user message with the chat template.
      parse_special: ``True`` (default, as before): special-token strings typed in a text
        (``<|im_start|>``, ``<|endoftext|>``, …) become control ids. ``False``: the texts are
        tokenized as plain text; with ``chat`` only the template's own special tokens become
        control ids (:meth:`specjax.loading.tokenizer.Tokenizer.encode_chat`). Ordinary text
        gets the same ids either way.

    Returns:
      ``list[list[int]]``: one id list per text.

    Raises:
      CheckpointError: the model has no tokenizer.
      ValueError: an empty prompt; ``chat`` without a chat template.
    """
    tok = target.tokenizer
    if tok is None:
        raise CheckpointError(f"{target.name} has no tokenizer; pass token ids to specjax.decode.generate instead")
    ids = []
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t.strip():
            raise ValueError(f"prompt {i} is empty; give a non-empty prompt")
        ids.append(tok.encode_chat(t, parse_special=parse_special) if chat
                   else tok.encode(t, parse_special=parse_special))
    return ids


def generate_text(
    target: Model,
    prompts: Sequence[str],
    *,
    drafter=None,
    gamma: int = 4,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    chat: bool = False,
    batch_size: int | None = None,
    ignore_eos: bool = False,
    decoder: Decoder | None = None,
    parse_special: bool = True,
) -> list[dict]:
    """Generate text for each prompt. Returns one dict per prompt:
    ``{"text", "tokens", "stats"}`` where ``stats`` has ``new_tokens``, ``prefill_s``,
    ``decode_s``, ``compile_s`` (seconds, for the prompt's batch), ``tokens_per_s``
    (the prompt's new tokens ÷ its batch's decode seconds) and the speculative counters
    of :class:`specjax.decode.GenerationResult`.

    Prompt i uses request key ``fold_in(PRNGKey(seed), i)``, whatever its batch.

    ``parse_special`` (default ``True``): whether special-token strings typed in a prompt
    become control ids; ``False`` tokenizes prompts as plain text (see :func:`encode_prompts`).
    """
    ids = encode_prompts(target, prompts, chat, parse_special=parse_special)
    bs = batch_size or len(ids)
    if bs < 1:
        raise ValueError(f"batch_size must be >= 1, got {bs}")
    dec = decoder or Decoder(target, drafter, gamma)
    results = []
    for start in range(0, len(ids), bs):
        chunk = ids[start:start + bs]
        sp = SamplingParams.create(len(chunk), temperature, top_k, top_p)
        r = dec.generate(chunk, max_new_tokens=max_new_tokens, sampling=sp, seed=seed, seed_offset=start,
                         eos_ids=[] if ignore_eos else None)
        for toks, st in zip(r.tokens, r.stats):
            st = dict(st, prefill_s=r.prefill_s, decode_s=r.decode_s, compile_s=r.compile_s,
                      tokens_per_s=len(toks) / r.decode_s if r.decode_s > 0 else 0.0, batch_size=len(chunk))
            results.append({"text": target.tokenizer.decode(toks), "tokens": toks, "stats": st})
    return results


def load_pair_config(name_or_path: str) -> dict[str, Any]:
    """Read a target/drafter pair config (TOML): a path, or the name of a shipped config
    (``configs/NAME.toml``). Keys: ``model``, ``draft``, ``gamma``, ``temperature``, ``top_k``,
    ``top_p``, ``max_new_tokens``, ``dtype``, ``draft_dtype``, ``chat``.

    Raises:
      ValueError: file not found (lists the shipped configs), or unknown keys.
    """
    from importlib import resources

    path = os.path.expanduser(name_or_path)
    if not os.path.exists(path):
        base = os.path.basename(path.rstrip("/"))
        base = base if base.endswith(".toml") else base + ".toml"
        shipped = resources.files("specjax.shipped_configs")
        cand = shipped / base
        if not cand.is_file():
            names = sorted(p.name for p in shipped.iterdir() if p.name.endswith(".toml"))
            raise ValueError(f"config {name_or_path!r} not found; shipped configs: {', '.join(names)}")
        text = cand.read_text()
    else:
        with open(path) as f:
            text = f.read()
    cfg = tomllib.loads(text)
    allowed = {"model", "draft", "gamma", "temperature", "top_k", "top_p", "max_new_tokens", "dtype",
               "draft_dtype", "chat", "description"}
    unknown = set(cfg) - allowed
    if unknown:
        raise ValueError(f"config {name_or_path!r}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return cfg
