"""The OpenAI request and response bodies of ``specjax serve``, in pure Python (no web framework).

Requests: :func:`parse_json` (the body bytes → a dict), :func:`parse_completion` (``POST
/v1/completions``), :func:`parse_chat` (``POST /v1/chat/completions``) and :func:`parse_tokenize`
(``POST /tokenize``) turn a body into a validated :class:`GenerationRequest` (or token ids). Every
problem raises :class:`RequestError`: the HTTP status and an OpenAI-style error body ``{"error":
{"message", "type", "param", "code"}}`` whose message names the field and the fix. The sampling
fields are those declared by :class:`~specjax.core.sampling.Sampling` (their ranges and messages
are its own); a field not given takes the server's setting (:class:`ServeDefaults`: the
``--temperature`` etc. flags or the pair config, as ``specjax generate``).

Responses: :func:`completion_body`, :func:`chat_body` and the stream chunks
(:func:`completion_chunk`, :func:`chat_chunk`), with the extension field ``"specjax"``
(:func:`speculative_counters`): the request's speculative counters and its seed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from specjax.core import sampling as sampling_mod
from specjax.core.sampling import Sampling  # (annotations and the default; code reads sampling_mod.Sampling: the declaration)
from specjax.core.settings import SettingError, is_int, knobs, of_kind
from specjax.runtime.engine import ENGINE_STOP_IDS
from specjax.runtime.request import MAX_STOP, declared, request_class

MAX_STOP_TOKEN_IDS = ENGINE_STOP_IDS  # at most (the engine also holds the model's EOS ids in these slots)

# Fields the official client may send that change nothing here (accepted, ignored).
HARMLESS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options")
# Fields that would change the result and are not supported: HTTP 400 when given (not null / default).
UNSUPPORTED = {
    "tools": "tool calls", "tool_choice": "tool calls", "functions": "function calls",
    "function_call": "function calls", "response_format": "structured output", "audio": "audio output",
    "modalities": "output modalities other than text", "prediction": "predicted outputs",
    "best_of": "best_of > 1", "echo": "echo", "suffix": "suffix (insertion)", "reasoning_effort": "reasoning effort",
    "web_search_options": "web search",
}
_UNSUPPORTED_DEFAULTS = {"best_of": (1,), "echo": (False,), "suffix": ("",), "response_format": ({"type": "text"},)}


class RequestError(Exception):
    """A request that cannot be served: ``status`` (400 by default) and the OpenAI error fields.

    ``message``: one line naming the problem and the fix; ``param``: the request field (or
    ``None``); ``code``: a short machine-readable code (or ``None``); ``headers``: extra response
    headers (``Retry-After`` with 429)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type
        self.headers = dict(headers or {})

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def server_request():
    """The request defaults of a server started without flags: the declaration's
    (:class:`~specjax.runtime.request.Request`), but no seed (a request without one draws a random
    seed and gets it back, as OpenAI's API samples without a fixed seed)."""
    return request_class()(seed=None)


