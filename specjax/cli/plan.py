"""``specjax plan``: will a model fit a deployment? Per-device memory of the prefill and decode programs
``generate`` runs, compiled ahead of time on abstract inputs (no weight is loaded or allocated;
:mod:`specjax.eval.plan`), on as many virtual CPU devices as ``--mesh`` needs.

    specjax plan --model llama-3.1-8b --mesh data=1,model=8 --dtype bfloat16 --batch 8 --max-len 8192

Prints (``--json``: one JSON object, bytes as integers) the weights, KV cache, decode state and
compiler temporaries per device, the peak, the largest batch and context that fit
``--device-memory``, and the weight bytes each decode step reads. A plan that does not fit is
refused in one line (exit status 2) naming what would fit.
"""

from __future__ import annotations

import json
import os
import re

from specjax.cli.common import (
    UsageError, add_draft_flags, add_dtype_flag, add_mesh_flag, add_model_flag, parse_gamma,
)
from specjax.core import env

_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "kib": 2 ** 10, "kb": 10 ** 3, "m": 2 ** 20, "mib": 2 ** 20, "mb": 10 ** 6,
          "g": 2 ** 30, "gib": 2 ** 30, "gb": 10 ** 9, "t": 2 ** 40, "tib": 2 ** 40, "tb": 10 ** 12}


