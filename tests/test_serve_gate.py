"""GATE (issue 31, real model; ``-m gate_matrix``, run by .ci/run's gate phase): ``specjax serve``'s
stack — the real default model and its shipped drafter (γ 2, as ``--config smollm2-default``) in
bfloat16, the Engine with 2 slots, the HTTP app — answers two concurrent requests, a greedy chat
request and a seeded sampled completion, with exactly the tokens of ``Decoder.generate`` of each
prompt alone with ``request_keys(seed, 1)`` (bfloat16: batch invariance is exact there), and
reports the drafter's work in its ``specjax`` counters. About a minute on 2 CPU cores."""

from __future__ import annotations

import asyncio

import openai
import pytest

import serve_helpers as H
from specjax.core.sampling import Sampling, SamplingParams
from specjax.runtime.decoder import Decoder, request_keys

QUESTION = "Write one sentence about the sea."
PROMPT = "The three primary colors are"


@pytest.mark.gate_matrix
def test_default_pair_served_equals_alone_runs():
    from specjax.api import load_drafter
    from specjax.io.loading import load_model
    from specjax.runtime.engine import Engine
    from specjax.serve.app import create_app
    from specjax.serve.protocol import ServeDefaults

    target = load_model(dtype="bfloat16")
    drafter = load_drafter("default", target, dtype="bfloat16")
    engine = Engine(Decoder(target, drafter, 2), slots=2, max_context=128, max_logprobs=20)
    engine.warmup()
    d = ServeDefaults(model_name="smollm2", context_limit=int(engine.context_limit),
                      vocab_size=target.config.vocab_size, chat=True)
    srv = H.ThreadServer(create_app(engine, target.tokenizer, d))
    sampled = Sampling(temperature=0.7, top_p=0.9)
    try:
        async def both():
            async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                                          timeout=300) as c:
                return await asyncio.gather(
                    c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                              max_tokens=24),
                    c.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0.7, top_p=0.9,
                                         seed=11))

        chat, comp = asyncio.run(both())
    finally:
        srv.stop()
    alone = Decoder(target, drafter, 2)
    tok = target.tokenizer
    ref_chat = alone.generate([tok.encode_chat(QUESTION)], max_new_tokens=24, keys=request_keys(0, 1))
    ref_comp = alone.generate([tok.encode(PROMPT)], max_new_tokens=24, keys=request_keys(11, 1),
                              sampling=SamplingParams.from_rows([sampled]))
    assert chat.choices[0].message.content == tok.decode(ref_chat.tokens[0])
    assert comp.choices[0].text == tok.decode(ref_comp.tokens[0])
    for r, ref in ((chat, ref_chat), (comp, ref_comp)):
        ext = r.model_extra["specjax"]
        assert r.usage.completion_tokens == len(ref.tokens[0])
        assert ext["target_calls"] == ref.stats[0]["target_calls"] and ext["drafted_tokens"] > 0
        assert ext["accepted_tokens"] == ref.stats[0]["accepted_tokens"]
    assert comp.model_extra["specjax"]["seed"] == 11
    assert chat.model_extra["specjax"]["accepted_tokens"] > 0  # the shipped drafter's drafts were accepted
