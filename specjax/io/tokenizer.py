"""Tokenizer wrapper around Hugging Face ``tokenizers`` with the model's chat template.

Built from a ``tokenizer.json`` (+ ``tokenizer_config.json`` for the chat template and
special tokens) or from GGUF metadata (byte-level BPE from ``tokenizer.ggml.tokens`` /
``merges``; pre-tokenizer from ``tokenizer.ggml.pre``, see :func:`gguf_pre_tokenizer`; chat
template from ``tokenizer.chat_template``).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import warnings
from typing import Sequence

from tokenizers import AddedToken, Regex, Tokenizer as _HFTokenizer, decoders, models, normalizers, pre_tokenizers

from specjax.models.config import CheckpointError

# Split regexes of the reference ``tokenizer.json`` files (the same rules llama.cpp's
# llama-vocab.cpp applies for these pre-tokenizer types).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# ``tokenizer.ggml.pre`` value -> rule (see :func:`gguf_pre_tokenizer`).
GGUF_PRE_TOKENIZERS = {
    "smollm": "smollm",
    "gpt2": "gpt2", "gpt-2": "gpt2", "default": "gpt2",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3",
    "qwen2": "qwen2",
}


def gguf_pre_tokenizer(pre: str | None):
    """The ``tokenizers`` pieces for a GGUF ``tokenizer.ggml.pre`` value.

    Supported (:data:`GGUF_PRE_TOKENIZERS`):

    * ``smollm``: every digit split off on its own, then the GPT-2 byte-level regex
      (``Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]``, as in
      SmolLM2's ``tokenizer.json``; llama.cpp: ``\\p{N}`` then the GPT-2 regex).
    * ``gpt-2`` / ``gpt2`` / ``default``: the GPT-2 byte-level regex. (llama.cpp's own
      ``default`` -- its fallback for files without the key -- also splits punctuation runs and
      3-digit groups first; specjax uses the plain GPT-2 rule, as transformers does.)
    * ``llama-bpe`` / ``llama3`` / ``llama-v3``: Llama-3's split regex (digits in groups of up
      to 3), byte-level without its own regex, BPE with ``ignore_merges`` (whole-vocabulary
      words taken as is), as Llama-3's ``tokenizer.json``.
    * ``qwen2``: Qwen2's split regex (single digits), NFC normalization, as Qwen2's
      ``tokenizer.json``.
    * missing key (``None``, old files): the GPT-2 rule, with a :class:`UserWarning`.

    Returns:
      ``(pre_tokenizer, normalizer or None, bpe_kwargs)``: ``bpe_kwargs`` go to ``models.BPE``.

    Raises:
      CheckpointError: any other value (names it and the supported ones).
    """
    if pre is None:
        warnings.warn("GGUF file has no tokenizer.ggml.pre; using the GPT-2 byte-level pre-tokenizer "
                      "(tokenization may differ from the model's own)", UserWarning, stacklevel=3)
        rule = "gpt2"
    else:
        rule = GGUF_PRE_TOKENIZERS.get(str(pre))
    if rule is None:
        raise CheckpointError(
            f"GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported "
            f"(supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}); "
            "use the Hugging Face checkpoint directory with tokenizer.json instead."
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if rule == "gpt2":
        return byte_level, None, {}
    if rule == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), None, {}
    split = _LLAMA3_SPLIT if rule == "llama3" else _QWEN2_SPLIT
    pre_tok = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    if rule == "llama3":
        return pre_tok, None, {"ignore_merges": True}
    return pre_tok, normalizers.NFC(), {}


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

    def save_tokenizer_json(self, path: str) -> None:
        """Write the ``tokenizers`` model (vocabulary, merges, pre-tokenizer, added tokens) to
        ``path``, a Hugging Face ``tokenizer.json`` (the special-token settings and chat template
        go to ``tokenizer_config.json``, which the caller writes)."""
        self._tok.save(path)

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Ids of ``text``; BOS prepended when the checkpoint asks for it and
        ``add_special_tokens`` is true (chat-templated text carries its own specials).

        Args:
          parse_special: ``True`` (default): special-token strings in ``text`` (``<|im_start|>``,
            ``<|endoftext|>``, …) become their control ids. ``False``: they are tokenized as
            plain text (for untrusted user text). Non-special added tokens are matched either way.
        """
        ids = self._encode_raw(text, parse_special)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def _encode_raw(self, text: str, parse_special: bool = True) -> list[int]:
        if parse_special:
            return self._tok.encode(text, add_special_tokens=False).ids
        # ``encode_special_tokens`` is a flag on the shared HF tokenizer (not thread-safe).
        saved = self._tok.encode_special_tokens
        self._tok.encode_special_tokens = True
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = saved

    def encode_chat(self, messages: list[dict] | str, add_generation_prompt: bool = True,
                    parse_special: bool = True, template_kwargs: dict | None = None) -> list[int]:
        """Ids of ``messages`` (or one user string) rendered with the chat template.

        Args:
          parse_special: ``True`` (default): the whole rendered text is tokenized with special
            tokens parsed, so a ``<|im_start|>`` typed in a message becomes the control id.
            ``False``: only the template's own special tokens become control ids; each message's
            ``content`` (a string) is tokenized as plain text. Ids are identical to ``True``
            whenever no message contains a special-token string.
          template_kwargs: extra variables for the template (:meth:`apply_chat_template`).

        Returns:
          ``list[int]`` (no BOS added beyond what the template writes).

        Raises:
          ValueError: no chat template; with ``parse_special=False``, a non-string message
            content, or a template that does not insert the contents verbatim.
        """
        if parse_special:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, template_kwargs),
                               add_special_tokens=False)
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        # Render once with a unique placeholder per content to find where the contents sit.
        tag = uuid.uuid4().hex
        marks, masked = [], []
        for i, m in enumerate(messages):
            if not isinstance(m.get("content"), str):
                raise ValueError(f"message {i}: parse_special=False needs a string 'content'")
            marks.append(f"\ue000{tag}:{i}\ue001")
            masked.append(dict(m, content=marks[-1]))
        rendered = self.apply_chat_template(messages, add_generation_prompt, template_kwargs)
        layout = self.apply_chat_template(masked, add_generation_prompt, template_kwargs)
        # user spans [start, end) in ``rendered``; the template text around them is kept as is
        spans, text, pos = [], [], 0
        for i, mark in enumerate(marks):
            if layout.count(mark) != 1:
                raise ValueError("this chat template does not insert each message's content once, verbatim; "
                                 "parse_special=False is not supported with it")
            j = layout.index(mark, pos)
            text.append(layout[pos:j])
            start = sum(len(t) for t in text)
            text.append(messages[i]["content"])
            spans.append((start, start + len(messages[i]["content"])))
            pos = j + len(mark)
        text.append(layout[pos:])
        if "".join(text) != rendered:
            raise ValueError("this chat template does not insert message contents verbatim; "
                             "parse_special=False is not supported with it")
        # Split only at special tokens that lie outside every user span (found by the HF
        # tokenizer itself, as it would match them); tokenize the pieces between them with
        # special-token parsing off. Without specials in the contents this is exactly the
        # ordinary tokenization (HF also tokenizes the text between special tokens piecewise).
        special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        enc = self._tok.encode(rendered, add_special_tokens=False)
        ids, pos = [], 0
        for tid, (a, b) in zip(enc.ids, enc.offsets):
            if tid in special_ids and not any(a < e and s < b for s, e in spans):
                ids += self._encode_raw(rendered[pos:a], parse_special=False) if a > pos else []
                ids.append(tid)
                pos = b
        if pos < len(rendered):
            ids += self._encode_raw(rendered[pos:], parse_special=False)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict] | str, add_generation_prompt: bool = True,
                            template_kwargs: dict | None = None) -> str:
        """Render ``messages`` (or one user string) with the model's chat template.

        ``template_kwargs``: extra variables the template reads, as transformers'
        ``apply_chat_template(**kwargs)`` and vLLM's ``chat_template_kwargs`` pass them (Qwen3:
        ``{"enable_thinking": False}``); a variable the template does not use changes nothing.

        Raises:
          ValueError: the checkpoint has no chat template (drop ``--chat``); a template variable
            that would replace ``messages``, ``add_generation_prompt`` or a special token.
        """
        extra = dict(template_kwargs or {})
        clash = sorted(set(extra) & ({"messages", "add_generation_prompt"} | set(self.special_tokens)))
        if clash:
            raise ValueError(f"chat template variable(s) {', '.join(clash)} are set by specjax itself; "
                             "remove them from the chat template kwargs")
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
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **extra
        )

    # ------------------------------------------------------------------ builders
    def to_cache_dict(self) -> dict:
        """Everything this tokenizer is, as JSON-ready values (``tokenizers``' own JSON in
        ``"tokenizer"``); :meth:`from_cache_dict` rebuilds it (the converted-weights cache,
        :mod:`specjax.io.convcache`: a second load of a GGUF never opens its reader)."""
        return {"tokenizer": self._tok.to_str(), "bos_token_id": self.bos_token_id,
                "eos_token_ids": list(self.eos_token_ids), "add_bos": bool(self.add_bos),
                "chat_template": self.chat_template, "special_tokens": dict(self.special_tokens)}

    @classmethod
    def from_cache_dict(cls, d: dict) -> "Tokenizer":
        """The tokenizer of :meth:`to_cache_dict`'s dict.

        Raises:
          KeyError, TypeError, ValueError, Exception: a dict that is not one (the caller rebuilds).
        """
        bos = d["bos_token_id"]
        if bos is not None and not isinstance(bos, int):
            raise ValueError(f"bos_token_id {bos!r} is not an id")
        eos = [int(e) for e in d["eos_token_ids"]]
        specials = d["special_tokens"]
        if not isinstance(specials, dict) or not isinstance(d["add_bos"], bool):
            raise ValueError("special_tokens is not a dict or add_bos is not a bool")
        template = d["chat_template"]
        if template is not None and not isinstance(template, str):
            raise ValueError("chat_template is not a string")
        return cls(_HFTokenizer.from_str(d["tokenizer"]), bos_token_id=bos, eos_token_ids=eos, add_bos=d["add_bos"],
                   chat_template=template, special_tokens=specials)

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
        """Byte-level BPE tokenizer from GGUF metadata (``tokenizer.ggml.model == 'gpt2'``),
        pre-tokenized by the rule ``tokenizer.ggml.pre`` names (:func:`gguf_pre_tokenizer`).

        Args:
          reader: a ``gguf.GGUFReader`` (fields not yet dropped).

        Raises:
          CheckpointError: other tokenizer kinds (e.g. sentencepiece ``'llama'``), or a
            ``tokenizer.ggml.pre`` value specjax does not support (named in the message).
        """
        from specjax.io.gguf import field

        kind = field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
                "use the Hugging Face checkpoint directory with tokenizer.json instead."
            )
        pre_tok, normalizer, bpe_kwargs = gguf_pre_tokenizer(field(reader, "tokenizer.ggml.pre"))
        tokens = field(reader, "tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
        types = field(reader, "tokenizer.ggml.token_type")
        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, **bpe_kwargs)
        tok = _HFTokenizer(bpe)
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.pre_tokenizer = pre_tok
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