@dataclasses.dataclass(frozen=True)
class ServeDefaults:
    """The server's settings that requests are checked against and fall back to (frozen).

    model_name: the id ``/v1/models`` lists; a request's ``model`` must be it.
    context_limit: tokens one request may hold (prompt + new; ``Engine.context_limit``).
    vocab_size: the target's vocabulary (token ids are in ``[0, vocab_size)``).
    request: the :class:`~specjax.runtime.request.Request` whose fields a request's missing fields
      take (``--max-new-tokens``, ``--temperature`` etc., ``--ignore-eos`` or the pair config; the
      declaration's defaults otherwise, without a seed: :func:`server_request`).
    parse_special: special-token strings in prompt text become control ids (``--no-parse-special``: not).
    max_logprobs: the most alternatives per token (``top_logprobs`` / completions ``logprobs``), 20.
    chat: whether the model has a chat template (``/v1/chat/completions`` needs one).
    """

    model_name: str
    context_limit: int
    vocab_size: int
    request: Any = dataclasses.field(default_factory=server_request)
    parse_special: bool = True
    max_logprobs: int = 20
    chat: bool = True

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens

    @property
    def sampling(self) -> Sampling:
        return self.request.sampling


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One validated HTTP generation request (frozen): the endpoint's ``kind`` (``"chat"`` or
    ``"completion"``), the :class:`~specjax.runtime.request.Request` the engine decodes (its prompt
    the token ids — chat: rendered with the chat template; its declared fields read from the body
    under their HTTP names, the server's :attr:`ServeDefaults.request` where missing), and how the
    answer is sent (``stream``, ``include_usage``: server-sent events, and a usage chunk at the end).
    The request's fields also read as attributes (``req.max_new_tokens``, ``req.sampling``)."""

    kind: str
    request: Any
    stream: bool = False
    include_usage: bool = False

    @property
    def prompt_ids(self) -> tuple:
        return self.request.prompt

    def __getattr__(self, name):
        if name in ("request", "kind", "stream", "include_usage"):
            raise AttributeError(name)
        return getattr(self.request, name)


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object.

    Raises:
      RequestError: not UTF-8, not valid JSON, or not an object."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError("the request body is not UTF-8; send a UTF-8 JSON object", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON ({e.msg} at character {e.pos}); send a JSON object",
                           code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _sampling_fields() -> dict:
    """Every declared sampling field (:class:`~specjax.core.sampling.Sampling`, looked up when used):
    each is a request field of the same name."""
    return {name: k for name, k, _ in knobs(sampling_mod.Sampling)}


def http_name(name: str, k) -> str:
    """A declared request field's name in an HTTP body (``Knob.http``, else its own)."""
    return k.http or name


def _common_fields() -> tuple:
    """The body fields of both endpoints: ``model``, ``stream`` and every declared request field
    under its HTTP name (:class:`~specjax.runtime.request.Request`, looked up when used)."""
    return ("model", "stream", *(http_name(n, k) for n, k, _ in declared()))


def completion_fields() -> tuple:
    return (*_common_fields(), "prompt")


def chat_fields() -> tuple:
    return (*_common_fields(), "messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs")


def _check_fields(body: dict, allowed: tuple, where: str) -> None:
    """Unknown fields and unsupported features → RequestError."""
    sampling = set(_sampling_fields())
    for name, value in body.items():
        if name in UNSUPPORTED:
            if value is None or value in _UNSUPPORTED_DEFAULTS.get(name, ()) or (name in ("tools", "functions")
                                                                                  and value == []):
                continue
            raise RequestError(f"'{name}' is not supported by specjax serve ({UNSUPPORTED[name]}); remove it",
                               param=name, code="unsupported_parameter")
        if name in allowed or name in sampling or name in HARMLESS:
            continue
        supported = sorted({*allowed, *sampling, *HARMLESS})
        raise RequestError(f"unknown field '{name}' for {where}; supported: {', '.join(supported)}", param=name,
                           code="unknown_parameter")
    opts = body.get("stream_options")
    if opts is not None and body.get("stream") is not True:
        raise RequestError("'stream_options' needs 'stream': true (it sets what a stream sends); drop it or stream",
                           param="stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or any(k not in ("include_usage", "include_obfuscation") for k in opts):
            raise RequestError(f"'stream_options' must be an object {{\"include_usage\": true|false}}, got {opts!r}",
                               param="stream_options")
        if not isinstance(opts.get("include_usage", False), bool):
            raise RequestError("'stream_options.include_usage' must be true or false", param="stream_options")
    if "model" not in body:
        raise RequestError("'model' is required; give the id that GET /v1/models lists", param="model")


def _int(body: dict, name: str, lo: int, hi: int | None = None, default=None, fix: str = ""):
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise RequestError(f"'{name}' must be {rng}, got {v!r}{fix}", param=name)
    return int(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be true or false, got {v!r}", param=name)
    return v


def _sampling(body: dict, d: ServeDefaults) -> Sampling:
    """The request's :class:`Sampling`: its given fields over the server's (``d.sampling``), validated by
    Sampling itself (a field of the wrong kind: the declared range in words)."""
    fields = _sampling_fields()
    given = {}
    for name, k in fields.items():
        v = body.get(name)
        if v is None:
            continue
        if name == "logit_bias":
            v = _logit_bias(v, d)
        elif not of_kind(k.kind, v):
            raise RequestError(f"'{name}' must be {k.expect}, got {v!r}", param=name)
        given[name] = v
    try:
        return dataclasses.replace(d.sampling, **given)
    except SettingError as e:
        raise RequestError(f"'{e.name}': {e}", param=e.name) from None


def _logit_bias(v, d: ServeDefaults) -> dict:
    """OpenAI's ``{"token id": bias}`` → ``{id: bias}`` with ids in the vocabulary."""
    if not isinstance(v, dict):
        raise RequestError(f"'logit_bias' must be an object {{\"token id\": bias}}, got {v!r}", param="logit_bias")
    out = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and key.strip().isdigit()):
            raise RequestError(f"'logit_bias' keys must be token ids (digit strings), got {key!r}", param="logit_bias")
        tid = int(key)
        if tid >= d.vocab_size:
            raise RequestError(f"'logit_bias' names token id {tid}, outside the vocabulary [0, {d.vocab_size})",
                               param="logit_bias")
        if not of_kind(float, bias):
            raise RequestError(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}", param="logit_bias")
        out[tid] = float(bias)
    return out


def _token_ids(v, name: str, d: ServeDefaults, limit: int | None = None) -> tuple:
    if not isinstance(v, list) or not all(is_int(x) and 0 <= x < d.vocab_size for x in v):
        raise RequestError(f"'{name}' must be a list of token ids in [0, {d.vocab_size}), got {v!r}", param=name)
    if limit is not None and len(v) > limit:
        raise RequestError(f"'{name}' has {len(v)} ids; give at most {limit}", param=name)
    return tuple(int(x) for x in v)


def _stop(body: dict) -> tuple:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop' must be a non-empty string or a list of them, got {v!r}", param="stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"'stop' has {len(stops)} strings; give at most {MAX_STOP}", param="stop")
    return tuple(stops)


def _check_model(body: dict, d: ServeDefaults) -> None:
    m = body.get("model")
    if not isinstance(m, str):
        raise RequestError(f"'model' must be a string (the id GET /v1/models lists: {d.model_name!r}), got {m!r}",
                           param="model")
    if m != d.model_name:
        raise RequestError(f"the model {m!r} does not exist here; this server serves {d.model_name!r}", param="model",
                           code="model_not_found", status=404)


def _check_prompt_length(ids, d: ServeDefaults, param: str) -> None:
    if not ids:
        raise RequestError(f"'{param}' is empty; give a non-empty prompt", param=param)
    if len(ids) + 1 > d.context_limit:
        raise RequestError(f"the prompt has {len(ids)} tokens and the context holds {d.context_limit} (the prompt and "
                           "at least one new token); shorten the prompt", param=param, code="context_length_exceeded")


def _check_total_length(ids, max_new: int | None, d: ServeDefaults, param: str) -> None:
    """A ``max_tokens`` the request gave that does not fit the context beside its prompt is a 400 (as
    vLLM and OpenAI answer), said before any work; the default (``--max-new-tokens``) is capped instead."""
    if max_new is not None and len(ids) + max_new > d.context_limit:
        raise RequestError(f"the context holds {d.context_limit} tokens, but this request asks for "
                           f"{len(ids) + max_new} ({len(ids)} in the prompt, {max_new} in '{param}'); use "
                           f"'{param}' ≤ {d.context_limit - len(ids)} or a shorter prompt", param=param,
                           code="context_length_exceeded")


# declared request fields whose HTTP form the endpoints read themselves (the rest: _declared_fields)
_OWN_FORM = ("max_new_tokens", "logprobs", "stop", "stop_token_ids")


def _declared_fields(body: dict) -> dict:
    """Every declared request field given in the body (under its HTTP name) that has no form of its
    own (:data:`_OWN_FORM`), checked against its declared kind (its range: when the request is built)."""
    out = {}
    for name, k, _ in declared():
        v = body.get(http_name(name, k))
        if name in _OWN_FORM or v is None:
            continue
        if (k.kind is tuple and not isinstance(v, list)) or (k.kind is not tuple and not of_kind(k.kind, v)):
            raise RequestError(f"'{http_name(name, k)}' must be {k.expect}, got {v!r}"[:300], param=http_name(name, k))
        out[name] = v
    return out


def _common(body: dict, d: ServeDefaults, kind: str, ids: tuple, max_new: int, logprobs: int | None) -> GenerationRequest:
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options") or {}
    fields = dict(_declared_fields(body), max_new_tokens=max_new, logprobs=logprobs, stop=_stop(body))
    if body.get("stop_token_ids") is not None:
        fields["stop_token_ids"] = _token_ids(body["stop_token_ids"], "stop_token_ids", d, MAX_STOP_TOKEN_IDS)
    try:
        req = d.request.replace(prompt=ids, sampling=_sampling(body, d), **fields)
    except SettingError as e:
        names = {n: http_name(n, k) for n, k, _ in declared()}
        msg = str(e)
        for n in sorted(names, key=len, reverse=True):
            msg = re.sub(rf"(?<![\w']){n}(?![\w])", names[n], msg)
        param = names.get(e.name, e.name)
        raise RequestError(f"'{param}': {msg}", param=param) from None
    return GenerationRequest(kind=kind, request=req, stream=stream,
                             include_usage=stream and bool(opts.get("include_usage", False)))


def parse_completion(body: dict, tokenizer, d: ServeDefaults) -> GenerationRequest:
    """``POST /v1/completions``: ``prompt`` is raw text (no chat template, like ``specjax generate
    --no-chat``), a list of one text, or a list of token ids; ``logprobs`` an integer in [0, 20].

    Raises:
      RequestError: any field of the wrong type or out of range, an unknown or unsupported field,
        several prompts, an empty prompt or one longer than the context, a ``max_tokens`` that does not fit
        the context beside the prompt (``context_length_exceeded``)."""
    _check_fields(body, completion_fields(), "/v1/completions")
    _check_model(body, d)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p.strip():
            raise RequestError("'prompt' is empty; give a non-empty prompt", param="prompt")
        ids = tuple(tokenizer.encode(p, parse_special=d.parse_special))
    elif isinstance(p, list) and p and all(is_int(x) for x in p):
        ids = _token_ids(p, "prompt", d)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise RequestError(f"'prompt' holds {len(p)} prompts; send one request per prompt", param="prompt",
                           code="unsupported_parameter")
    else:
        raise RequestError(f"'prompt' must be a string (or a list of token ids), got {p!r}"[:300], param="prompt")
    _check_prompt_length(ids, d, "prompt")
    max_new = _int(body, "max_tokens", 1)
    _check_total_length(ids, max_new, d, "max_tokens")
    max_new = d.max_new_tokens if max_new is None else max_new
    logprobs = _int(body, "logprobs", 0, d.max_logprobs)
    return _common(body, d, "completion", ids, max_new, logprobs)


_ROLES = ("system", "developer", "user", "assistant")


def chat_messages(v) -> list[dict]:
    """``messages`` as ``[{"role", "content": str}]`` (text parts joined; ``developer`` is ``system``).

    Raises:
      RequestError: not a non-empty list of messages with a known role and text content."""
    if not isinstance(v, list) or not v:
        raise RequestError("'messages' must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be an object {{\"role\", \"content\"}}, got {m!r}"[:300], param=where)
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise RequestError(f"'{where}' has unsupported field(s) {', '.join(extra)} (tool calls and other "
                               "non-text content are not supported); send role and content", param=where)
        role = m.get("role")
        if role not in _ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", param=where)
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise RequestError(f"'{where}.content' parts must be text parts {{\"type\": \"text\", \"text\": ...}}"
                                   " (images and audio are not supported)", param=where)
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise RequestError(f"'{where}.content' must be a string or a list of text parts, got {content!r}"[:300],
                               param=where)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise RequestError("'messages' are all empty; give a non-empty message", param="messages")
    return out


def encode_chat(tokenizer, messages: list[dict], d: ServeDefaults, template_kwargs=None) -> tuple:
    """The chat template's token ids of ``messages`` (as ``specjax generate``'s default: the model's
    template with the generation prompt).

    Raises:
      RequestError: no chat template, or the template refuses the messages."""
    if not d.chat:
        raise RequestError("this model has no chat template; use POST /v1/completions with a raw text prompt",
                           param="messages")
    if template_kwargs is not None and (not isinstance(template_kwargs, dict)
                                        or not all(isinstance(k, str) for k in template_kwargs)):
        raise RequestError("'chat_template_kwargs' must be an object, e.g. {\"enable_thinking\": false}",
                           param="chat_template_kwargs")
    try:
        return tuple(tokenizer.encode_chat(messages, parse_special=d.parse_special, template_kwargs=template_kwargs))
    except ValueError as e:
        raise RequestError(" ".join(str(e).split()), param="messages") from None


def parse_chat(body: dict, tokenizer, d: ServeDefaults) -> GenerationRequest:
    """``POST /v1/chat/completions``: ``messages`` rendered with the chat template (``specjax
    generate``'s default); ``max_completion_tokens`` or ``max_tokens``; ``logprobs: true`` with
    ``top_logprobs`` in [0, 20].

    Raises:
      RequestError: as :func:`parse_completion`, and messages that are not text."""
    _check_fields(body, chat_fields(), "/v1/chat/completions")
    _check_model(body, d)
    ids = encode_chat(tokenizer, chat_messages(body.get("messages")), d, body.get("chat_template_kwargs"))
    _check_prompt_length(ids, d, "messages")
    a = _int(body, "max_completion_tokens", 1)
    b = _int(body, "max_tokens", 1)
    if a is not None and b is not None and a != b:
        raise RequestError(f"'max_completion_tokens' ({a}) and 'max_tokens' ({b}) differ; give one",
                           param="max_completion_tokens")
    _check_total_length(ids, a if a is not None else b, d, "max_completion_tokens" if a is not None else "max_tokens")
    max_new = a if a is not None else b if b is not None else d.max_new_tokens
    want = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, d.max_logprobs)
    if top is not None and not want:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return _common(body, d, "chat", ids, max_new, (top or 0) if want else None)


def parse_tokenize(body: dict, tokenizer, d: ServeDefaults) -> tuple:
    """``POST /tokenize``: ``{"prompt": text}`` (raw text, as /v1/completions) or ``{"messages":
    [...]}`` (the chat template, as /v1/chat/completions); ``model`` optional.

    Raises:
      RequestError: neither or both given, wrong types, an unknown model or field."""
    allowed = {"model", "prompt", "messages", "chat_template_kwargs"}
    extra = sorted(set(body) - allowed)
    if extra:
        raise RequestError(f"unknown field(s) {', '.join(extra)} for /tokenize; supported: {', '.join(sorted(allowed))}",
                           param=extra[0], code="unknown_parameter")
    if body.get("model") is not None:
        _check_model(body, d)
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("give either 'prompt' (raw text) or 'messages' (chat template)", param="prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str) or not body["prompt"]:
            raise RequestError(f"'prompt' must be a non-empty string, got {body['prompt']!r}"[:300], param="prompt")
        return tuple(tokenizer.encode(body["prompt"], parse_special=d.parse_special))
    return encode_chat(tokenizer, chat_messages(body["messages"]), d, body.get("chat_template_kwargs"))


# ---------------------------------------------------------------- responses

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # engine finish reason → OpenAI's


def speculative_counters(stats, seed: int) -> dict:
    """The extension field ``"specjax"``: the request's speculative counters (from its
    :class:`~specjax.runtime.results.RowStats`; ``None`` when the engine gave none) and its seed.

    ``target_calls`` (after prefill), ``draft_calls``, ``drafted_tokens``, ``accepted_tokens``,
    ``mean_accepted_tokens`` (τ: new tokens ÷ target calls, ``null`` without a target call),
    ``acceptance_rate`` (accepted ÷ checked drafts; ``null`` without a drafter), ``seed``."""
    keys = ("target_calls", "draft_calls", "drafted_tokens", "accepted_tokens", "mean_accepted_tokens",
            "acceptance_rate")
    out = {k: (None if stats is None else stats[k]) for k in keys}
    out["seed"] = int(seed)
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(records: list[dict]) -> dict:
    """Chat ``logprobs`` from :func:`specjax.api.logprob_records` records."""
    def item(r):
        return {"token": r["token"], "logprob": r["logprob"], "bytes": list(r["token"].encode("utf-8"))}
    return {"content": [dict(item(r), top_logprobs=[item(a) for a in r["top_logprobs"]]) for r in records]}


def completion_logprobs(records: list[dict], offset: int = 0) -> dict:
    """Completions ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``:
    each token's offset in the completion text, counting ``offset`` characters already sent)."""
    offsets, pos = [], offset
    for r in records:
        offsets.append(pos)
        pos += len(r["token"])
    return {"tokens": [r["token"] for r in records], "token_logprobs": [r["logprob"] for r in records],
            "top_logprobs": [{a["token"]: a["logprob"] for a in r["top_logprobs"]} for r in records],
            "text_offset": offsets}


def completion_body(rid: str, created: int, model: str, text: str, finish: str, records, use: dict,
                    ext: dict) -> dict:
    """The ``text_completion`` response."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish,
                         "logprobs": None if records is None else completion_logprobs(records)}],
            "usage": use, "specjax": ext}


def chat_body(rid: str, created: int, model: str, text: str, finish: str, records, use: dict, ext: dict) -> dict:
    """The ``chat.completion`` response."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         "logprobs": None if records is None else chat_logprobs(records)}],
            "usage": use, "specjax": ext}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None, records=None,
                     offset: int = 0, **extra: Any) -> dict:
    """One ``text_completion`` stream chunk (``extra``: ``usage``, ``specjax`` on the last)."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish,
                         "logprobs": None if records is None else completion_logprobs(records, offset)}], **extra}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None, records=None,
               **extra: Any) -> dict:
    """One ``chat.completion.chunk`` (``extra``: ``usage``, ``specjax`` on the last)."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                         "logprobs": None if records is None else chat_logprobs(records)}], **extra}


def usage_chunk(kind: str, rid: str, created: int, model: str, use: dict, ext: dict) -> dict:
    """The ``stream_options.include_usage`` chunk: no choices, the usage (and the extension field)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use, "specjax": ext}
