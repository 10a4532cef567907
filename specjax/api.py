"""High-level Python API: text in, text out (used by the CLI and the notebooks).

>>> import specjax
>>> target = specjax.load_model()                      # embedded SmolLM2-135M-Instruct
>>> drafter = specjax.load_drafter("ngram:3", target)
>>> out = specjax.generate_text(target, ["Summarize: ..."], drafter=drafter, gamma=4, chat=True)
>>> out[0]["text"], out[0]["stats"]["mean_accepted_tokens"]
"""

from __future__ import annotations

import os
import tomllib
from typing import Any, Sequence

from specjax.core.drafting import TreeShape
from specjax.core import sampling as sampling_mod
from specjax.core.sampling import Sampling  # (annotations; code reads sampling_mod.Sampling: the declaration)
from specjax.core.settings import SettingError, knobs
from specjax.models.config import CheckpointError
from specjax.runtime.decoder import Decoder
from specjax.runtime.request import Request, field_names, request_class
from specjax.runtime.settings import DecodeSettings
from specjax.runtime.stats import RunStats
from specjax.drafters import registry
from specjax.drafters.model import ModelDrafter, check_vocab_compatible
from specjax.drafters.registry import DRAFT_CHOICES  # noqa: F401  (the accepted --draft values, in words)
from specjax.io.files import check_safetensors, read_json, read_utf8
from specjax.io.loading import Model, load_model


def check_draft_spec(spec: str | None) -> None:
    """Validate a ``--draft`` value without loading anything (before the target loads): its kind's
    check (:mod:`specjax.drafters.registry`), and for a drafter directory also its JSON files
    (``drafter.json`` / ``config.json``: valid JSON) and its ``*.safetensors`` files (complete,
    from their headers; no tensor is read).

    Raises:
      ValueError: an unknown spec, an n-gram size outside [1, ``MAX_NGRAM``], a drafter path that
        does not exist, or a drafter directory with a broken JSON file or a missing or truncated
        weights file.
    """
    _checked_kind(spec)


def _checked_kind(spec):
    """:func:`check_draft_spec`, returning the value's :class:`~specjax.drafters.registry.DrafterKind`
    (``None``: no drafter)."""
    kind = registry.check_spec(spec)
    if kind is not None and kind.marker is not None:
        path = os.path.expanduser(spec)
        if os.path.isdir(path):
            try:
                check_drafter_files(path, kind)
            except ValueError as e:
                raise ValueError(f"--draft {spec}: {e}") from None
    return kind


def check_drafter_files(path: str, kind=None) -> None:
    """The cheap checks of a drafter directory's files (nothing is loaded): its JSON files parse,
    the weights file of its kind (:attr:`~specjax.drafters.registry.DrafterKind.weights`) is
    there, its safetensors files are complete (headers only). ``kind``: the directory's
    :class:`~specjax.drafters.registry.DrafterKind` (default: found from its marker file).

    Raises:
      ValueError: naming the file and the fix.
    """
    again = "write it again (a drafter of specjax distill: specjax distill --out RUN --resume --export-only)"
    fix = f"re-download or re-copy the drafter, or {again}"
    for name in registry.marker_files():
        f = os.path.join(path, name)
        if os.path.isfile(f):
            read_json(f, ValueError, fix)
    kind = kind or registry.find_kind(path)
    if kind is not None and kind.weights and not os.path.isfile(os.path.join(path, kind.weights)):
        raise ValueError(f"{os.path.join(path, kind.weights)} is missing: the directory has {kind.marker} but not "
                         f"the drafter's weights; copy the whole drafter directory ({kind.marker} and "
                         f"{kind.weights}), or {again}")
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            check_safetensors(os.path.join(path, name), ValueError, fix)


