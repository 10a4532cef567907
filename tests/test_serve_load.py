"""``specjax serve`` under load (issue 31): three waves of 64 concurrent requests through
``openai.AsyncOpenAI`` against a live server (8 slots, the real Engine, the tiny pair of
tests/serve_helpers.py) — mixed prompt lengths, completions and chat, greedy and seeded sampling,
mixed ``max_tokens``, a quarter streamed, one in eight cancelled mid-stream (the stream closed
after its first chunk).

Checked per wave: every request that was not cancelled completes with exactly one response (none
lost, none duplicated: 64 distinct response ids, the request counter moves by exactly 64); its text
equals the offline run of its prompt alone (``Decoder.generate`` with ``request_keys(seed, 1)``:
greedy and seeded alike); every cancelled request reached ``engine.cancel`` and the engine ends
idle. Across waves: the process RSS after the third wave is at most the first wave's + 50 MB.
Nothing is timed: ``WAIT_S`` only bounds the waits, so that a lost request or a stuck engine fails
with a message instead of hanging the suite (it is no speed requirement).
"""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import serve_helpers as H
from specjax.core.sampling import Sampling

N = 64
SLOTS = 8
WAIT_S = 600.0  # bound of every wait (a request's response, the engine going idle): a hang fails, no speed is checked
SAMPLED = Sampling(temperature=0.8, top_p=0.95)


def _specs(wave: int) -> list[dict]:
    """The wave's 64 requests (fixed seeds: the same mix every run)."""
    rng = np.random.default_rng(31 + wave)
    out = []
    for i in range(N):
        words = " ".join(f"w{int(x)}" for x in rng.integers(3, 128, size=int(rng.integers(2, 24))))
        sampled = i % 2 == 1
        out.append({
            "i": i, "chat": i % 3 == 0, "text": words, "sampled": sampled, "seed": 5000 + 100 * wave + i,
            "max_tokens": int(rng.choice([4, 8, 12, 16])), "stream": i % 4 == 1 or i % 8 == 3,
            "cancel": i % 8 == 3,
        })
    return out


def _ids(pair, s) -> list[int]:
    if s["chat"]:
        return pair.tok.encode_chat([{"role": "user", "content": s["text"]}])
    return pair.tok.encode(s["text"])


async def _one(client, s) -> dict:
    kw = dict(model=H.MODEL, max_tokens=200 if s["cancel"] else s["max_tokens"])
    if s["sampled"]:
        kw.update(temperature=SAMPLED.temperature, top_p=SAMPLED.top_p, seed=s["seed"])
    if s["cancel"]:
        kw["extra_body"] = {"ignore_eos": True}
    if s["chat"]:
        call = client.chat.completions.create(messages=[{"role": "user", "content": s["text"]}], stream=s["stream"],
                                              **kw)
    else:
        call = client.completions.create(prompt=s["text"], stream=s["stream"], **kw)
    r = await call
    if not s["stream"]:
        c = r.choices[0]
        return {"id": r.id, "text": c.message.content if s["chat"] else c.text, "finish": c.finish_reason,
                "n": r.usage.completion_tokens}
    texts, ids, finish = [], set(), None
    async for chunk in r:
        ids.add(chunk.id)
        if chunk.choices:
            c = chunk.choices[0]
            texts.append((c.delta.content if s["chat"] else c.text) or "")
            finish = c.finish_reason or finish
            if s["cancel"] and texts[-1]:
                break  # the client goes away mid-stream
    await r.close()
    assert len(ids) == 1
    return {"id": ids.pop(), "text": "".join(texts), "finish": finish, "n": None}


async def _wave(url: str, specs) -> list[dict]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S) as client:
        try:
            return await asyncio.wait_for(asyncio.gather(*(_one(client, s) for s in specs)), WAIT_S)
        except (asyncio.TimeoutError, openai.APITimeoutError) as e:
            raise AssertionError(f"a request of the wave got no complete response within {WAIT_S:g} s "
                                 f"(lost or hung, not slow): {e!r}") from e


def _wait_until(cond, what: str) -> None:
    """Poll ``cond()`` until it holds; fail naming ``what`` after ``WAIT_S`` seconds (a hang, not a speed)."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > WAIT_S:
            raise AssertionError(f"{what} did not happen within {WAIT_S:g} s")
        time.sleep(0.05)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _requests_total(url: str) -> float:
    import httpx

    fams = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return sum(s.value for f in fams if f.name == "specjax_requests" for s in f.samples
               if s.name == "specjax_requests_total" and s.labels["path"].startswith("/v1/"))


@pytest.fixture(scope="module")
def pair():
    return H.Pair()


def test_three_waves_of_64_concurrent_requests(pair):
    srv = H.ThreadServer(H.make_app(pair, slots=SLOTS, max_queue=N))
    engine = srv.app.state.serve.engine
    cancels = H.StepGate(engine)
    cancels.open()  # steps run freely: the gate only records engine.cancel calls
    refs: dict = {}
    rss = []
    try:
        for wave in range(3):
            specs = _specs(wave)
            before = _requests_total(srv.url)
            n_cancel0 = len(cancels.cancels)
            results = asyncio.run(_wave(srv.url, specs))  # every request answered (a hang fails after WAIT_S)
            assert len({r["id"] for r in results}) == N  # one response each, none duplicated
            assert _requests_total(srv.url) - before == N
            done = [(s, r) for s, r in zip(specs, results) if not s["cancel"]]
            for s, r in done:
                key = (tuple(_ids(pair, s)), s["max_tokens"], s["sampled"], s["seed"])
                if key not in refs:
                    ref = pair.offline(key[0], s["max_tokens"], SAMPLED if s["sampled"] else None, seed=s["seed"])
                    refs[key] = (pair.tok.decode(ref.tokens[0]), len(ref.tokens[0]),
                                 {"eos": "stop", "length": "length"}[ref.stats[0]["finish_reason"]])
                text, n, finish = refs[key]
                assert r["text"] == text, (wave, s)
                assert r["finish"] == finish, (wave, s)
                if r["n"] is not None:
                    assert r["n"] == n
            cut = [s for s in specs if s["cancel"]]
            _wait_until(lambda: engine.idle and srv.app.state.serve.worker.in_flight == 0,
                        f"wave {wave}: the engine going idle with no request in flight")
            assert engine.idle and srv.app.state.serve.worker.in_flight == 0
            assert len(cancels.cancels) - n_cancel0 == len(cut)  # each closed stream cancelled its request
            gc.collect()
            rss.append(_rss_mb())
            print(f"wave {wave}: {N} requests, RSS {rss[-1]:.0f} MB")
        assert rss[2] <= rss[0] + 50, rss
    finally:
        cancels.restore()
        srv.stop()
