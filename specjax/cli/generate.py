"""``specjax generate``: text in, text out, streamed as it is generated."""

from __future__ import annotations

import json
import re
import sys

from specjax.cli.common import (
    UsageError, add_model_args, check_logprobs, collect_prompts, load_target_and_drafter, note, note_prompt_caps,
    chat_default, parse_gamma, peek_vocab_size, resolve, resolve_auto_dtype,
)
from specjax.cli.flags import unescape  # noqa: F401  (re-exported: it was defined here)
from specjax.core import env
from specjax.runtime import programs


def read_stdin_prompt() -> str:
    """The prompt text piped on standard input (UTF-8)."""
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UsageError(f"standard input is not valid UTF-8 (byte {e.start}); pipe UTF-8 text") from None


def generate_prompts(args) -> list[dict]:
    """``generate``'s prompts: PROMPT (``-`` = standard input), ``--prompt``, ``--prompts FILE``, or
    piped standard input when none is given."""
    if args.prompt_pos == "-" or (args.prompt_pos is None and not args.prompt and not args.prompts
                                  and not sys.stdin.isatty()):
        text = read_stdin_prompt()
        if not text.strip():
            raise UsageError("no prompt given: standard input was empty; pass PROMPT, --prompt P, --prompts FILE "
                             "or pipe the prompt text")
        args.prompt_pos = text
    return collect_prompts(args)


def cmd_generate(args) -> int:
    from specjax.api import generate_text
    from specjax.runtime.progress import Progress

    s = resolve(args)
    template_kwargs = _template_kwargs(args.chat_template_kwargs, s["chat"])
    prompts = generate_prompts(args)
    gamma = parse_gamma(s["gamma"])
    # before the model loads: the vocabulary size from the GGUF metadata or config.json (a hub id: after the load)
    req = s["request"]  # the declared request (runtime.request.Request) with the batch size
    check_logprobs(req.logprobs, None if req.logprobs is None else peek_vocab_size(s["model"]))
    bias = dict(s["sampling"].logit_bias)
    vocab = peek_vocab_size(s["model"]) if bias else None
    if vocab is not None and max(bias) >= vocab:
        raise UsageError(f"logit_bias names token id {max(bias)}, outside the vocabulary [0, {vocab}); use ids "
                         f"below {vocab}")
    mesh = None
    if args.mesh:
        from specjax.runtime import sharding

        mesh = sharding.MeshSpec.parse(args.mesh)
    progress = None if env.get("SPECJAX_NO_PROGRESS") else Progress()
    tree = s["tree"]
    from specjax.models import cpu_attention

    cpu_attention.start_build()  # a cold start: the CPU kernels compile while the weights load
    if "int8" in (s["dtype"], s["draft_dtype"]) or s["dtype"] == "auto":
        from specjax.models import q8

        q8.start_build()
    tag = program_tag(s, args)
    if tag is not None:  # the programs the last run with these settings used: compiled while the weights load
        programs.prefetch(tag)
    target, drafter = load_for_generate(s, gamma, mesh, progress)
    check_logprobs(req.logprobs, target.config.vocab_size)
    chat = chat_default(target, s["chat"])
    if template_kwargs is not None and not chat:
        raise UsageError("--chat-template-kwargs needs the chat template, and this model's tokenizer has none; "
                         "drop --chat-template-kwargs")
    s["chat_template_kwargs"] = template_kwargs
    if s["max_new_tokens_given"] and target.tokenizer is not None:  # the cap of each prompt, said once
        from specjax.api import encode_prompts

        ids = encode_prompts(target, [p["prompt"] for p in prompts], chat, s["parse_special"], template_kwargs)
        note_prompt_caps(s["max_new_tokens"], [len(x) for x in ids], target, drafter)
    if gamma == "auto":  # resolve() already refused --gamma auto without a drafter (and with a tree)
        gamma = auto_gamma(target, drafter, prompts, s, args, chat, progress)
        if gamma is None:  # speculation is not predicted to pay: decode without it (the note said so)
            drafter, gamma = None, 1
    stream = not args.json and not args.no_stream and args.batch_size == 1
    method = "autoregressive"
    if drafter is not None:
        method = f"speculative, drafter {drafter.name}, " + (f"γ = {gamma}" if tree is None else tree.label)
    if progress is not None:
        progress.note(f"generating ({method}; {'chat template' if chat else 'raw text, no chat template'}"
                      f"{'' if s['chat'] is not None else ' (the default for this model; --chat/--no-chat to choose)'}"
                      f"{'; streaming' if stream else ''})")
    on_text, on_done = _printers(args, prompts, stream, drafter)
    generate_text(
        target, [p["prompt"] for p in prompts], drafter=drafter, gamma=gamma,
        **({} if tree is None or drafter is None else
           dict(tree_nodes=tree.nodes, tree_depth=tree.depth, tree_topk=tree.topk)),
        request=req, chat=chat, on_text=on_text if stream else None, on_done=on_done,
        progress=progress, parse_special=s["parse_special"], chat_template_kwargs=template_kwargs,
    )
    if tag is not None:
        programs.remember(tag)
    return 0


