"""Tokenizer wrapper around Hugging Face ``tokenizers`` with the model's chat template.

Built from a ``tokenizer.json`` (+ ``tokenizer_config.json`` for the chat template and
special tokens) or from GGUF metadata (byte-level BPE from ``tokenizer.ggml.tokens`` /
``merges``; chat template from ``tokenizer.chat_template``).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Sequence

from tokenizers import AddedToken, Tokenizer as _HFTokenizer, decoders, models, pre_tokenizers

from specjax.config import CheckpointError


class Tokenizer:
    """Text ↔ ids, with the model's chat template.

    Attributes:
      bos_token_id, eos_token_ids: special ids (``eos_token_ids`` is a tuple, possibly empty).
      add_bos: prepend BOS on :meth:`encode` (the checkpoint's own setting).
      chat_template: Jinja2 template string or ``None``.
    """

    def __init__(self, tok: _HFTokenizer, *, bos_token_id=None, eos_token_ids=(), add_bos=False,
                 chat_template=None, special_tokens: dict | None = None):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def fingerprint(self) -> str:
        """SHA-256 of the vocabulary (id → token string), to check two models share a tokenizer."""
        vocab = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()

    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``; BOS prepended when the checkpoint asks for it and
        ``add_special_tokens`` is true (chat-templated text carries its own specials)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict] | str, add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (or one user string) with the model's chat template.

        Raises:
          ValueError: the checkpoint has no chat template (drop ``--chat``).
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; run without --chat / chat=False")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise ValueError(f"chat template error: {msg}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` from a HF model directory.

        Raises:
          CheckpointError: no ``tokenizer.json`` in ``path``.
        """
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise CheckpointError(
                f"{path} has no tokenizer.json; save the tokenizer with the model "
                "(tokenizer.save_pretrained(path)) or pass token ids directly."
            )
        tok = _HFTokenizer.from_file(tj)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        mcfg = _read_json(os.path.join(path, "config.json"))
        gcfg = _read_json(os.path.join(path, "generation_config.json"))
        vocab = tok.get_vocab(with_added_tokens=True)

        def tok_str(v):
            return v.get("content") if isinstance(v, dict) else v

        specials = {k: tok_str(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token") if cfg.get(k)}
        bos = gcfg.get("bos_token_id", mcfg.get("bos_token_id"))
        if bos is None and specials.get("bos_token") in vocab:
            bos = vocab[specials["bos_token"]]
        eos = gcfg.get("eos_token_id", mcfg.get("eos_token_id"))
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if specials.get("eos_token") in vocab and vocab[specials["eos_token"]] not in eos_ids:
            eos_ids.append(vocab[specials["eos_token"]])
        # add_bos: what the saved post-processor does, or the config flag.
        probe = tok.encode("a", add_special_tokens=True).ids
        add_bos = bool(cfg.get("add_bos_token", bos is not None and probe[:1] == [bos]))
        template = cfg.get("chat_template")
        if template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja")) as f:
                template = f.read()
        return cls(tok, bos_token_id=bos, eos_token_ids=eos_ids, add_bos=add_bos,
                   chat_template=template, special_tokens=specials)

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """Byte-level BPE tokenizer from GGUF metadata (``tokenizer.ggml.model == 'gpt2'``).

        Raises:
          UnsupportedModelError-like CheckpointError for other tokenizer kinds (e.g. sentencepiece 'llama').
        """
        from specjax.loading.gguf_loader import field

        kind = field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
                "use the Hugging Face checkpoint directory with tokenizer.json instead."
            )
        tokens = field(reader, "tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
        types = field(reader, "tokenizer.ggml.token_type")
        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        tok = _HFTokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        # Control tokens (type 3) are special: matched whole in text, skipped on decode.
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if int(ty) == 3])
        bos = field(reader, "tokenizer.ggml.bos_token_id")
        eos = field(reader, "tokenizer.ggml.eos_token_id")
        specials = {}
        if bos is not None:
            specials["bos_token"] = tokens[bos]
        if eos is not None:
            specials["eos_token"] = tokens[eos]
        add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False))
        return cls(tok, bos_token_id=bos, eos_token_ids=() if eos is None else (int(eos),),
                   add_bos=add_bos, chat_template=field(reader, "tokenizer.chat_template"),
                   special_tokens=specials)


def _read_json(path):
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)
