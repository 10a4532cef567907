"""Helpers of the ``specjax serve`` tests: the tiny target with a word-level tokenizer, a server in
a thread (:class:`ThreadServer`), and :class:`StepGate`, which holds an engine's steps so that
"while the slot is busy" and "mid-stream" are deterministic."""

from __future__ import annotations

import socket
import threading
import time

WORDS = [f"w{i}" for i in range(3, 128)]
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


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


MODEL = "tiny-serve"
CONTEXT = 256  # tokens per request (prompt + new): the slots' buffers
GAMMA = 3


class Pair:
    """The tiny target, its drafter, and offline Decoders (speculative and plain) for the references."""

    def __init__(self):
        from specjax.drafters.model import ModelDrafter
        from specjax.io.loading import truncate_model
        from specjax.runtime.decoder import Decoder

        self.target = tiny_target()
        self.tok = self.target.tokenizer
        self.drafter = ModelDrafter.from_model(truncate_model(self.target, 1), name="first1")
        self.spec = Decoder(self.target, self.drafter, GAMMA)
        self.plain = Decoder(self.target, None)

    def offline(self, ids, max_new, sampling=None, seed=0, speculative=True, logprobs=None):
        """The Decoder run of one prompt alone with request key fold_in(seed_key(seed), 0)."""
        from specjax.core.sampling import Sampling, SamplingParams
        from specjax.runtime.decoder import request_keys

        dec = self.spec if speculative else self.plain
        return dec.generate([list(ids)], max_new_tokens=max_new,
                            sampling=SamplingParams.from_rows([sampling or Sampling()]),
                            keys=request_keys(seed, 1), logprobs=logprobs)


def make_app(pair, slots=4, **kw):
    """The app serving ``pair`` with a warmed-up Engine of ``slots`` slots (``kw``: create_app's)."""
    from specjax.runtime.decoder import Decoder
    from specjax.runtime.engine import Engine
    from specjax.serve.app import create_app
    from specjax.serve.protocol import ServeDefaults, server_request

    engine = Engine(Decoder(pair.target, pair.drafter, GAMMA), slots=slots, max_context=CONTEXT, max_logprobs=20)
    engine.warmup()
    d = ServeDefaults(model_name=MODEL, context_limit=int(engine.context_limit),
                      vocab_size=pair.target.config.vocab_size, request=server_request().replace(max_new_tokens=12),
                      chat=True)
    return create_app(engine, pair.tok, d, **kw)


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