def draft_spec_proposes_trees(spec: str | None) -> bool:
    """Whether the drafter of a ``--draft`` value proposes trees of any top-k (n-gram, the shipped
    drafter, an EAGLE drafter directory with ``drafter.json``); a draft model proposes chains
    only (trees of top-k 1). Reads no weights (:func:`specjax.drafters.registry.proposes_trees`)."""
    return registry.proposes_trees(spec)


def _load_shipped(spec: str, target: Model, dtype: str):
    """The ``default`` kind: the drafter shipped for the default model."""
    from specjax.io import shipped

    return shipped.load_default_drafter(target, dtype=dtype)


def _load_draft_model(spec: str, target: Model, dtype: str):
    """The ``model`` kind: a checkpoint path or hub id with the target's tokenizer. A hub id is
    fetched (or found in the local hub cache) first; when its directory is another kind's (a
    published EAGLE-3 head), that kind loads it."""
    from specjax.io.hf import looks_like_hub_id, resolve_hub

    name = os.path.basename(os.path.normpath(spec))
    if not os.path.exists(os.path.expanduser(spec)) and looks_like_hub_id(spec):
        local = resolve_hub(spec)
        kind = registry.find_kind(local)
        if kind is not None and kind.name != "model":
            return (kind.load or _IO_LOADERS[kind.name])(local, target, dtype)
        spec = local
    dm = load_model(spec, dtype=dtype)
    check_vocab_compatible(target.tokenizer, dm.tokenizer, target.config.vocab_size, dm.config.vocab_size)
    return ModelDrafter.from_model(dm, name=name)


# the loaders of the kinds whose loading needs specjax.io (a later layer than the registry's)
def _load_named_shipped(spec: str, target: Model, dtype: str):
    """The ``shipped`` kind: ``shipped:NAME``, a drafter directory under ``models/``."""
    from specjax.drafters.registry import SHIPPED_PREFIX
    from specjax.io import shipped

    return shipped.load_shipped_drafter(spec[len(SHIPPED_PREFIX):], target, dtype=dtype)


_IO_LOADERS = {"default": _load_shipped, "shipped": _load_named_shipped, "model": _load_draft_model}


def load_drafter(spec: str | None, target: Model, dtype: str = "float32"):
    """Build a drafter from a ``--draft`` value (its kind: :mod:`specjax.drafters.registry`).

    Args:
      spec: ``None``/``"none"`` (no drafter), ``"ngram"`` or ``"ngram:N"`` (prompt lookup,
        n-grams up to N), ``"default"`` (the trained drafter shipped for the default
        model), ``"shipped:NAME"`` (any drafter shipped under ``models/``), a drafter directory written by ``specjax distill`` (``drafter.json``), a
        published EAGLE-3 head directory (:mod:`specjax.drafters.eagle3_head`), or a
        checkpoint path / hub id of a draft model with the target's tokenizer.
      target: the loaded target model (its tokenizer and vocab are checked).

    Raises:
      ValueError: an unknown spec (names the accepted values).
      CheckpointError: a drafter whose tokenizer differs, or real tokens beyond the target vocab.
    """
    kind = _checked_kind(spec)
    if kind is None:
        return None
    load = kind.load if kind.load is not None else _IO_LOADERS[kind.name]
    return load(spec, target, dtype)


