"""``specjax serve``: an OpenAI-compatible HTTP server around the continuous-batching engine
(:mod:`specjax.runtime.engine`).

Layer: beside ``io``/``eval``/``train`` (it may import ``runtime``, ``io`` and :mod:`specjax.api`;
nothing imports it except :mod:`specjax.cli.serve`). Its third-party dependencies (Starlette,
uvicorn, prometheus-client) are the ``serve`` extra: ``pip install "specjax[serve]"``.

* :mod:`~specjax.serve.protocol`: request bodies → validated :class:`~specjax.serve.protocol.GenerationRequest`
  (pure Python; every problem is a :class:`~specjax.serve.protocol.RequestError` with an
  OpenAI-style error body), and the response / stream-chunk bodies.
* :mod:`~specjax.serve.worker`: the one engine thread and its hand-off to asyncio.
* :mod:`~specjax.serve.metrics`: the Prometheus metrics (one registry per app).
* :mod:`~specjax.serve.app`: the Starlette application (:func:`~specjax.serve.app.create_app`).
"""
