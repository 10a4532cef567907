"""Helpers of the ``specjax serve`` tests: the tiny target with a word-level tokenizer, its offline
reference runs, a server in a thread, and — only until :mod:`specjax.runtime.engine` exists —
a stand-in engine for the HTTP layer.

``FakeEngine`` has the engine's interface (submit / cancel / step / idle / queued / running /
slots / context_limit / warmup) and decodes every request ALONE with
:meth:`specjax.runtime.decoder.Decoder.generate` (request key ``fold_in(seed_key(S), 0)``), then
hands its tokens out a few per step. It tests the HTTP layer only: it is installed as
``specjax.runtime.engine`` by :func:`install_engine` when (and only when) the real module is
missing, and :data:`REAL_ENGINE` says which one the tests ran against.

Run as a script (``python tests/serve_helpers.py serve ARGS``) it is ``specjax serve ARGS`` with
that same rule (the SIGTERM test starts the server this way).
"""

from __future__ import annotations

import collections
import importlib.util
import os
import random
import socket
import sys
import threading
import time
import types
from dataclasses import dataclass

WORDS = [f"w{i}" for i in range(3, 128)]
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


def real_engine_available() -> bool:
    try:
        return importlib.util.find_spec("specjax.runtime.engine") is not None
    except ModuleNotFoundError:
        return False


REAL_ENGINE = real_engine_available()


# ------------------------------------------------------------------ the stand-in engine
@dataclass(frozen=True)
class EngineRequest:
    prompt: list
    max_new_tokens: int = 64
    sampling: object = None
    seed: int | None = None
    stop_token_ids: tuple = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    speculative: bool = True


@dataclass(frozen=True)
class Update:
    request_id: int
    tokens: list
    logprobs: list | None
    finish_reason: str | None
    stats: object
    seed: int


class FakeEngine:
    """The engine's interface over alone runs of a Decoder (see the module docstring)."""

    CHUNK = 3  # tokens per update

    def __init__(self, decoder, slots=8, max_context=None, rounds_per_chunk=4, max_logprobs=20):
        from specjax.runtime.decoder import Decoder

        self.decoder = decoder
        self.slots = slots
        self.max_logprobs = max_logprobs
        self.context_limit = decoder.context_limit() if max_context is None else min(max_context,
                                                                                     decoder.context_limit())
        self._plain = Decoder(decoder.target, None) if decoder.drafter is not None else decoder
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._running: dict = {}
        self._cancelled: set = set()
        self._next = 0

    def warmup(self) -> float:
        return 0.0

    def submit(self, req) -> int:
        if not req.prompt:
            raise ValueError("the prompt is empty; give at least one token")
        if len(req.prompt) + 1 > self.context_limit:
            raise ValueError(f"the prompt has {len(req.prompt)} tokens; the context holds {self.context_limit}")
        if req.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        if req.logprobs is not None and not 0 <= req.logprobs <= self.max_logprobs:
            raise ValueError(f"logprobs must be in [0, {self.max_logprobs}], got {req.logprobs}")
        with self._lock:
            rid = self._next
            self._next += 1
            self._queue.append((rid, req))
        return rid

    def cancel(self, rid) -> None:
        with self._lock:
            self._cancelled.add(rid)

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._queue and not self._running

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    def _decode(self, req):
        from specjax.core.sampling import Sampling, SamplingParams
        from specjax.runtime.decoder import request_keys

        seed = req.seed if req.seed is not None else random.getrandbits(63)
        dec = self.decoder if req.speculative else self._plain
        n = min(req.max_new_tokens, self.context_limit - len(req.prompt))
        r = dec.generate([list(req.prompt)], max_new_tokens=n,
                         sampling=SamplingParams.from_rows([req.sampling or Sampling()]), keys=request_keys(seed, 1),
                         eos_ids=[] if req.ignore_eos else None, stop_token_ids=list(req.stop_token_ids) or None,
                         logprobs=req.logprobs)
        return {"tokens": r.tokens[0], "lp": None if r.logprobs is None else r.logprobs[0], "stats": r.stats[0],
                "seed": seed, "pos": 0}

    def step(self) -> list:
        with self._lock:
            admit = []
            while self._queue and len(self._running) + len(admit) < self.slots:
                admit.append(self._queue.popleft())
            cancelled = set(self._cancelled)
            self._cancelled.clear()
        out = []
        for rid, req in admit:
            if rid in cancelled:
                out.append(Update(rid, [], None, "cancelled", None, req.seed or 0))
                continue
            self._running[rid] = self._decode(req)
        for rid in list(self._running):
            r = self._running[rid]
            if rid in cancelled:
                del self._running[rid]
                out.append(Update(rid, [], None, "cancelled", r["stats"], r["seed"]))
                continue
            a, b = r["pos"], r["pos"] + self.CHUNK
            r["pos"] = b
            toks = r["tokens"][a:b]
            lp = None if r["lp"] is None else r["lp"][a:b]
            done = b >= len(r["tokens"])
            if done:
                del self._running[rid]
            out.append(Update(rid, toks, lp, r["stats"]["finish_reason"] if done else None,
                              r["stats"] if done else None, r["seed"]))
        with self._lock:  # a cancel of a request still queued waits for its admission
            self._cancelled |= cancelled & {rid for rid, _ in self._queue}
        return out