def program_tag(s: dict, args) -> str | None:
    """A digest of every setting of this ``generate`` but its prompts (and seed): runs with the
    same tag compile the same programs but for the prompts' length bucket
    (:func:`specjax.runtime.programs.prefetch`); None when a setting has no stable text."""
    import hashlib

    text = repr(("generate", sorted((k, repr(v)) for k, v in s.items() if k not in ("request", "stop", "seed")),
                 args.batch_size, args.mesh, len(s.get("stop") or [])))
    if re.search(r"0x[0-9a-fA-F]{6,}", text):
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_for_generate(s: dict, gamma, mesh, progress):
    """``generate``'s target and drafter, loaded in one progress phase that names them (``--dtype
    auto`` resolved first, timing the target's step as this run calls it); ``(target, drafter)``."""
    from specjax.io.loading import check_source, conversion_cached, recording_loads
    from specjax.runtime.progress import phase

    check_source(s["model"])  # a missing or truncated file, a hub id not in the local cache: one line, before loading
    model = "the default model (SmolLM2-135M-Instruct)" if s["model"] in (None, "default") else s["model"]
    drafting = s["draft"] not in (None, "none")
    draft = {"default": "its shipped drafter"}.get(s["draft"], f"drafter {s['draft']}")
    # --dtype auto: time the target's step as this run calls it (γ + 1 tokens when speculating with a set γ)
    tree = s["tree"]
    step_tokens = (tree.nodes + 1 if tree is not None else gamma + 1) if drafting and gamma != "auto" else 1
    preloaded = resolve_auto_dtype(s, progress, tokens=step_tokens, mesh=mesh)
    what = (f"loading {draft}" if preloaded is not None else f"loading {model}" + (f" and {draft}" if drafting else ""))
    # the converted weights of an earlier run (specjax.io.convcache): no GGUF reader, no conversion
    cached = preloaded is None and mesh is None and conversion_cached(s["model"], s["dtype"])
    with phase(progress if preloaded is None or drafting else None,
               what + f" ({s['dtype']}{', cached conversion' if cached else ''})") as ph, recording_loads() as loads:
        target, drafter = load_target_and_drafter(s, mesh=mesh, target=preloaded, cap_note=False)
        if cached and not (loads and loads[0]["cached"]):  # the target's load came first
            ph.detail = " (converted again)"
    return target, drafter


def _printers(args, prompts: list[dict], stream: bool, drafter):
    """``generate``'s ``(on_text, on_done)``: the streamed text on stdout, and each prompt's result
    as soon as its batch is done (``--json``: one JSON object; else the text, ``--logprobs`` and a
    stderr summary line)."""

    def on_text(i, piece):
        sys.stdout.write(piece)
        sys.stdout.flush()

    def on_done(i, o):  # each prompt's result as soon as its batch is done
        p = prompts[i]
        if args.json:
            rec = {"question_id": p["question_id"], "text": o["text"], "tokens": o["tokens"], "stats": o["stats"]}
            if "logprobs" in o:
                rec["logprobs"] = o["logprobs"]
            print(json.dumps(rec), flush=True)
            return
        print("" if stream else o["text"], flush=True)  # a streamed text gets its final newline
        for r in o.get("logprobs", []):
            alts = "  ".join(f"{a['token']!r} {a['logprob']:.3f}" for a in r["top_logprobs"])
            print(f"{r['token']!r}\t{r['logprob']:.4f}" + (f"\t{alts}" if alts else ""), flush=True)
        st = o["stats"]
        extra = ""
        if drafter is not None:
            extra = (f", {_num(st['mean_accepted_tokens'], 2)} tokens/target call, "
                     f"acceptance {_num(st['acceptance_rate'], 2)}")
        print(f"[{st['new_tokens']} tokens, {_num(st['tokens_per_s'], 1)} tokens/s{extra}, "
              f"finish: {st['finish_reason']}]", file=sys.stderr, flush=True)

    return on_text, on_done


