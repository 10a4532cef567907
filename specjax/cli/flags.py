"""The shared flags of ``generate`` / ``bench`` / ``analyze`` and the settings made of them (part
of :mod:`specjax.cli.common`, which re-exports them): ``--config`` pair configs merged with the
flags (flags win), every setting validated before anything expensive runs (:func:`resolve`), the
draft tree and γ checks, and the chat-template rule of every command (:func:`chat_default`)."""

from __future__ import annotations

import argparse
import re

from specjax.cli.errors import UsageError, note

DTYPES = ("float32", "bfloat16", "int8")


def add_model_flag(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--model``: the target (every command that names one; ``help``: a command's own wording)."""
    p.add_argument("--model", default=None, help=help or "target: .gguf file, HF model dir or hub id (default: embedded "
                                                         "SmolLM2-135M-Instruct)")


def add_draft_flags(p: argparse.ArgumentParser, multi_draft: bool = False) -> None:
    """``--draft`` and ``--gamma`` (``multi_draft``: several of each, for bench)."""
    if multi_draft:
        p.add_argument("--draft", nargs="+", default=None, help="drafters: none, ngram[:N], default, shipped:NAME, PATH_OR_ID (several allowed)")
        p.add_argument("--gamma", nargs="+", default=None, help="draft tokens per round γ (several allowed)")
    else:
        p.add_argument("--draft", default=None, help="drafter: none, ngram[:N], default (trained, shipped), shipped:NAME (any drafter under models/), PATH_OR_ID")
        p.add_argument("--gamma", default=None, help="draft tokens per round γ (num_draft_tokens), or 'auto'")


def add_dtype_flag(p: argparse.ArgumentParser, auto_dtype: bool = False) -> None:
    """``--dtype``: the target's weight format (``auto_dtype``: also ``auto``)."""
    if auto_dtype:
        p.add_argument("--dtype", default=None, choices=[*DTYPES, "auto"],
                       help="target weight format; auto: the fastest decode step on this host (measured once, cached)")
    else:
        p.add_argument("--dtype", default=None, choices=list(DTYPES), help="target weight format")


def add_mesh_flag(p: argparse.ArgumentParser) -> None:
    """``--mesh data=D,model=M``."""
    p.add_argument("--mesh", default=None, help="device mesh, e.g. data=2,model=4 (default: one device)")


def add_model_args(p: argparse.ArgumentParser, multi_draft: bool = False, mesh: bool = True,
                   auto_dtype: bool = False, trees: bool = True) -> None:
    """Flags shared by generate / bench / analyze (``auto_dtype``: ``--dtype`` also takes ``auto``;
    ``trees``: the ``--tree-*`` flags)."""
    p.add_argument("--config", help="pair config: a TOML path or the name of a shipped config in configs/")
    add_model_flag(p)
    add_draft_flags(p, multi_draft)
    if trees:
        p.add_argument("--tree-nodes", type=int, default=None, metavar="N",
                       help="draft trees instead of chains (with --tree-depth and --tree-topk): N nodes per round, "
                            "verified in one target call")
        p.add_argument("--tree-depth", type=int, default=None, metavar="D",
                       help="the deepest tree node: at most D drafts accepted per round (a tree's γ)")
        p.add_argument("--tree-topk", type=int, default=None, metavar="K",
                       help="at most K children per tree node (K = 1: the chain of γ = D drafts)")
    add_dtype_flag(p, auto_dtype)
    p.add_argument("--draft-dtype", default=None, choices=list(DTYPES),
                   help="drafter weight format (default: the target's)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="cap the target's context at N tokens, prompt + new (default: the model's maximum): "
                        "buffers, KV caches and prompt limits are sized for N")
    add_knob_args(p, sampling_class())
    add_knob_args(p, request_class(), command=p.prog.split()[-1])  # --max-new-tokens, --seed, --ignore-eos, ...
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the model's chat template (generate: on when the model has one; "
                        "--no-chat sends raw text)")
    p.add_argument("--no-parse-special", dest="parse_special", action="store_false", default=None,
                   help="tokenize prompt text as plain text: a typed <|im_start|> etc. does not become a control "
                        "token (with --chat only the template's own special tokens do). Default: parsed")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    if mesh:
        add_mesh_flag(p)


def sampling_class():
    """THE declaration of the sampling settings (:class:`specjax.core.sampling.Sampling`), looked up
    when used: flags, config keys and checks all follow it."""
    from specjax.core import sampling

    return sampling.Sampling


def request_class():
    """THE declaration of a request's fields (:class:`specjax.runtime.request.Request`), looked up
    when used: flags, config keys and checks all follow it."""
    from specjax.runtime.request import request_class as declared

    return declared()