def parse_memory(text: str) -> int:
    """``--device-memory``: ``16GiB``, ``80GB``, ``16G`` (binary), ``512MiB`` or bytes → bytes (int).

    Raises:
      UsageError: not a positive size with a known unit.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise UsageError(f"--device-memory must be a positive size such as 16GiB, 80GB or 24G, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_mesh(text: str | None) -> tuple[int, int] | None:
    """``--mesh data=D,model=M`` → ``(D, M)`` (an axis left out is 1); ``None`` without a mesh.

    Raises:
      UsageError: a malformed mesh (:meth:`specjax.runtime.sharding.MeshSpec.parse`'s message)."""
    if text is None:
        return None
    from specjax.runtime.sharding import MeshSpec

    sizes = [int(x) for x in re.findall(r"=\s*([0-9]+)", text)]
    n = 1
    for x in sizes:
        n *= max(x, 1)
    try:
        spec = MeshSpec.parse(text, device_count=n)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return spec.data, spec.model


def cpu_devices(n: int):
    """``n`` CPU devices to compile on. Before JAX has started its backends, set
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and the CPU platform; after, use the CPU devices it has.

    Raises:
      UsageError: JAX already started with fewer CPU devices (run the command in a fresh process)."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        flags = env.get("XLA_FLAGS") or ""
        have = [int(x) for x in re.findall(r"--xla_force_host_platform_device_count=([0-9]+)", flags)]
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", flags)
        flags += f" --xla_force_host_platform_device_count={max([n, *have])}"
        os.environ["XLA_FLAGS"] = " ".join(flags.split())
        jax.config.update("jax_platforms", "cpu")
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise UsageError(f"--mesh needs {n} devices, but JAX started with {len(devices)} CPU device(s) before specjax "
                         f"plan could set them up; run specjax plan in a fresh process (or start it with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n})")
    return devices[:n]


def plan_request(args):
    """The :class:`specjax.eval.plan.PlanRequest` of the flags, every value checked before JAX starts.

    Raises:
      UsageError: a bad --mesh, --batch, --max-len, --prompt-len, --device-memory, --gamma or --draft;
      ValueError: an unknown --model (names the built-in shapes)."""
    from specjax.eval import plan

    mesh = parse_mesh(args.mesh)
    for flag, v in (("--batch", args.batch), ("--max-len", args.max_len), ("--prompt-len", args.prompt_len)):
        if v is not None and v < 1:
            raise UsageError(f"{flag} must be an integer >= 1, got {v}")
    memory = parse_memory(args.device_memory)
    try:
        plan.check_draft(args.draft)
    except ValueError as e:
        raise UsageError(str(e)) from None
    gamma = parse_gamma(args.gamma, default=4)
    if gamma == "auto":
        raise UsageError("--gamma auto measures on real weights; give a number for a plan (e.g. --gamma 4)")
    name, cfg = plan.model_shape(args.model)
    ctx = cfg.max_position_embeddings
    max_len = min(4096, ctx) if args.max_len is None else args.max_len
    if not 2 <= max_len <= ctx:
        raise UsageError(f"--max-len {max_len} is outside [2, {ctx}]: the context of {name} holds {ctx} tokens")
    if args.prompt_len is not None and args.prompt_len >= max_len:
        raise UsageError(f"--prompt-len {args.prompt_len} leaves no room for a new token in --max-len {max_len}; "
                         f"use --prompt-len {max_len - 1} or less")
    data, model = mesh or (1, 1)
    return plan.PlanRequest(name=name, cfg=cfg, dtype=args.dtype or "bfloat16", data=data, model=model,
                            batch=args.batch, max_len=max_len, prompt_len=args.prompt_len, device_memory=memory,
                            draft=args.draft, gamma=gamma), mesh is not None


def cmd_plan(args) -> int:
    """``specjax plan``: check the flags, refuse from the weight table when the weights and KV cache
    alone do not fit (nothing compiled), set up the CPU devices, compile (:func:`specjax.eval.plan.plan`),
    refuse when the compiled peak does not fit, else print the figures (text or ``--json``).

    Raises:
      UsageError: a bad flag, or a plan that does not fit (one line naming what would)."""
    from specjax.eval import plan
    from specjax.runtime.progress import Progress, phase

    req, on_mesh = plan_request(args)
    if req.model > 1:  # said before anything is compiled: a model axis that does not divide keeps whole copies
        from specjax.runtime import sharding

        sharding.warn_replicated(req.cfg, req.model, name=req.name)
    line = plan.refusal(req)  # weights + KV cache (analytic) do not fit: nothing to compile, no devices needed
    if line is not None:
        raise UsageError(line)
    devices = cpu_devices(req.devices)
    devices = devices if on_mesh else None  # one device, no mesh: the program generate runs without --mesh
    progress = None if env.get("SPECJAX_NO_PROGRESS") else Progress()
    where = f"{req.devices} virtual CPU device{'s' if req.devices > 1 else ''}"
    with phase(progress, f"compiling the prefill and decode loop of {req.name} on {where} (no weights allocated)"):
        fig = plan.plan(req, devices)
    line = plan.refusal(req, fig)
    if line is not None:
        raise UsageError(line)
    print(json.dumps(fig) if args.json else render(fig), flush=True)
    return 0


def render(fig: dict) -> str:
    """The plan's figures as text (GiB; ``--json`` has the bytes)."""
    from specjax.eval.plan import fmt_bytes as b

    an, t, big = fig["analytic"], fig["temporaries"], fig["largest"]
    draft = "autoregressive" if fig["draft"] == "none" else f"--draft {fig['draft']}, γ = {fig['gamma']}"
    return "\n".join([
        f"{fig['model']}: {fig['dtype']} weights, {fig['kv_cache_dtype']} KV cache, mesh {fig['mesh']} "
        f"({fig['devices']} device{'s' if fig['devices'] > 1 else ''}), batch {fig['batch']} × {fig['max_len']} tokens "
        f"(prompts ≤ {fig['prompt_len']}; {fig['buffer_len']} buffer slots), {draft}",
        "per device:",
        f"  weights       {b(fig['weights']):>11}   (analytic {b(an['weights'])})",
        f"  KV cache      {b(fig['kv_cache']):>11}   (analytic {b(an['kv_cache'])})",
        f"  decode state  {b(fig['state']):>11}   (the KV cache, token buffer and per-row arrays)",
        f"  temporaries   {b(t['decode']):>11}   decode loop; prefill {b(t['prefill'])}",
        f"  peak          {b(fig['peak']):>11}   in the {fig['peak_program']}, of {b(fig['device_memory'])}: fits",
        f"largest that fits {b(fig['device_memory'])} per device (estimate, linear in batch × context): "
        f"batch {big['batch']} at {fig['max_len']} tokens; {big['max_len']} tokens at batch {fig['batch']}",
        f"each decode step reads {b(fig['decode_step_weight_bytes'])} of weights per device ({fig['dtype']})",
        f"note: {fig['note']}; compiled in {fig['compile_s']['prefill']:.1f} s + {fig['compile_s']['decode']:.1f} s",
    ])


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("plan", help="per-device memory of a deployment, compiled without weights")
    add_model_flag(p, help="a built-in shape (llama-3.2-1b, llama-3.1-8b, llama-3.1-70b, smollm2-135m; default: "
                           "the default model), a config.json, a model directory holding one, or a .gguf file")
    add_draft_flags(p)
    add_dtype_flag(p)
    add_mesh_flag(p)
    p.add_argument("--batch", type=int, default=1, help="rows decoded together (default 1)")
    p.add_argument("--max-len", type=int, default=None, metavar="L",
                   help="tokens per row, prompt + new (default 4096, or the model's context if shorter)")
    p.add_argument("--prompt-len", type=int, default=None, metavar="P", help="prompt tokens per row (default L/2)")
    p.add_argument("--device-memory", default="16GiB", metavar="SIZE",
                   help="memory per device, e.g. 16GiB (default), 80GB, 24G").check = parse_memory
    p.add_argument("--json", action="store_true", help="the figures as one JSON object (bytes as integers)")
    p.set_defaults(func=cmd_plan, dtype="bfloat16")