def _template_kwargs(text: str | None, chat: bool | None) -> dict | None:
    """``--chat-template-kwargs JSON`` as a dict (``None`` when not given), checked before any load.

    Raises:
      UsageError: not a JSON object, or given together with ``--no-chat``."""
    if text is None:
        return None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--chat-template-kwargs is not valid JSON ({e.msg} at character {e.pos}); give an object "
                         "such as '{\"enable_thinking\": false}'") from None
    if not isinstance(d, dict):
        raise UsageError(f"--chat-template-kwargs must be a JSON object, got {type(d).__name__}; e.g. "
                         "'{\"enable_thinking\": false}'")
    if chat is False:
        raise UsageError("--chat-template-kwargs needs the chat template; drop --no-chat")
    return d


def _num(x: float | None, digits: int) -> str:
    """A statistic for the summary line; "–" for no data (``None``)."""
    return "–" if x is None else f"{x:.{digits}f}"


def auto_gamma(target, drafter, prompts, s: dict, args, chat: bool, progress) -> int | None:
    """``--gamma auto``: γ from costs and α measured quickly or read from the measurement cache
    (:func:`specjax.eval.measure.recommend`), on the run's prompts as they are encoded, its
    sampling settings and ``max_new_tokens``; one ``specjax: note:`` line says what was chosen
    and from what. ``None`` when even the best γ is predicted slower than autoregressive
    decoding (predicted speedup < 1): then the run decodes without speculation, and the note
    says so."""
    from specjax.api import encode_prompts
    from specjax.eval import hostcache, measure
    from specjax.runtime.settings import DecodeSettings

    texts = [p["prompt"] for p in prompts[: measure.AUTO_PROMPTS]]
    recs = [{"ids": ids} for ids in encode_prompts(target, texts, chat, s["parse_special"],
                                                    s.get("chat_template_kwargs"))]
    settings = DecodeSettings(max_new_tokens=s["max_new_tokens"], sampling=s["sampling"], seed=s["seed"],
                              ignore_eos=s["ignore_eos"])
    batch = max(1, min(int(args.batch_size), len(prompts)))  # rows decoded together: costs are timed at it
    gamma, rep = measure.recommend(target, drafter, recs, settings, cache=hostcache.default_cache(),
                                   progress=progress, batch=batch)
    g = gamma - 1

    def src(x):
        return f"cached {x['created']}" if x["cached"] else "measured now"
    alpha = (f"α = {rep['alpha']:.2f}" if not rep.get("alpha_by_position") else
             "α by position " + " ".join(_num(x, 2) for x in rep["alpha_by_position"][:gamma]))
    why = (f"{alpha} ({src(rep['alpha_source'])}), c(γ) = {rep['c'][g]:.3f} and v(γ) = "
           f"{rep['v'][g]:.2f} at batch {batch} ({src(rep['costs_source'])}): predicted "
           f"{rep['predicted_speedup']:.2f}× over autoregressive")
    if not rep["predicted_speedup"] >= 1:
        note(f"--gamma auto chose no speculation (autoregressive decoding): speculation is not predicted to pay "
             f"here, the best γ = {gamma} has {why}; give --gamma N to speculate anyway")
        return None
    note(f"--gamma auto chose γ = {gamma}: {why}")
    return gamma


def register_cli(subparsers) -> None:
    g = subparsers.add_parser("generate", help="generate text (autoregressive or speculative)")
    g.add_argument("prompt_pos", nargs="?", metavar="PROMPT",
                   help="prompt text; '-' (or no prompt with piped input) reads it from standard input")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompts", metavar="FILE", help="JSONL: 'prompt' or Spec-Bench 'turns' per line")
    add_model_args(g, auto_dtype=True)
    g.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout (printed at the end)")
    g.add_argument("--no-stream", action="store_true",
                   help="print each text at the end instead of streaming it as it is generated")
    g.add_argument("--chat-template-kwargs", metavar="JSON", default=None,
                   help="extra chat-template variables as a JSON object, e.g. '{\"enable_thinking\": false}' "
                        "(Qwen3: no thinking block); needs the chat template")
    g.set_defaults(func=cmd_generate)