def install_engine() -> bool:
    """Make ``specjax.runtime.engine`` importable: the real module when it exists (returns True),
    else a module holding FakeEngine as ``Engine`` (returns False)."""
    if REAL_ENGINE:
        return True
    mod = types.ModuleType("specjax.runtime.engine")
    mod.Engine, mod.EngineRequest, mod.Update = FakeEngine, EngineRequest, Update
    mod.__doc__ = "stand-in installed by tests/serve_helpers.py (the real engine is missing)"
    sys.modules["specjax.runtime.engine"] = mod
    import specjax.runtime

    specjax.runtime.engine = mod
    return False


# ------------------------------------------------------------------ the tiny pair
def word_tokenizer():
    """Word-level tokenizer over the tiny vocabulary: ``<s>`` 0, ``</s>`` 1, ``<unk>`` 2, ``w3`` … ``w127``,
    with a chat template (decode joins words with spaces)."""
    from tokenizers import Tokenizer as HFTok, models, pre_tokenizers

    from specjax.io.tokenizer import Tokenizer

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    hf = HFTok(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(hf, bos_token_id=0, eos_token_ids=(1,), add_bos=False, chat_template=CHAT_TEMPLATE,
                     special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def tiny_target(seed: int = 7):
    """The tiny random target (tests/conftest.py's tiny_model, 512-token context) with the word tokenizer."""
    from conftest import tiny_model

    return tiny_model(seed=seed, scale=3.0).replace(tokenizer=word_tokenizer(), name="tiny-serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """A uvicorn server for ``app`` in a thread on 127.0.0.1 (a free port); ``url``; :meth:`stop`."""

    def __init__(self, app, shutdown_timeout: float = 5.0):
        from specjax.serve.app import make_server

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = make_server(app, "127.0.0.1", self.port, shutdown_timeout=shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if not self.thread.is_alive() or time.time() - t0 > 30:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class StepGate:
    """Hold an engine's steps (its worker thread waits in ``step``): :meth:`allow` ``n`` more steps,
    :meth:`open` to step freely again, :meth:`restore` to put the engine's own ``step`` back. Makes
    "while the slot is busy" and "mid-stream" deterministic in tests."""

    def __init__(self, engine):
        self.engine = engine
        self._orig = engine.step
        self._sem = threading.Semaphore(0)
        self._open = False
        self.cancels: list = []
        self._orig_cancel = engine.cancel
        engine.step = self._step
        engine.cancel = self._cancel

    def _step(self):
        if not self._open:
            self._sem.acquire()
        return self._orig()

    def _cancel(self, rid):
        self.cancels.append(rid)
        return self._orig_cancel(rid)

    def allow(self, n: int) -> None:
        for _ in range(n):
            self._sem.release()

    def open(self) -> None:
        self._open = True
        self._sem.release()

    def restore(self) -> None:
        self.open()
        self.engine.step = self._orig
        self.engine.cancel = self._orig_cancel


if __name__ == "__main__":  # python tests/serve_helpers.py serve ARGS: specjax serve with the engine rule above
    install_engine()
    from specjax.cli import main

    sys.exit(main(sys.argv[1:]))
