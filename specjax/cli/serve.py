"""``specjax serve``: an OpenAI-compatible HTTP server (:mod:`specjax.serve`) around the
continuous-batching engine, with ``generate``'s model, drafter, format and mesh options."""

from __future__ import annotations

import argparse
import socket
import sys
import time

from specjax.cli.common import UsageError, add_model_args, note, parse_gamma, resolve
from specjax.core import env
from specjax.runtime.spec_policy import SPECULATION

EXTRA_MISSING = ('specjax serve needs the serve extra: pip install -e ".[serve]" in a source checkout, or '
                 'pip install "specjax[serve]"')


def serve_extra_installed() -> bool:
    """Whether Starlette, uvicorn and prometheus-client (the ``serve`` extra) can be imported."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("starlette", "uvicorn", "prometheus_client"))


def _check_flags(args) -> None:
    """The serve-only flags, and the shared flags that mean nothing for a server.

    Raises:
      UsageError: naming the flag and the fix."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1 (requests decoded together), got {args.max_batch}")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0 (requests waiting for a slot), got {args.max_queue}")
    if args.max_context is not None and args.max_context < 2:
        raise UsageError(f"--max-context must be >= 2 tokens (a prompt token and a new one), got {args.max_context}")
    if args.spec_max_running is not None and args.spec_max_running < 0:
        raise UsageError(f"--spec-max-running must be >= 0 (running requests), got {args.spec_max_running}")
    if args.rounds_per_chunk < 1:
        raise UsageError(f"--rounds-per-chunk must be >= 1, got {args.rounds_per_chunk}")
    if not args.shutdown_timeout > 0:
        raise UsageError(f"--shutdown-timeout must be > 0 seconds, got {args.shutdown_timeout}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name is empty; give the id clients send as 'model' (or drop the flag: "
                         "the model's own name)")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty; give a key or drop --api-key")
    if args.batch_size != 1:
        raise UsageError(f"--batch-size is generate's; serve decodes up to --max-batch requests together (use "
                         f"--max-batch {args.batch_size})")
    if args.seed not in (None, 0):
        raise UsageError("--seed is generate's; serve takes a seed per request (the 'seed' field; without one a "
                         "random seed is drawn and returned)")
    if args.chat is not None:
        note("--chat/--no-chat has no effect on serve: /v1/chat/completions uses the chat template, "
             "/v1/completions sends raw text")


