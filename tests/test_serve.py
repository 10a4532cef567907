"""``specjax serve`` (issue 31, the HTTP half): a live server on 127.0.0.1 driven by the official
``openai`` client — completions and chat, streaming or not, stop strings, log-probabilities, seeds
(equal to the offline run of the prompt alone with ``request_keys(seed, 1)``), the ``specjax``
counters, ``/v1/models``, ``/health``, ``/tokenize``, ``/metrics``; malformed requests (400 each,
the server alive after them), the API key (401) and a full queue (429); the CLI's own errors.

The server drives ``specjax.runtime.engine.Engine`` over a tiny random target (word-level
tokenizer) and a 1-layer early-exit draft model of it, γ = 3.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import serve_helpers as H
from specjax.api import TextStream, stop_cut
from specjax.core.sampling import Sampling

MODEL, CONTEXT, GAMMA, Pair, make_app = H.MODEL, H.CONTEXT, H.GAMMA, H.Pair, H.make_app


@pytest.fixture(scope="module")
def pair():
    return Pair()


@pytest.fixture(scope="module")
def server(pair):
    srv = H.ThreadServer(make_app(pair))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


PROMPT = "w5 w6 w7 w8 w5 w6 w7"
MESSAGES = [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "w5 w6 w7 w8 w5"}]


def test_models_health_tokenize(server, client, pair):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["slots"] == 4
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == pair.tok.encode(PROMPT) and r["count"] == 7 and r["max_model_len"] == CONTEXT
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert r["tokens"] == pair.tok.encode_chat(MESSAGES)


def test_completion_greedy_equals_offline_with_counters(client, pair):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16)
    ref = pair.offline(pair.tok.encode(PROMPT), 16)
    assert r.choices[0].text == pair.tok.decode(ref.tokens[0])
    assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[ref.stats[0]["finish_reason"]]
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == len(ref.tokens[0])
    ext = r.model_extra["specjax"]
    st = ref.stats[0]
    # the counters are the request's own: greedy speculation is exact, so they equal the alone run's
    for k in ("target_calls", "draft_calls", "drafted_tokens", "accepted_tokens"):
        assert ext[k] == st[k], k
    assert ext["mean_accepted_tokens"] == pytest.approx(r.usage.completion_tokens / ext["target_calls"])
    assert ext["acceptance_rate"] == pytest.approx(st["acceptance_rate"])
    assert 0 < ext["accepted_tokens"] <= ext["drafted_tokens"]  # the 1-layer drafter gets some right
    assert isinstance(ext["seed"], int)


def test_chat_stream_equals_whole_and_offline(client, pair):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=14)
    ref = pair.offline(pair.tok.encode_chat(MESSAGES), 14)
    assert whole.choices[0].message.content == pair.tok.decode(ref.tokens[0])
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=14, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["specjax"]["target_calls"] == whole.model_extra["specjax"]["target_calls"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"  # the role chunk, text chunks, the final chunk, usage
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1


def test_seed_reproducible_and_equal_to_offline(client, pair):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95, seed=123)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.model_extra["specjax"]["seed"] == 123
    ref = pair.offline(pair.tok.encode(PROMPT), 12, Sampling(temperature=0.9, top_p=0.95), seed=123)
    assert a.choices[0].text == pair.tok.decode(ref.tokens[0])
    c = client.completions.create(**dict(kw, seed=124))
    ref2 = pair.offline(pair.tok.encode(PROMPT), 12, Sampling(temperature=0.9, top_p=0.95), seed=124)
    assert c.choices[0].text == pair.tok.decode(ref2.tokens[0])
    assert ref.tokens[0] != ref2.tokens[0]  # the two seeds differ here (fixed seeds: this is deterministic)


def test_no_seed_draws_one_and_returns_it(client, pair):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0)
    a = client.completions.create(**kw)
    seed = a.model_extra["specjax"]["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2 ** 64
    b = client.completions.create(**kw, seed=seed)
    assert b.choices[0].text == a.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_and_cancels(client, pair, stream):
    ids = pair.tok.encode(PROMPT)
    ref = pair.offline(ids, 16).tokens[0]
    assert len(ref) >= 6
    word = pair.tok.decode([ref[4]])
    stop = " " + word  # the 5th token's word, with its leading space
    keep = stop_cut(pair.tok, ref, [stop])
    want = TextStream(pair.tok, [stop])
    want.feed(ref[:keep])
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, stop=[stop, "w999"])
    if stream:
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        used = chunks[-1].usage.completion_tokens
    else:
        r = client.completions.create(**kw)
        text, finish, used = r.choices[0].text, [r.choices[0].finish_reason], r.usage.completion_tokens
    assert text == want.text(final=True) and stop not in text and len(text) < len(pair.tok.decode(ref))
    assert finish == ["stop"] and used == keep


def test_logprobs_chat_and_completions(client, pair):
    ids = pair.tok.encode_chat(MESSAGES)
    ref = pair.offline(ids, 8, logprobs=3)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [pair.tok.decode([t], skip_special_tokens=False) for t in ref.tokens[0]]
    for c, want in zip(content, ref.logprobs[0]):
        assert c.logprob == pytest.approx(want["logprob"], abs=1e-4)
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert all(len(t) == 3 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)


def test_speculative_false_decodes_without_the_drafter(client, pair):
    on = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    off = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body={"speculative": False})
    assert off.choices[0].text == on.choices[0].text  # greedy speculation is exact
    ext = off.model_extra["specjax"]
    assert ext["drafted_tokens"] == 0 and ext["accepted_tokens"] == 0 and ext["acceptance_rate"] is None
    assert ext["target_calls"] == off.usage.completion_tokens  # one token per target call
    assert on.model_extra["specjax"]["target_calls"] < ext["target_calls"]


def test_metrics_parse(server, client):
    # 40 tokens: more than one engine step's worth (4 rounds of up to γ + 1 tokens), so the request has
    # an inter-token latency sample (one update carries every token of a shorter request)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True})
    httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    req = {(s.labels["path"], s.labels["status"]): s.value for s in fams["specjax_requests"].samples
           if s.name == "specjax_requests_total"}
    assert req[("/v1/completions", "200")] >= 1 and req[("/v1/completions", "400")] >= 1

    def value(name, sample=None):
        return next(s.value for s in fams[name].samples if s.name == (sample or name))

    assert value("specjax_slots") == 4 and value("specjax_queue_length") == 0
    assert value("specjax_generation_tokens", "specjax_generation_tokens_total") >= 5
    assert value("specjax_prompt_tokens", "specjax_prompt_tokens_total") >= 7
    assert value("specjax_time_to_first_token_seconds", "specjax_time_to_first_token_seconds_count") >= 1
    assert value("specjax_inter_token_latency_seconds", "specjax_inter_token_latency_seconds_count") >= 1
    assert value("specjax_accepted_length", "specjax_accepted_length_count") >= 1
    drafted = value("specjax_drafted_tokens", "specjax_drafted_tokens_total")
    assert 0 < value("specjax_accepted_tokens", "specjax_accepted_tokens_total") <= drafted
    assert value("specjax_target_calls", "specjax_target_calls_total") >= 1


LONG = " ".join(["w5"] * CONTEXT)
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
OK_C = {"model": MODEL, "prompt": PROMPT}
OK_M = {"model": MODEL, "messages": MESSAGES}
# (path, body (dict, or raw bytes), the param the error names, a word the message must hold)
MALFORMED = [
    (COMP, b"{not json", None, "not valid JSON"),
    (COMP, b"[1, 2]", None, "JSON object"),
    (COMP, {"prompt": PROMPT}, "model", "required"),
    (COMP, {**OK_C, "model": 5}, "model", "must be a string"),
    (COMP, {"model": MODEL}, "prompt", "prompt"),
    (COMP, {**OK_C, "prompt": "   "}, "prompt", "empty"),
    (COMP, {**OK_C, "prompt": ["w5", "w6"]}, "prompt", "one request per prompt"),
    (COMP, {**OK_C, "prompt": [5, 900]}, "prompt", "vocabulary"[:5] and "[0, 128)"),
    (COMP, {**OK_C, "prompt": LONG}, "prompt", "context"),
    (COMP, {**OK_C, "max_tokens": 0}, "max_tokens", ">= 1"),
    (COMP, {**OK_C, "max_tokens": 10 ** 6}, "max_tokens", "context holds 256 tokens"),
    (COMP, {**OK_C, "max_tokens": CONTEXT}, "max_tokens", "'max_tokens' ≤ 249"),
    (CHAT, {**OK_M, "max_tokens": 10 ** 6}, "max_tokens", "context holds 256 tokens"),
    (CHAT, {**OK_M, "max_completion_tokens": CONTEXT}, "max_completion_tokens", "context"),
    (COMP, {**OK_C, "max_tokens": "10"}, "max_tokens", "integer"),
    (COMP, {**OK_C, "temperature": -1}, "temperature", ">= 0"),
    (COMP, {**OK_C, "temperature": "hot"}, "temperature", "number"),
    (COMP, {**OK_C, "top_p": 0}, "top_p", "(0, 1]"),
    (COMP, {**OK_C, "top_k": -1}, "top_k", ">= 0"),
    (COMP, {**OK_C, "min_p": 2}, "min_p", "[0, 1]"),
    (COMP, {**OK_C, "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    (COMP, {**OK_C, "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    (COMP, {**OK_C, "seed": -1}, "seed", "integer in [0,"),
    (COMP, {**OK_C, "seed": 2 ** 64}, "seed", "integer in [0,"),
    (COMP, {**OK_C, "stop": ""}, "stop", "non-empty"),
    (COMP, {**OK_C, "stop": ["a"] * 17}, "stop", "at most 16"),
    (COMP, {**OK_C, "logprobs": 21}, "logprobs", "[0, 20]"),
    (COMP, {**OK_C, "n": 2}, "n", "must be 1"),
    (COMP, {**OK_C, "echo": True}, "echo", "not supported"),
    (COMP, {**OK_C, "best_of": 3}, "best_of", "not supported"),
    (COMP, {**OK_C, "suffix": "w9"}, "suffix", "not supported"),
    (COMP, {**OK_C, "frobnicate": 1}, "frobnicate", "unknown field"),
    (COMP, {**OK_C, "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    (COMP, {**OK_C, "logit_bias": {"999": 1}}, "logit_bias", "vocabulary"),
    (COMP, {**OK_C, "stream": "yes"}, "stream", "true or false"),
    (CHAT, {"model": MODEL}, "messages", "non-empty list"),
    (CHAT, {**OK_M, "messages": []}, "messages", "non-empty list"),
    (CHAT, {**OK_M, "messages": [{"role": "robot", "content": "w5"}]}, "messages[0]", "role"),
    (CHAT, {**OK_M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0]", "text parts"),
    (CHAT, {**OK_M, "top_logprobs": 2}, "top_logprobs", "needs 'logprobs'"),
    (CHAT, {**OK_M, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    (CHAT, {**OK_M, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    (CHAT, {**OK_M, "response_format": {"type": "json_object"}}, "response_format", "not supported"),
    (CHAT, {**OK_M, "speculative": "no"}, "speculative", "true or false"),
    (CHAT, {**OK_M, "stream": True, "stream_options": {"include_usage": "y"}}, "stream_options", "true or false"),
    (CHAT, {**OK_M, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "differ"),
]


def test_malformed_requests_are_400_and_the_server_lives(server):
    assert len(MALFORMED) >= 25
    with httpx.Client(base_url=server.url, timeout=60) as h:
        for path, body, param, words in MALFORMED:
            if isinstance(body, bytes):
                r = h.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = h.post(path, json=body)
            assert r.status_code == 400, (path, body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and words in err["message"], (body, err)
            assert err["param"] == param, (body, err)
            assert "\n" not in err["message"]
        assert h.post(COMP, json={**OK_C, "model": "gpt-4"}).status_code == 404  # OpenAI's code for an unknown model
        assert h.get("/v1/nothing").status_code == 404 and h.get(COMP).status_code == 405
        assert h.get("/health").status_code == 200
        ok = h.post(COMP, json={**OK_C, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_api_key_and_full_queue(pair):
    srv = H.ThreadServer(make_app(pair, slots=1, api_key="sekret", max_queue=0))
    gate = H.StepGate(srv.app.state.serve.engine)
    try:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert "Authorization: Bearer" in e.value.body["message"]
        assert httpx.post(srv.url + "/tokenize", json={"prompt": "w5"}).status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200  # health and metrics stay open
        assert httpx.get(srv.url + "/metrics").status_code == 200
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0, timeout=120)
        # one slot, no queue: while request A holds the slot (the engine's steps are held), B gets 429
        result = {}
        t = threading.Thread(target=lambda: result.update(a=good.completions.create(model=MODEL, prompt=PROMPT,
                                                                                   max_tokens=4)))
        t.start()
        worker = srv.app.state.serve.worker
        t0 = time.time()
        while worker.in_flight < 1 and time.time() - t0 < 30:
            time.sleep(0.01)
        r = httpx.post(srv.url + "/v1/completions", json={**OK_C, "max_tokens": 2},
                       headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"
        gate.open()
        t.join(60)
        assert result["a"].usage.completion_tokens == 4
        assert good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    finally:
        gate.restore()
        srv.stop()


def test_client_disconnect_mid_stream_cancels(server):
    gate = H.StepGate(server.app.state.serve.engine)
    try:
        gate.allow(2)  # the admission and one chunk: far from the 200 tokens asked
        with httpx.Client(base_url=server.url, timeout=60) as h:
            with h.stream("POST", COMP, json={**OK_C, "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                        break  # leave after the first chunk: the connection closes
        t0 = time.time()  # the engine's steps are still held: only the disconnect can end the request now
        while not gate.cancels and time.time() - t0 < 30:
            time.sleep(0.05)
        assert len(gate.cancels) == 1  # the server cancelled the request in the engine
        gate.open()
        while httpx.get(server.url + "/health").json()["running"] and time.time() - t0 < 30:
            time.sleep(0.05)
        assert httpx.get(server.url + "/health").json()["running"] == 0
        assert server.app.state.serve.worker.in_flight == 0
    finally:
        gate.restore()


def test_cli_without_the_serve_extra(monkeypatch, capsys):
    from specjax.cli import main, serve

    monkeypatch.setattr(serve, "serve_extra_installed", lambda: False)
    assert main(["serve"]) == 2
    assert capsys.readouterr().err.strip() == ('specjax: error: specjax serve needs the serve extra: pip install -e '
                                               '".[serve]" in a source checkout, or pip install "specjax[serve]"')


@pytest.mark.parametrize("argv, words", [
    (["--batch-size", "4"], "--max-batch 4"),
    (["--seed", "3"], "a seed per request"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--draft", "ngram", "--gamma", "auto"], "--gamma N"),
    (["--temperature", "-1"], "--temperature must be"),
    (["--speculation", "sometimes"], "--speculation"),
    (["--max-context", "1"], "--max-context must be >= 2"),
])
def test_cli_errors_are_one_line(argv, words, capsys, monkeypatch):
    from specjax.cli import main

    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specjax: error:") and words in err and "\n" not in err, err


def test_engine_fault_is_a_500_and_the_server_goes_on(server):
    engine = server.app.state.serve.engine
    own_step = engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return own_step()

    engine.step = failing_step
    try:
        with httpx.Client(base_url=server.url, timeout=60) as h:
            r = h.post(COMP, json={**OK_C, "max_tokens": 4})
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["type"] == "server_error" and "injected fault" in err["message"]
            calls.clear()  # the next step fails again: now under a stream, which ends with an error event
            with h.stream("POST", CHAT, json={**OK_M, "max_tokens": 4, "stream": True}) as resp:
                lines = [x for x in resp.iter_lines() if x.startswith("data: ")]
            assert "injected fault" in json.loads(lines[-2][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
            ok = h.post(COMP, json={**OK_C, "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
            assert h.get("/health").status_code == 200
    finally:
        engine.step = own_step
    assert server.app.state.serve.worker.faults == 2


def test_harmless_fields_are_accepted(server):
    with httpx.Client(base_url=server.url, timeout=60) as h:
        for path, body in ((COMP, OK_C), (CHAT, OK_M)):
            r = h.post(path, json={**body, "max_tokens": 2, "user": "u1", "metadata": {"k": "v"}, "n": 1,
                                   "store": False, "stream_options": None, "tools": [], "echo": False})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2


def test_served_model_name():
    from types import SimpleNamespace

    from specjax.cli.serve import served_name

    t = SimpleNamespace(name="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert served_name(None, None, t) == served_name(None, "default", t) == "SmolLM2-135M-Instruct"
    assert served_name("mine", None, t) == "mine"
    assert served_name(None, "/m/Qwen3-0.6B.gguf", SimpleNamespace(name="Qwen3-0.6B.gguf")) == "Qwen3-0.6B"
    assert served_name(None, "/m/tiny", SimpleNamespace(name="tiny")) == "tiny"


def test_client_gone_while_waiting_for_a_whole_response_cancels(server):
    gate = H.StepGate(server.app.state.serve.engine)
    try:  # no step runs: the request can only end through the client's disconnect
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + COMP, json={**OK_C, "max_tokens": 50}, timeout=1.0)
        t0 = time.time()
        while not gate.cancels and time.time() - t0 < 30:
            time.sleep(0.05)
        assert len(gate.cancels) == 1
        gate.open()
        while server.app.state.serve.worker.in_flight and time.time() - t0 < 30:
            time.sleep(0.05)
        assert server.app.state.serve.worker.in_flight == 0
    finally:
        gate.restore()


def test_a_new_sampling_field_is_a_request_field(monkeypatch):
    """Settings declared once (issue 27): a field added to Sampling's declaration alone is a request
    field of both endpoints, validated with its declared range."""
    import dataclasses

    from specjax.core import sampling as sampling_mod
    from specjax.core.settings import knob
    from specjax.serve import protocol as P

    new = dataclasses.make_dataclass(
        "Sampling", [("foo_weight", float, knob(0.0, kind=float, check=lambda v: 0 <= v <= 3,
                                                  expect="a number in [0, 3] (0 = off)", help="a new knob"))],
        bases=(sampling_mod.Sampling,), frozen=True)
    monkeypatch.setattr(sampling_mod, "Sampling", new)
    tok = H.word_tokenizer()
    d = P.ServeDefaults(model_name=MODEL, context_limit=CONTEXT, vocab_size=128,
                        request=P.server_request().replace(sampling=new()))
    req = P.parse_completion({**OK_C, "foo_weight": 1.5, "temperature": 0.5}, tok, d)
    assert isinstance(req.sampling, new) and req.sampling.foo_weight == 1.5 and req.sampling.temperature == 0.5
    assert P.parse_chat({**OK_M, "foo_weight": 2}, tok, d).sampling.foo_weight == 2
    with pytest.raises(P.RequestError, match=r"foo_weight must be a number in \[0, 3\]") as e:
        P.parse_completion({**OK_C, "foo_weight": 4}, tok, d)
    assert e.value.param == "foo_weight" and e.value.status == 400


def test_logit_bias_and_penalties_reach_the_engine(client, pair):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logit_bias={"50": 100})
    assert r.choices[0].text == "w50 w50 w50"
    plain = pair.offline(pair.tok.encode(PROMPT), 8).tokens[0]
    for fields in ({"frequency_penalty": -2.0, "presence_penalty": -2.0}, {"repetition_penalty": 0.1}):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body=fields)
        ref = pair.offline(pair.tok.encode(PROMPT), 8, Sampling(**fields)).tokens[0]
        assert r.choices[0].text == pair.tok.decode(ref) and ref != plain, fields  # (these penalties change it)