def encode_prompts(target: Model, texts: Sequence[str], chat: bool, parse_special: bool = True,
                   chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of each text (with the model's chat template when ``chat``).

    Args:
      target: a model with a tokenizer (only ``target.tokenizer`` and ``target.name`` are read).
      texts: the prompts (non-empty strings).
      chat: render each text as one user message with the chat template.
      parse_special: ``True`` (default, as before): special-token strings typed in a text
        (``<|im_start|>``, ``<|endoftext|>``, …) become control ids. ``False``: the texts are
        tokenized as plain text; with ``chat`` only the template's own special tokens become
        control ids (:meth:`specjax.io.tokenizer.Tokenizer.encode_chat`). Ordinary text
        gets the same ids either way.
      chat_template_kwargs: extra variables for the chat template (needs ``chat``), e.g. Qwen3's
        ``{"enable_thinking": False}`` (:meth:`specjax.io.tokenizer.Tokenizer.apply_chat_template`).

    Returns:
      ``list[list[int]]``: one id list per text.

    Raises:
      CheckpointError: the model has no tokenizer.
      ValueError: an empty prompt; ``chat`` without a chat template; ``chat_template_kwargs`` without
        ``chat``, not a dict with string keys, or naming a variable specjax sets.
    """
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
            raise ValueError("chat_template_kwargs must be a dict with string keys, e.g. {\"enable_thinking\": false}")
        if not chat:
            raise ValueError("chat_template_kwargs needs the chat template (chat=True / --chat)")
    tok = target.tokenizer
    if tok is None:
        raise CheckpointError(f"{target.name} has no tokenizer; pass token ids to specjax.runtime.decoder.generate instead")
    if not isinstance(chat, (bool, int)) or isinstance(chat, str):  # chat="no" would be truthy
        raise ValueError(f"chat must be True or False, got {chat!r}")
    if isinstance(texts, str):
        raise ValueError("prompts must be a list of texts, got one string; wrap it: [text]")
    ids = []
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ValueError(f"prompt {i} is {type(t).__name__}, not text; pass texts here "
                             "(token ids go to specjax.Decoder(...).generate)")
        if not t.strip():
            raise ValueError(f"prompt {i} is empty; give a non-empty prompt")
        ids.append(tok.encode_chat(t, parse_special=parse_special, template_kwargs=chat_template_kwargs) if chat
                   else tok.encode(t, parse_special=parse_special))
    return ids


def stop_cut(tokenizer, ids: Sequence[int], stop: Sequence[str]) -> int | None:
    """The number of tokens to keep when a stop string occurs in ``decode(ids)``: the shortest
    prefix of ``ids`` whose text contains one (the token that completes the stop string is
    kept; the text is cut before the string by :class:`TextStream`), or ``None``."""
    if not stop or not any(s in tokenizer.decode(ids) for s in stop):
        return None
    lo, hi = 1, len(ids)  # decode(ids[:hi]) contains a stop string; find the smallest such prefix
    while lo < hi:
        mid = (lo + hi) // 2
        text = tokenizer.decode(ids[:mid])
        if any(s in text for s in stop):
            hi = mid
        else:
            lo = mid + 1
    return lo


class TextStream:
    """Incremental detokenization of one row: :meth:`feed` new token ids, get the text that is
    safe to show. Never returns half of a multi-byte UTF-8 character (a trailing U+FFFD is
    held back until the next token completes it), holds back a tail that could be the start
    of a stop string, and cuts the text before the first stop string."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.shown = 0  # characters returned so far

    def text(self, final: bool = False) -> str:
        """The text of the ids fed so far, cut before a stop string (``final``: nothing held back)."""
        text = self.tokenizer.decode(self.ids)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            return text[: min(cuts)]
        if final:
            return text
        safe = len(text) - self.hold
        while safe > 0 and text[safe - 1] == "\ufffd":
            safe -= 1
        return text[: max(safe, 0)]

    def feed(self, ids: Sequence[int], final: bool = False) -> str:
        """Add ``ids``; return the newly showable text (all the rest when ``final``)."""
        self.ids.extend(int(i) for i in ids)
        text = self.text(final)
        piece = text[self.shown:]
        self.shown = max(self.shown, len(text))
        return piece


def _text_callback(on_text, streams: list[TextStream], first: int):
    """A ``Decoder.generate`` ``on_chunk`` that feeds each row's new ids to its :class:`TextStream`
    and passes the showable text on as ``on_text(first + row, piece)``."""
    def on_chunk(newly):
        for j, new in enumerate(newly):
            piece = streams[j].feed(new)
            if piece:
                on_text(first + j, piece)
    return on_chunk


def logprob_records(tokenizer, rows):
    """JSON-ready log-probabilities: per token ``{"token", "id", "logprob", "top_logprobs"}``."""
    piece = lambda i: tokenizer.decode([i], skip_special_tokens=False)  # noqa: E731
    return [{"token": piece(r["id"]), "id": r["id"], "logprob": r["logprob"],
             "top_logprobs": [{"token": piece(j), "id": j, "logprob": v} for j, v in r["top"]]} for r in rows]


def generate_text(
    target: Model,
    prompts: Sequence[str],
    *,
    request: Request | None = None,
    drafter=None,
    gamma: int = 4,
    tree_nodes: int | None = None, tree_depth: int | None = None, tree_topk: int | None = None,
    chat: bool = False,
    chat_template_kwargs: dict | None = None,
    decoder: Decoder | None = None,
    on_text=None, on_done=None, progress=None,
    parse_special: bool = True,
    settings: DecodeSettings | None = None,
    sampling: Sampling | None = None,
    **fields: Any,
) -> list[dict]:
    """Generate text for each prompt. Returns one dict per prompt:
    ``{"text", "tokens", "stats"}`` (and ``"logprobs"`` when asked) where ``stats`` has
    ``new_tokens``, ``prefill_s``, ``decode_s``, ``compile_s`` (seconds, for the prompt's batch),
    ``tokens_per_s`` (the prompt's new tokens ÷ its batch's decode seconds; ``None`` without decode
    time) and the speculative counters of :class:`specjax.runtime.decoder.GenerationResult`.

    The request: ``request=`` a :class:`~specjax.runtime.request.Request` (or a
    :class:`~specjax.runtime.settings.DecodeSettings`, a request with a ``batch_size``; ``settings=``
    is the same argument under its older name), or — the thin keyword form — its declared fields as
    keywords (``max_new_tokens``, ``seed``, ``ignore_eos``, ``stop``, ``stop_token_ids``, ``logprobs``,
    … : each field's default and range are the declaration's), ``batch_size``, and the sampling as
    ``sampling=`` (a :class:`~specjax.core.sampling.Sampling`) or as its fields (``temperature``,
    ``top_k``, ``top_p``, ``min_p``, the penalties, ``min_tokens``, ``logit_bias`` — a dict ``{token
    id: bias}``). Give one form: a request together with a keyword that is not its default is refused.

    Args:
      tree_nodes, tree_depth, tree_topk: draft trees of N nodes, depth D and at most K children per
        node instead of chains of ``gamma`` drafts (all three or none; see ``Decoder``).
      stop (a request field): strings that end a row when its decoded text contains one: the text is
        cut before it, ``tokens`` end with the token that completed it, ``finish_reason`` is
        ``"stop"``, and nothing after it is emitted or counted (exact with speculative
        decoding: a stop string completed inside an accepted block ends the row there).
      stop_token_ids (a request field): ids that end a row (``finish_reason`` ``"stop"``): one list for
        all prompts or, as a keyword, one list per prompt.
      logprobs (a request field): ``None`` (off) or N ≥ 0: per emitted token its log-probability and
        the top N alternatives (:class:`specjax.runtime.decoder.Logprobs`), as ``"logprobs"``: a list of
        ``{"token", "id", "logprob", "top_logprobs": [{"token", "id", "logprob"}]}``.
      on_text: ``on_text(i, piece)`` is called with prompt i's text as it is generated
        (incremental detokenization per chunk of rounds; the pieces add up to ``text``).
      on_done: ``on_done(i, result)`` is called with prompt i's result dict as soon as its
        batch has finished (before later batches run).
      progress: a :class:`specjax.runtime.progress.Progress` for phase lines (compiles), or ``None``.
      parse_special, chat_template_kwargs: how prompts are tokenized (special-token strings as control
        ids, default ``True``; extra chat-template variables such as Qwen3's ``{"enable_thinking":
        False}``), see :func:`encode_prompts`. Prompt i uses request key ``fold_in(seed_key(seed), i)``,
        whatever its batch.

    Raises:
      ValueError: ``prompts`` or ``stop`` given as one string instead of a list, an empty prompt
        or stop string, a field out of its declared range (a
        :class:`~specjax.core.settings.SettingError` naming it), bad stop ids, or a request together
        with a keyword that is not its default.
      TypeError: an unknown keyword (names the declared fields).
    """
    if request is not None and settings is not None:
        raise ValueError("pass the request either as request= or as settings= (its older name), not both")
    per_row_ids = fields.get("stop_token_ids")
    per_row = isinstance(per_row_ids, (list, tuple)) and len(per_row_ids) > 0 and all(
        isinstance(x, (list, tuple)) for x in per_row_ids)
    if per_row:
        fields.pop("stop_token_ids")
    _check_text_args(prompts, fields.get("stop"))
    settings = decode_settings(request if request is not None else settings, sampling, **fields)
    stop = list(settings.stop)
    ids = encode_prompts(target, prompts, chat, parse_special=parse_special, chat_template_kwargs=chat_template_kwargs)
    dec = decoder or Decoder(target, drafter, gamma, progress=progress, tree_nodes=tree_nodes, tree_depth=tree_depth,
                             tree_topk=tree_topk)
    results = []
    for rows in settings.batches(len(ids)):
        stop_ids = per_row_ids[rows.start:rows.stop] if per_row else (list(settings.stop_token_ids) or None)
        results += _generate_batch(dec, target.tokenizer, ids, rows, settings, stop, stop_ids, settings.logprobs,
                                   on_text, on_done)
    return results


def _check_text_args(prompts, stop) -> None:
    """Refuse a lone string where a list is expected.

    Raises:
      ValueError: ``prompts`` or ``stop`` given as one string."""
    if isinstance(prompts, str):
        raise ValueError(f"prompts must be a list of strings, got one string; pass [{prompts[:20]!r}]")
    if isinstance(stop, str):
        raise ValueError(f"stop must be a list of strings, got one string; pass [{stop!r}]")


def _generate_batch(dec, tok, ids, rows: range, settings: DecodeSettings, stop, stop_ids, logprobs, on_text,
                    on_done) -> list[dict]:
    """:func:`generate_text` for the prompts ``ids[rows]`` decoded as one batch."""
    chunk = ids[rows.start:rows.stop]
    streams = [TextStream(tok, stop) for _ in chunk]
    stop_fn = (lambda i, toks: stop_cut(tok, toks, stop)) if stop else None
    on_chunk = None if on_text is None else _text_callback(on_text, streams, rows.start)
    r = dec.generate(chunk, max_new_tokens=settings.max_new_tokens, sampling=settings.params(len(chunk)),
                     seed=settings.seed, seed_offset=rows.start, eos_ids=settings.eos_ids(), stop_fn=stop_fn,
                     on_chunk=on_chunk, logprobs=logprobs, stop_token_ids=stop_ids)
    out = []
    for j in range(len(chunk)):
        res = _row_result(tok, stop, r, j)
        if on_text is not None:
            rest = streams[j].feed([], final=True)
            if rest:
                on_text(rows.start + j, rest)
        out.append(res)
        if on_done is not None:
            on_done(rows.start + j, res)
    return out


def decode_settings(request: Request | None = None, sampling: Sampling | None = None, **kw) -> DecodeSettings:
    """The :class:`DecodeSettings` of :func:`generate_text`: ``request`` (a batch size added when it is
    a plain :class:`Request`), or one built from the keywords ``kw`` — the declared request fields,
    ``batch_size`` and the sampling fields — (and a whole ``sampling``).

    Raises:
      ValueError: a keyword out of range, or a request with a keyword that is not its default.
      TypeError: an unknown keyword (names the declared fields).
    """
    names = {n for n, _, _ in knobs(sampling_mod.Sampling)}
    own = field_names() | {"batch_size"}
    unknown = sorted(k for k in kw if k not in names and k not in own)
    if unknown:
        raise TypeError(f"generate_text() got unknown keyword(s) {unknown}; request fields: {sorted(own)}; "
                        f"sampling settings: {sorted(names)}")
    default = DecodeSettings()  # its defaults are the declaration's: generate_text's keyword defaults
    if sampling is not None:
        if not isinstance(sampling, sampling_mod.Sampling):
            raise ValueError(f"sampling must be a specjax.Sampling, got {type(sampling).__name__}")
        given = sorted(k for k in names if k in kw and kw[k] != getattr(default, k))
        if given:
            raise ValueError(f"pass the sampling settings either as sampling= or as keywords, not both "
                             f"(got sampling and {', '.join(given)})")
        kw = {k: v for k, v in kw.items() if k not in names}
        kw["sampling"] = sampling
    if request is None:
        return DecodeSettings.create(**kw)
    if not isinstance(request, (Request, DecodeSettings)):
        raise ValueError(f"request must be a specjax Request, got {type(request).__name__}")
    given = sorted(k for k, v in kw.items() if v != getattr(default, k))
    if given:
        raise ValueError(f"pass the request either as request= or as keywords, not both "
                         f"(got request and {', '.join(given)})")
    return request if isinstance(request, DecodeSettings) else DecodeSettings(request=request)


def _row_result(tok, stop, r, j: int) -> dict:
    """:func:`generate_text`'s dict for row ``j`` of a batch's GenerationResult ``r``: the text
    (cut before a stop string), tokens, stats with the batch's seconds and the row's tokens/s."""
    toks = r.tokens[j]
    tps = RunStats.from_batch([dict(r.stats[j], new_tokens=len(toks))], decode_s=r.decode_s).tokens_per_s
    st = dict(r.stats[j], prefill_s=r.prefill_s, decode_s=r.decode_s, compile_s=r.compile_s,
              tokens_per_s=tps, batch_size=len(r.tokens))
    text = TextStream(tok, stop)
    text.feed(toks)
    out = {"text": text.text(final=True), "tokens": toks, "stats": st}
    if r.logprobs is not None:
        out["logprobs"] = logprob_records(tok, r.logprobs[j])
    return out


def load_pair_config(name_or_path: str) -> dict[str, Any]:
    """Read a target/drafter pair config (TOML): a path, or the name of a shipped config
    (``configs/NAME.toml``). Keys: ``model``, ``draft``, ``gamma``, ``tree_nodes``, ``tree_depth``,
    ``tree_topk`` (a draft tree instead of ``gamma``: all three together), every field of
    :class:`~specjax.core.sampling.Sampling` (``temperature``, ``top_k``, ``top_p``, ``min_p``, the
    penalties, ``min_tokens``, ``logit_bias`` as a table), every declared request field that is a
    config key (:class:`~specjax.runtime.request.Request`: ``max_new_tokens``, ``ignore_eos``,
    ``seed``, ``stop`` as a list, ``stop_token_ids``, ``logprobs``), ``dtype`` (a weight format or ``"auto"``), ``draft_dtype``, ``chat``,
    ``parse_special``, ``description``.

    Raises:
      ValueError: file not found (lists the shipped configs), unknown keys, a value of the wrong
        type, or an incomplete tree / a tree with ``gamma``.
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
        path = str(cand)
    if os.path.isdir(path):
        raise ValueError(f"--config {path} is a directory; give a .toml file or a shipped config name")
    text = read_utf8(path, ValueError, "save the config as UTF-8")
    try:
        cfg = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML ({e}); fix the syntax") from None
    types = config_types()
    allowed = set(types)
    unknown = set(cfg) - allowed
    if unknown:
        raise ValueError(f"config {name_or_path!r}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    for key, value in cfg.items():
        check = types[key]
        if not check[0](value):
            raise ValueError(f"{path}: key {key!r} must be {check[1]}, got {type(value).__name__} {value!r}")
    try:  # the declared ranges of the sampling keys
        sampling_mod.Sampling(**{k: cfg[k] for k in allowed & set(cfg) if k in {n for n, _, _ in knobs(sampling_mod.Sampling)}})
    except SettingError as e:
        raise ValueError(f"{path}: key {e.name!r}: {e}") from None
    try:  # the declared ranges of the request keys (cross-field rules: when the request is built)
        request_class()(**{k: cfg[k] for k in field_names() & set(cfg)})
    except SettingError as e:
        raise ValueError(f"{path}: key {e.name!r}: {e}") from None
    tree = [k for k in TREE_KEYS if k in cfg]
    if tree:
        missing = [k for k in TREE_KEYS if k not in cfg]
        if missing:
            raise ValueError(f"{path}: a draft tree needs {', '.join(TREE_KEYS)} together; missing {', '.join(missing)}")
        if "gamma" in cfg:
            raise ValueError(f"{path}: gamma and {', '.join(TREE_KEYS)} are alternatives (a tree's depth is its "
                             "gamma); keep one")
        try:
            TreeShape(cfg["tree_nodes"], cfg["tree_depth"], cfg["tree_topk"])
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return cfg


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _str_or_strs(v) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v))


def _gamma_ok(v) -> bool:
    ok = lambda g: (_is_int(g) and g >= 1) or g == "auto"  # noqa: E731
    return ok(v) or (isinstance(v, list) and bool(v) and all(_is_int(g) and g >= 1 for g in v))


TREE_KEYS = ("tree_nodes", "tree_depth", "tree_topk")
_DTYPES = ("float32", "bfloat16", "int8")
_CONFIG_TYPES = {  # key: (check, expected type as the error says it)
    "model": (lambda v: isinstance(v, str), "a string (a .gguf path, model directory or hub id)"),
    "draft": (_str_or_strs, "a string (none, ngram[:N], default, a drafter path) or a list of them"),
    "gamma": (_gamma_ok, "an integer >= 1, \"auto\", or a list of integers >= 1"),
    "dtype": (lambda v: v in (*_DTYPES, "auto"), f"one of {', '.join(_DTYPES)}, auto"),
    "draft_dtype": (lambda v: v in _DTYPES, f"one of {', '.join(_DTYPES)}"),
    "chat": (lambda v: isinstance(v, bool), "true or false"),
    "parse_special": (lambda v: isinstance(v, bool), "true or false"),
    "description": (lambda v: isinstance(v, str), "a string"),
    **{k: (lambda v: _is_int(v) and v >= 1, "an integer >= 1") for k in TREE_KEYS},
}


_KIND_WORDS = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}


def config_types() -> dict:
    """Every pair-config key: ``{key: (type check, expected type in words)}`` — the fixed keys and
    one per declared sampling field (:class:`~specjax.core.sampling.Sampling`; a TOML table for
    ``logit_bias``)."""
    from specjax.runtime.request import config_key_ok, declared

    out = dict(_CONFIG_TYPES)
    for name, k, _ in declared():  # every declared request field that is a config key
        if k.config:
            out[name] = (lambda v, k=k: config_key_ok(k, v), f"{'a list' if k.kind is tuple else _KIND_WORDS[k.kind]}"
                                                             f" ({k.expect})")
    for name, k, _ in knobs(sampling_mod.Sampling):
        kind = {float: (_is_num, "a number"), int: (_is_int, "an integer"), bool: (lambda v: isinstance(v, bool),
                "true or false"), str: (lambda v: isinstance(v, str), "a string"),
                tuple: (lambda v: isinstance(v, dict), "a table {\"id\" = bias}")}[k.kind]
        out[name] = (kind[0], f"{kind[1]} ({k.expect})")
    return out