def add_knob_args(p: argparse.ArgumentParser, cls, command: str | None = None) -> None:
    """One flag ``--name-with-dashes`` per declared field of a settings class that is a flag of
    ``command`` (:func:`specjax.core.settings.knob`): its type (a switch for a bool, repeatable for
    a tuple), its help with the default; ``None`` when not given (so a pair config's value applies)."""
    from specjax.core.settings import knobs

    for name, k, default in knobs(cls):
        if not k.flag_for(command):
            continue
        flag = "--" + name.replace("_", "-")
        if k.kind is bool:
            p.add_argument(flag, action="store_true", default=None, help=k.help)
        elif k.kind is tuple:
            p.add_argument(flag, action="append", default=None, metavar=k.metavar, help=k.help)
        else:
            shown = "" if default is None else f" (default {default})"
            p.add_argument(flag, type=k.kind, default=None, metavar=k.metavar, help=f"{k.help}{shown}")


def unescape(text: str) -> str:
    """``\\n``, ``\\t`` and ``\\\\`` typed on a command line as newline, tab and backslash (``--stop "\\n\\n"``)."""
    return re.sub(r"\\(n|t|\\)", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def flag_words(message: str, names) -> str:
    """A settings error's field names (``max_new_tokens``) as the flags a user types (``--max-new-tokens``)."""
    for n in sorted(names, key=len, reverse=True):
        message = re.sub(rf"(?<![\w-]){n}(?![\w])", "--" + n.replace("_", "-"), message)
    return message


def request_of(s: dict, batch_size: int | None = 1):
    """The :class:`~specjax.runtime.settings.DecodeSettings` (a declared request with a batch size) of
    resolved settings ``s``: every declared request field (:func:`request_class`) and the sampling.

    Raises UsageError ``--flag must be …`` for a value out of its declared range (or a cross-field rule)."""
    from specjax.core.settings import SettingError, knobs
    from specjax.runtime.settings import DecodeSettings

    names = [n for n, _, _ in knobs(request_class())]
    try:
        return DecodeSettings(batch_size=batch_size, sampling=s["sampling"], **{n: s[n] for n in names if n in s})
    except SettingError as e:
        raise UsageError(flag_words(str(e), names + [n for n, _, _ in knobs(sampling_class())])) from None


def sampling_of(s: dict):
    """The :class:`~specjax.core.sampling.Sampling` of resolved settings ``s`` (:func:`resolve`).

    Raises UsageError ``--flag must be …`` for a value out of its declared range."""
    from specjax.core.settings import SettingError, knobs

    cls = sampling_class()
    try:
        return cls(**{n: s[n] for n, _, _ in knobs(cls) if n in s})
    except SettingError as e:
        msg = str(e)
        flag = "--" + e.name.replace("_", "-")
        raise UsageError(flag + msg[len(e.name):] if msg.startswith(e.name) else f"{flag}: {msg}") from None


TREE_FLAGS = ("tree_nodes", "tree_depth", "tree_topk")


def chat_default(target, given) -> bool:
    """THE chat-template rule of every command: ``given`` (``--chat`` / ``--no-chat`` or the pair
    config's ``chat``) when set, else on exactly when the model has a chat template."""
    if given is not None:
        return bool(given)
    return target.tokenizer is not None and bool(target.tokenizer.chat_template)


SHIPPED_PAIR = "smollm2-default"  # the pair config of the default model and its shipped drafter


def shipped_pair_method() -> dict:
    """``--draft default``'s method when neither ``--gamma`` nor a tree is given: the shipped pair
    config's (``configs/smollm2-default.toml``), so ``--draft default`` decodes alike with or without
    ``--config``. Returns ``{"gamma": g}`` or ``{"tree": TreeShape}``."""
    from specjax.api import load_pair_config
    from specjax.core.drafting import TreeShape

    cfg = load_pair_config(SHIPPED_PAIR)
    if all(k in cfg for k in TREE_FLAGS):
        return {"tree": TreeShape(*(cfg[k] for k in TREE_FLAGS))}
    return {"gamma": cfg["gamma"]}


def tree_setting(args, cfg: dict):
    """The draft tree of the flags (all three ``--tree-*`` together), else of the pair config
    (unless ``--gamma`` is given: a flag wins over the config's tree), else ``None``.

    Raises:
      UsageError: some but not all ``--tree-*`` flags, or sizes out of range.
    """
    from specjax.core.drafting import TreeShape

    flags = {k: getattr(args, k, None) for k in TREE_FLAGS}
    if any(v is not None for v in flags.values()):
        missing = ["--" + k.replace("_", "-") for k, v in flags.items() if v is None]
        if missing:
            raise UsageError(f"--tree-nodes, --tree-depth and --tree-topk go together; missing {', '.join(missing)}")
        vals = flags
    elif all(k in cfg for k in TREE_FLAGS) and getattr(args, "gamma", None) is None:
        vals = {k: cfg[k] for k in TREE_FLAGS}
    else:
        return None
    try:
        return TreeShape(vals["tree_nodes"], vals["tree_depth"], vals["tree_topk"])
    except ValueError as e:
        raise UsageError(f"--tree-*: {e}") from None


def resolve(args, default_draft=None, need_draft: str | None = None, tree_with_gamma: bool = False) -> dict:
    """Merge ``--config`` with explicit flags (flags win) into plain settings, and validate
    every setting (sampling, ``--draft``, ``--gamma``, ``--tree-*``, ``--seed``, ``--batch-size``,
    ``--mesh``) before anything expensive runs. ``default_draft``: the drafter when none is given;
    ``need_draft``: the error message when a drafter is required and none is given;
    ``tree_with_gamma``: ``--gamma`` may come with a tree (bench compares both), else they
    are alternatives. ``s["tree"]``: a :class:`~specjax.core.drafting.TreeShape` or ``None``."""
    from specjax.api import load_pair_config

    cfg = load_pair_config(args.config) if args.config else {}

    def pick(name, default):
        v = getattr(args, name, None)
        return cfg.get(name, default) if v is None else v

    s = {
        "model": pick("model", None),
        "draft": pick("draft", None),
        "gamma": pick("gamma", None),
        "dtype": pick("dtype", "float32"),
        "draft_dtype": pick("draft_dtype", None),
        "max_new_tokens": pick("max_new_tokens", 128),
        "max_model_len": getattr(args, "max_model_len", None),
        "chat": pick("chat", None),  # None: the command's default (generate: the model's template if any)
        "parse_special": bool(pick("parse_special", True)),
        # given by the user (flag or config), not the default: only then is a cap worth a note
        "max_new_tokens_given": getattr(args, "max_new_tokens", None) is not None or "max_new_tokens" in cfg,
    }
    from specjax.core.settings import knobs

    for name, _, default in knobs(sampling_class()):  # every declared sampling field
        s[name] = pick(name, default)
    for name, k, default in knobs(request_class()):  # every declared request field
        s[name] = pick(name, default)
        if k.kind is tuple and getattr(args, name, None) is not None:  # a repeated flag: typed escapes
            s[name] = [unescape(x) if isinstance(x, str) else x for x in s[name]]
    if s["draft_dtype"] is not None and getattr(args, "draft_dtype", None) is not None \
            and s["draft"] in (None, "none", [], ["none"]) and not default_draft:
        note(f"--draft-dtype {s['draft_dtype']} has no effect without a drafter (add --draft default, ngram or a path)")
    if s["draft_dtype"] is None:
        s["draft_dtype"] = s["dtype"]
    draft_given = s["draft"] is not None
    if s["draft"] is None:
        s["draft"] = default_draft
    if need_draft and s["draft"] in (None, "none", [], ["none"]):
        raise UsageError(need_draft)
    s["tree"] = tree_setting(args, cfg)
    if s["gamma"] is None and s["tree"] is None and _is_default_drafter(s["draft"]):
        s.update(shipped_pair_method())  # the shipped pair's γ or tree, with or without --config
    if s["tree"] is not None and not draft_given:  # not bench's default n-gram, silently
        where = f"config {args.config}: tree keys need a drafter; add draft = \"default\" (or \"ngram\")" \
            if args.config and any(k in cfg for k in ("tree_nodes", "tree_depth", "tree_topk")) else \
            "--tree-nodes/--tree-depth/--tree-topk need a drafter; add --draft default (or ngram, or an EAGLE drafter path)"
        raise UsageError(where)
    check_tree(args, s, tree_with_gamma)
    try:
        check_settings(args, s)
    except UsageError as e:  # a value read from the config file: name the file and key, not a flag
        m = re.match(r"--([a-z0-9-]+) (.*)", str(e), re.S)
        key = m.group(1).replace("-", "_") if m else None
        if key in cfg and getattr(args, key, None) is None:
            raise UsageError(f"config {args.config}: {key} {m.group(2)}") from None
        raise
    return s


def _is_default_drafter(draft) -> bool:
    """Whether ``--draft`` names the shipped default drafter alone (the registry's ``default`` kind)."""
    from specjax.drafters import registry

    drafts = draft if isinstance(draft, (list, tuple)) else [draft]
    return len(drafts) == 1 and registry.find_kind(drafts[0]) is registry.KINDS["default"]


def check_tree(args, s: dict, tree_with_gamma: bool) -> None:
    """A tree needs a drafter that proposes trees (top-k > 1: its kind's drafter declares
    ``proposes_trees``; not a draft model) and, unless ``tree_with_gamma``, no ``--gamma``.
    Raises UsageError."""
    from specjax.drafters import registry

    tree = s["tree"]
    if tree is None:
        return
    drafts = s["draft"] if isinstance(s["draft"], (list, tuple)) else [s["draft"]]
    drafts = [d for d in drafts if d not in (None, "none")]
    if not drafts:
        raise UsageError("--tree-nodes/--tree-depth/--tree-topk need a drafter; add --draft default (or ngram, or "
                         "an EAGLE drafter path)")
    if getattr(args, "gamma", None) is not None and not tree_with_gamma:
        raise UsageError("--gamma and --tree-* are alternatives (a tree's --tree-depth is its γ); drop one")
    if tree.topk > 1:
        for d in drafts:
            if not registry.proposes_trees(d):
                raise UsageError(f"--draft {d} is {registry.kind_words(d)}, which proposes chains only; a tree with "
                                 f"--tree-topk {tree.topk} needs --draft default, ngram or an EAGLE drafter "
                                 "directory (or use --tree-topk 1)")


def check_settings(args, s: dict) -> None:
    from specjax.api import check_draft_spec

    if s.get("max_model_len") is not None and s["max_model_len"] < 2:
        raise UsageError(f"--max-model-len must be an integer >= 2 (a prompt token and a new one), "
                         f"got {s['max_model_len']}")
    s["sampling"] = sampling_of(s)
    if getattr(args, "batch_size", 1) < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    s["request"] = request_of(s, getattr(args, "batch_size", 1))  # the declared ranges and cross-field rules
    drafts = s["draft"] if isinstance(s["draft"], (list, tuple)) else [s["draft"]]
    for d in drafts:
        check_draft_spec(d)
    capped = None if all(d in (None, "none") for d in drafts) else cap_gamma(s)
    gammas = s["gamma"] if isinstance(s["gamma"], (list, tuple)) else [s["gamma"]]
    for g in gammas:
        parse_gamma(g)
    if all(d in (None, "none") for d in drafts) and s["gamma"] is not None:
        if "auto" in gammas:
            raise UsageError("--gamma auto needs a drafter; add --draft ngram (or default, or a drafter path)")
        note(f"--gamma {' '.join(str(g) for g in gammas)} has no effect without a drafter "
             "(autoregressive decoding); add --draft ngram (or default, or a drafter path) to speculate")
    if getattr(args, "mesh", None):
        from specjax.runtime import sharding

        sharding.MeshSpec.parse(args.mesh)
    if capped:
        note(capped)


def parse_gamma(value, default=4) -> int | str:
    """``--gamma``: an integer in [1, ``MAX_GAMMA``] or ``"auto"`` (``default`` when ``None``).

    Raises:
      UsageError: not an integer, below 1, or above ``MAX_GAMMA`` (64).
    """
    from specjax.core.drafting import MAX_GAMMA

    if value is None:
        return default
    if value == "auto":
        return "auto"
    try:
        g = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"--gamma must be an integer >= 1 or 'auto', got {value!r}") from None
    if g < 1:
        raise UsageError(f"--gamma must be an integer >= 1 (draft tokens per round), got {g}")
    if g > MAX_GAMMA:
        raise UsageError(f"--gamma {g} is above the limit of {MAX_GAMMA} draft tokens per round; use --gamma "
                         f"{MAX_GAMMA} or less (or --gamma auto, or a draft tree: --tree-nodes/--tree-depth/--tree-topk)")
    return g


def cap_gamma(s: dict) -> str | None:
    """A single set γ above ``max_new_tokens`` is lowered to it (a round never drafts more than the
    tokens still to generate), before :func:`parse_gamma` checks the bound. Returns the note to
    print once every setting is checked, or ``None``."""
    g = s["gamma"]
    if isinstance(g, (list, tuple)) or g in (None, "auto"):
        return None
    try:
        g = int(g)
    except (TypeError, ValueError):
        return None  # parse_gamma says what is wrong
    from specjax.core.drafting import MAX_GAMMA

    if g > s["max_new_tokens"] >= 1 and s["max_new_tokens"] <= MAX_GAMMA:  # else parse_gamma refuses g
        s["gamma"] = s["max_new_tokens"]
        return (f"--gamma {g} is more than --max-new-tokens {s['max_new_tokens']}: speculating with γ = "
                f"{s['max_new_tokens']} (a round never drafts more than the tokens still to generate)")
    return None