def _check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` once before the model loads (a busy port is one line, not a load and a traceback)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror}; give an address such as 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port or stop the "
                             "program using it") from None


def cmd_serve(args) -> int:
    if not serve_extra_installed():
        raise UsageError(EXTRA_MISSING)
    from specjax.cli.generate import load_for_generate
    from specjax.runtime.progress import Progress

    _check_flags(args)
    s = resolve(args)
    gamma = parse_gamma(s["gamma"])
    if gamma == "auto":
        raise UsageError("--gamma auto measures on the run's prompts, which a server does not have; give --gamma N "
                         "(`specjax analyze` or `specjax generate --gamma auto` on typical prompts recommends one)")
    mesh = None
    if args.mesh:  # (resolve checked its syntax)
        from specjax.runtime import sharding

        mesh = sharding.MeshSpec.parse(args.mesh)
        if args.max_batch % mesh.data:
            raise UsageError(f"--max-batch {args.max_batch} must be a multiple of the mesh's data axis ({mesh.data}): "
                             f"requests are split over it; use --max-batch {args.max_batch + (-args.max_batch % mesh.data)}")
    _check_port_free(args.host, args.port)
    progress = None if env.get("SPECJAX_NO_PROGRESS") else Progress()
    t0 = time.perf_counter()
    target, drafter = load_for_generate(s, gamma, mesh, progress)
    if target.tokenizer is None:
        raise UsageError(f"{target.name} has no tokenizer; specjax serve needs one (a checkpoint with tokenizer.json "
                         "or a GGUF file)")
    load_s = time.perf_counter() - t0
    engine, warm_s = build_engine(target, drafter, gamma, s["tree"], mesh, progress, args)
    from specjax.serve.app import create_app, make_server
    from specjax.serve.protocol import ServeDefaults

    name = served_name(args.served_model_name, s["model"], target)
    # the requests' defaults: the flags' and the pair config's request (no seed: each request draws its own)
    defaults = ServeDefaults(model_name=name, context_limit=int(engine.context_limit),
                             vocab_size=int(target.config.vocab_size), request=s["request"].request.replace(seed=None),
                             parse_special=bool(s["parse_special"]), max_logprobs=MAX_LOGPROBS,
                             chat=bool(target.tokenizer.chat_template))
    app = create_app(engine, target.tokenizer, defaults, api_key=args.api_key, max_queue=args.max_queue,
                     shutdown_timeout=args.shutdown_timeout)
    method = "autoregressive" if drafter is None else (
        f"speculative, drafter {drafter.name}, " + (f"γ = {gamma}" if s["tree"] is None else s["tree"].label))
    warm = f"warm-up (compiles) {warm_s:.1f} s" if warm_s is not None else "no warm-up (the first requests compile)"
    print(f"specjax: serve: {name} ({method}); model load {load_s:.1f} s, {warm}; {args.max_batch} slots, context "
          f"{engine.context_limit} tokens; listening on http://{args.host}:{args.port} (Ctrl+C or SIGTERM stops)",
          file=sys.stderr, flush=True)
    server = make_server(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout)
    server.run()
    print("specjax: serve: stopped", file=sys.stderr, flush=True)
    return 0


MAX_LOGPROBS = 20
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"  # the embedded default model, as generate names it


def served_name(given: str | None, model: str | None, target) -> str:
    """The model id of ``/v1/models``: ``--served-model-name``, else ``SmolLM2-135M-Instruct`` for the
    embedded default model, else the target's name without a ``.gguf`` suffix."""
    if given is not None:
        return given
    if model in (None, "default"):
        return DEFAULT_SERVED_NAME
    name = str(target.name or model)
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def build_engine(target, drafter, gamma, tree, mesh, progress, args):
    """The :class:`~specjax.runtime.engine.Engine` of the loaded pair (its Decoder built as
    ``generate`` builds it) and the warm-up seconds (``None`` with ``--no-warmup``)."""
    from specjax.runtime.decoder import Decoder
    from specjax.runtime.engine import Engine
    from specjax.runtime.progress import phase

    kw = {} if tree is None or drafter is None else dict(tree_nodes=tree.nodes, tree_depth=tree.depth,
                                                          tree_topk=tree.topk)
    dec = Decoder(target, drafter, gamma if drafter is not None else 1, mesh=mesh, progress=progress, **kw)
    lim = dec.context_limit()
    if args.max_context is not None and args.max_context > lim:
        both = " and its drafter" if lim < target.config.max_position_embeddings else ""
        raise UsageError(f"--max-context {args.max_context} is more than the {lim} tokens the context of {target.name}"
                         f"{both} holds; use --max-context {lim} or less")
    engine = Engine(dec, slots=args.max_batch, max_context=args.max_context, rounds_per_chunk=args.rounds_per_chunk,
                    max_logprobs=MAX_LOGPROBS, spec_max_running=args.spec_max_running,
                    speculation=args.speculation)
    if not args.warmup:
        return engine, None
    with phase(progress, f"warm-up: compiling the engine's programs ({args.max_batch} slots)"):
        t = engine.warmup()
    return engine, float(t)


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra)")
    add_model_args(p, auto_dtype=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every "
                                                       "interface)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=8, metavar="B",
                   help="requests decoded together: the engine's slots (default 8)")
    p.add_argument("--max-queue", type=int, default=64, metavar="Q",
                   help="requests that may wait for a slot; more get HTTP 429 with Retry-After (default 64)")
    p.add_argument("--api-key", default=env.get("SPECJAX_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 and /tokenize (default $SPECJAX_API_KEY; "
                        "none: open)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id of /v1/models and of requests' 'model' (default: SmolLM2-135M-Instruct for "
                        "the default model, else the target's name)")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="tokens one request may hold, prompt + new (default: the model's context); every slot "
                        "holds this many, so it sets the KV-cache memory and each round's attention cost")
    p.add_argument("--speculation", choices=SPECULATION, default="auto",
                   help="speculation under load: 'auto' (default) — while only greedy requests run (the same "
                        "tokens either way), each chunk of rounds runs speculative or plain one-token rounds, "
                        "whichever the server measured faster for the running requests; 'always' — always "
                        "speculate (but see --spec-max-running). Sampled requests always keep their method, "
                        "so their seed reproduces them")
    p.add_argument("--spec-max-running", type=int, default=None, metavar="N",
                   help="while more than N requests run and none of them is sampled, decode without drafts "
                        "(plain one-token rounds; greedy output is the same; default: no limit)")
    p.add_argument("--rounds-per-chunk", type=int, default=4, metavar="N",
                   help="speculation rounds per engine step (one streamed update per step; default 4)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the engine's programs before listening (default on)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM/Ctrl+C, seconds the requests in flight get to finish before they are "
                        "cancelled (default 10)")
    p.set_defaults(func=cmd_serve)
