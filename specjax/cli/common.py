"""Shared pieces of the command line: argument groups, settings from flags and pair configs
(validated before anything expensive), prompts, and the one-line error form.

Every user error becomes one line ``specjax: error: …`` (:func:`describe_error`) with exit
status 2; ``SPECJAX_DEBUG=1`` re-raises with the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from specjax.models.config import CheckpointError


class UsageError(ValueError):
    """A bad command-line value (reported as one line, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse errors as one line ``specjax: error: …`` (exit status 2) naming the command and
    pointing at ``--help``, instead of a usage block (subparsers inherit this class)."""

    def error(self, message):
        self.exit(2, f"specjax: error: {message} (see `{self.prog} --help`)\n")


def note(msg: str) -> None:
    """One stderr line ``specjax: note: …`` (something was adjusted, nothing failed)."""
    print(f"specjax: note: {msg}", file=sys.stderr)


def describe_error(e: BaseException) -> str:
    """The one-line text of a user-facing error: OS errors name the path and say what to do;
    file-format errors (not UTF-8, bad TOML/JSON, a corrupt safetensors file) name the file
    where the raiser did not."""
    import tomllib

    if isinstance(e, OSError) and e.filename is not None and not isinstance(e, FileNotFoundError):
        path = e.filename
        fix = {
            IsADirectoryError: "it is a directory; give a file",
            NotADirectoryError: "a part of the path is a file, not a directory; choose another path",
            PermissionError: "permission denied; choose a path you may read/write or fix its permissions",
            FileExistsError: "it already exists; choose another path",
        }.get(type(e), f"{e.strerror or e}")
        return f"{path}: {fix}"
    if isinstance(e, FileNotFoundError) and e.filename is not None:
        return f"{e.filename}: no such file or directory; check the path"
    if isinstance(e, UnicodeDecodeError):
        return f"input is not valid UTF-8 ({e.reason} at byte {e.start}); save it as UTF-8"
    if isinstance(e, tomllib.TOMLDecodeError):
        return f"not valid TOML ({e}); fix the syntax"
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix the syntax"
    if type(e).__name__ == "SafetensorError":
        return f"a safetensors file is truncated or corrupt ({e}); re-download or re-save the checkpoint"
    return str(e)


def _user_errors() -> tuple:
    """Exception types ``main()`` reports as one line: usage, checkpoint and file-format errors
    (all ValueError subclasses: JSON, TOML, UnicodeDecodeError), OS errors, SafetensorError."""
    types = [UsageError, ValueError, CheckpointError, OSError]
    try:
        from safetensors import SafetensorError

        types.append(SafetensorError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


class _CacheLogFilter:
    """Drops the compiler's log records about the persistent cache (see :func:`enable_compilation_cache`)."""

    def filter(self, record) -> bool:
        return "cache" not in record.getMessage().lower()


_CACHE_LOG_FILTER = _CacheLogFilter()


def enable_compilation_cache(path: str | None = None) -> bool:
    """Persistent JAX compilation cache (``$SPECJAX_CACHE`` or ``~/.cache/specjax/jax``), when
    that directory can be created and written; otherwise one ``specjax: note:`` line and the
    run goes on without it. JAX's own warnings about cache entries it cannot read or write
    (a cache that breaks during the run) are silenced: the cache only saves compile time.
    Returns whether the cache is on."""
    import logging
    import warnings

    import jax

    given = path or os.environ.get("SPECJAX_CACHE")
    path = given or os.path.expanduser("~/.cache/specjax/jax")
    probe = os.path.join(path, f".specjax-write-check-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        var = "SPECJAX_CACHE" if given else "SPECJAX_CACHE (default ~/.cache/specjax/jax)"
        note(f"the compilation cache {path} cannot be written ({e.strerror or type(e).__name__}); running without "
             f"it (compiles are not kept for the next run): point {var} at a writable directory, "
             "or set SPECJAX_NO_CACHE=1")
        return False
    warnings.filterwarnings("ignore", message=r"(Error (reading|writing) persistent compilation cache entry"
                                              r"|Cache value for key)")
    for name in ("jax._src.compilation_cache", "jax._src.lru_cache"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    compiler_log = logging.getLogger("jax._src.compiler")  # "unable to generate cache key, skipping the cache"
    if _CACHE_LOG_FILTER not in compiler_log.filters:
        compiler_log.addFilter(_CACHE_LOG_FILTER)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return True


DTYPES = ("float32", "bfloat16", "int8")


def add_model_args(p: argparse.ArgumentParser, multi_draft: bool = False, mesh: bool = True,
                   auto_dtype: bool = False, trees: bool = True) -> None:
    """Flags shared by generate / bench / analyze (``auto_dtype``: ``--dtype`` also takes ``auto``;
    ``trees``: the ``--tree-*`` flags)."""
    p.add_argument("--config", help="pair config: a TOML path or the name of a shipped config in configs/")
    p.add_argument("--model", default=None, help="target: .gguf file, HF model dir or hub id (default: embedded SmolLM2-135M-Instruct)")
    if multi_draft:
        p.add_argument("--draft", nargs="+", default=None, help="drafters: none, ngram[:N], default, PATH_OR_ID (several allowed)")
        p.add_argument("--gamma", nargs="+", default=None, help="draft tokens per round γ (several allowed)")
    else:
        p.add_argument("--draft", default=None, help="drafter: none, ngram[:N], default (trained, shipped), PATH_OR_ID")
        p.add_argument("--gamma", default=None, help="draft tokens per round γ (num_draft_tokens), or 'auto'")
    if trees:
        p.add_argument("--tree-nodes", type=int, default=None, metavar="N",
                       help="draft trees instead of chains (with --tree-depth and --tree-topk): N nodes per round, "
                            "verified in one target call")
        p.add_argument("--tree-depth", type=int, default=None, metavar="D",
                       help="the deepest tree node: at most D drafts accepted per round (a tree's γ)")
        p.add_argument("--tree-topk", type=int, default=None, metavar="K",
                       help="at most K children per tree node (K = 1: the chain of γ = D drafts)")
    if auto_dtype:
        p.add_argument("--dtype", default=None, choices=[*DTYPES, "auto"],
                       help="target weight format; auto: the fastest decode step on this host (measured once, cached)")
    else:
        p.add_argument("--dtype", default=None, choices=list(DTYPES), help="target weight format")
    p.add_argument("--draft-dtype", default=None, choices=list(DTYPES),
                   help="drafter weight format (default: the target's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per prompt (default 128)")
    add_knob_args(p, sampling_class())
    p.add_argument("--seed", type=int, default=0, help="request seed, an integer in [0, 2**64) (prompt i uses fold_in(key(seed), i); default 0)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the model's chat template (generate: on when the model has one; "
                        "--no-chat sends raw text)")
    p.add_argument("--no-parse-special", dest="parse_special", action="store_false", default=None,
                   help="tokenize prompt text as plain text: a typed <|im_start|> etc. does not become a control "
                        "token (with --chat only the template's own special tokens do). Default: parsed")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS (fixed-length benchmarks)")
    if mesh:
        p.add_argument("--mesh", default=None, help="device mesh, e.g. data=2,model=4 (default: one device)")


def sampling_class():
    """THE declaration of the sampling settings (:class:`specjax.core.sampling.Sampling`), looked up
    when used: flags, config keys and checks all follow it."""
    from specjax.core import sampling

    return sampling.Sampling


def add_knob_args(p: argparse.ArgumentParser, cls) -> None:
    """One flag ``--name-with-dashes`` per declared field of a settings class that is a flag
    (:func:`specjax.core.settings.knob`): its type, its help with the default; ``None`` when not
    given (so a pair config's value applies)."""
    from specjax.core.settings import knobs

    for name, k, default in knobs(cls):
        if k.flag:
            p.add_argument("--" + name.replace("_", "-"), type=k.kind, default=None,
                           help=f"{k.help} (default {default})")


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


def _tree_setting(args, cfg: dict):
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
        "chat": pick("chat", None),  # None: the command's default (generate: the model's template if any)
        "parse_special": bool(pick("parse_special", True)),
        # given by the user (flag or config), not the default: only then is a cap worth a note
        "max_new_tokens_given": getattr(args, "max_new_tokens", None) is not None or "max_new_tokens" in cfg,
    }
    from specjax.core.settings import knobs

    for name, _, default in knobs(sampling_class()):  # every declared sampling field
        s[name] = pick(name, default)
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
    s["tree"] = _tree_setting(args, cfg)
    if s["gamma"] is None and s["tree"] is None and s["draft"] in ("default", ["default"]):
        s.update(shipped_pair_method())  # the shipped pair's γ or tree, with or without --config
    if s["tree"] is not None and not draft_given:  # not bench's default n-gram, silently
        where = f"config {args.config}: tree keys need a drafter; add draft = \"default\" (or \"ngram\")" \
            if args.config and any(k in cfg for k in ("tree_nodes", "tree_depth", "tree_topk")) else \
            "--tree-nodes/--tree-depth/--tree-topk need a drafter; add --draft default (or ngram, or an EAGLE drafter path)"
        raise UsageError(where)
    _check_tree(args, s, tree_with_gamma)
    try:
        _check_settings(args, s)
    except UsageError as e:  # a value read from the config file: name the file and key, not a flag
        m = re.match(r"--([a-z0-9-]+) (.*)", str(e), re.S)
        key = m.group(1).replace("-", "_") if m else None
        if key in cfg and getattr(args, key, None) is None:
            raise UsageError(f"config {args.config}: {key} {m.group(2)}") from None
        raise
    return s


def _check_tree(args, s: dict, tree_with_gamma: bool) -> None:
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


def _check_settings(args, s: dict) -> None:
    from specjax.api import check_draft_spec

    if s["max_new_tokens"] < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {s['max_new_tokens']}")
    s["sampling"] = sampling_of(s)
    if getattr(args, "batch_size", 1) < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    from specjax.runtime.decoder import SEED_LIMIT

    seed = getattr(args, "seed", 0)
    if not 0 <= seed < SEED_LIMIT:
        raise UsageError(f"--seed must be an integer in [0, 2**64), got {seed}")
    drafts = s["draft"] if isinstance(s["draft"], (list, tuple)) else [s["draft"]]
    for d in drafts:
        check_draft_spec(d)
    capped = None if all(d in (None, "none") for d in drafts) else _cap_gamma(s)
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


def _cap_gamma(s: dict) -> str | None:
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


def collect_prompts(args) -> list[dict]:
    from specjax.io.prompts import read_prompts

    prompts = []
    if getattr(args, "prompt_pos", None) is not None:
        prompts.append({"prompt": args.prompt_pos, "question_id": 0, "category": "cli"})
    for i, p in enumerate(getattr(args, "prompt", None) or []):
        prompts.append({"prompt": p, "question_id": len(prompts), "category": "cli"})
    if getattr(args, "prompts", None):
        prompts.extend(read_prompts(args.prompts))
    if not prompts:
        raise UsageError("no prompt given; pass PROMPT, --prompt P or --prompts FILE")
    for i, p in enumerate(prompts):
        try:
            p["prompt"].encode("utf-8")
        except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as lone surrogates
            raise UsageError(f"prompt {i} is not valid UTF-8 text; pass the prompt in UTF-8 "
                             "(or put it in a UTF-8 --prompts file)") from None
        if not p["prompt"].strip():
            raise UsageError(f"prompt {i} is empty; give a non-empty prompt")
    return prompts


def resolve_auto_dtype(s: dict, progress=None, tokens: int = 1, mesh=None, predict: bool = True):
    """Replace ``s["dtype"] == "auto"`` by the weight format with the fastest target decode step
    on this host (:func:`specjax.eval.measure.fastest_format`: measured once, then read from the
    measurement cache; with ``predict``, hosts of a kind with a measured winner take it without
    measuring, unless a measurement is cached), and a drafter format that follows it (not given) by the same; one
    ``specjax: note:`` line says which format and why. ``tokens``: new tokens per target call
    (1, or γ + 1 when speculating). Returns the target loaded (in that format) for the
    measurement, or ``None`` (cached, or a mesh: load it as usual).

    Raises:
      CheckpointError: the model cannot be loaded.
    """
    from specjax.eval import hostcache, measure

    if s.get("dtype") != "auto":
        return None
    follow = s.get("draft_dtype") in (None, "auto")
    fmt, info, model = measure.fastest_format(s["model"], tokens=tokens, cache=hostcache.default_cache(),
                                              progress=progress, predict=predict)
    s["dtype"] = fmt
    if follow:
        s["draft_dtype"] = fmt
    note(auto_dtype_line(fmt, info))
    return model if mesh is None else None


def auto_dtype_line(fmt: str, info: dict) -> str:
    """``--dtype auto``'s one line: the chosen format, why (predicted, the only faithful one, or
    the fastest faithful step, measured or cached), and the formats dropped by the fidelity bar."""
    from specjax.eval.fidelity import describe

    src = info["source"]
    fid = info.get("fidelity") or {}
    dropped = "; ".join(describe(f, fid[f]) for f in info.get("unfaithful", []) if fid.get(f))
    dropped = f"; not faithful to this model: {dropped}" if dropped else ""
    if src.get("predicted"):
        return (f"--dtype auto chose {fmt} ({src['predicted']}; `specjax bench --dtype auto` measures the "
                f"formats' fidelity and speed on this host and later runs use the measurement){dropped}")
    if src.get("only_faithful"):
        return f"--dtype auto chose {fmt}: the only candidate format faithful to this model{dropped}"
    ms = ", ".join(f"{f} {t:.1f} ms" for f, t in info["step_ms"].items())
    if src["cached"]:
        how = f"cached, measured {src['created']}"
    else:
        how = "measured now" + ("; cached for the next run" if src.get("path") else "")
    return (f"--dtype auto chose {fmt}: the fastest faithful target step on this host ({ms} per "
            f"{info['tokens']}-token call; {how}){dropped}")


def note_unfaithful_format(s: dict) -> None:
    """One ``specjax: note:`` when the target's format, chosen by hand, is known to miss the
    fidelity bar for this model (measured on this host and cached, or shipped for the default
    model: :func:`specjax.eval.fidelity.known`); silent when faithful or not measured."""
    from specjax.eval import fidelity, hostcache

    fmt = s.get("dtype")
    if fmt in (None, "auto") or fmt in fidelity.FAITHFUL_BY_CONSTRUCTION:
        return
    fid = fidelity.known(s.get("model"), fmt, hostcache.default_cache())
    if fid is not None and not fid["faithful"]:
        note(f"--dtype {fmt} is not faithful to this model ({fidelity.describe(fmt, fid)}; the bar: mean KL ≤ "
             f"{fidelity.MAX_KL:g}, top-1 ≥ {fidelity.MIN_TOP1:.0%}): outputs differ from the model's; "
             "--dtype float32 (or auto) runs the model itself")


def load_target_and_drafter(s: dict, draft_spec=None, mesh=None, target=None, cap_note: bool = True):
    """Load the target (unless ``target`` is given, already loaded in ``s["dtype"]``) and
    (optionally) one drafter from resolved settings (``dtype`` ``auto`` is resolved first:
    :func:`resolve_auto_dtype`). ``cap_note``: say when ``--max-new-tokens`` exceeds the context
    (:func:`note_context_cap`; ``generate`` says it per prompt instead: :func:`note_prompt_caps`)."""
    from specjax.api import load_drafter
    from specjax.io.loading import load_model

    if s.get("dtype") == "auto":
        target = resolve_auto_dtype(s, mesh=mesh)
    else:
        note_unfaithful_format(s)
    if target is None:
        target = load_model(s["model"], dtype=s["dtype"], mesh=mesh)
    spec = s["draft"] if draft_spec is None else draft_spec
    drafter = load_drafter(spec, target, dtype=s["draft_dtype"])
    if cap_note and s.get("max_new_tokens_given", True):
        note_context_cap(s["max_new_tokens"], target, drafter)
    return target, drafter


def context_limit(target, drafter=None) -> int:
    """The tokens a row may hold: the target's context, or the drafter's when it is shorter
    (:func:`specjax.core.drafting.row_context`, as the Decoder)."""
    from specjax.core.drafting import row_context

    return row_context(target.config.max_position_embeddings, drafter)


def _context_words(target, lim: int) -> str:
    both = " and its drafter" if lim < target.config.max_position_embeddings else ""
    return f"the context of {target.name}{both} holds {lim} tokens"


def note_context_cap(max_new_tokens: int, target, drafter=None) -> None:
    """A ``specjax: note:`` when ``--max-new-tokens`` exceeds the context (it is capped there)."""
    lim = context_limit(target, drafter)
    if max_new_tokens > lim:
        note(f"--max-new-tokens {max_new_tokens} is capped to {lim} − the prompt length: the context of "
             f"{target.name}{' and its drafter' if lim < target.config.max_position_embeddings else ''} "
             f"holds {lim} tokens")


def note_prompt_caps(max_new_tokens: int, prompt_lengths, target, drafter=None) -> None:
    """One ``specjax: note:`` when prompt length + ``--max-new-tokens`` exceeds the context for
    some prompts (the decoder then generates only up to the context: context − prompt length new
    tokens), naming each such prompt's length and its number of new tokens (the first three).
    Nothing when a prompt does not fit at all (the decoder refuses it in one line)."""
    lim = context_limit(target, drafter)
    lens = [int(n) for n in prompt_lengths]
    if not lens or max(lens) >= lim:
        return
    capped = [(i, n, lim - n) for i, n in enumerate(lens) if n + max_new_tokens > lim]
    if not capped:
        return
    if len(lens) == 1:
        (_, n, m), = capped
        note(f"--max-new-tokens {max_new_tokens} is capped to {m}: the prompt has {n} tokens and "
             f"{_context_words(target, lim)}")
        return
    each = ", ".join(f"prompt {i} ({n} tokens) to {m}" for i, n, m in capped[:3])
    more = f" and {len(capped) - 3} more" if len(capped) > 3 else ""
    note(f"--max-new-tokens {max_new_tokens} is capped for {len(capped)} of {len(lens)} prompts to the context "
         f"minus the prompt: {each}{more} ({_context_words(target, lim)})")


def peek_vocab_size(model) -> int | None:
    """The target's vocabulary size without loading it (a ``.gguf`` file's metadata or a model
    directory's ``config.json``; milliseconds), or ``None`` when that is not cheap (a hub id)
    or the file does not say (the loader then reports the problem)."""
    from specjax.io.files import gguf_vocab_size
    from specjax.io.loading import DEFAULT_MODEL, default_model_path

    path = default_model_path() if model in (None, DEFAULT_MODEL) else os.path.expanduser(str(model))
    if path.endswith(".gguf") and os.path.isfile(path):
        return gguf_vocab_size(path)
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        try:
            with open(cfg, encoding="utf-8") as f:
                v = json.load(f).get("vocab_size")
        except (OSError, ValueError, AttributeError):
            return None
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
    return None


def check_logprobs(n, vocab_size: int | None, where: str = "") -> None:
    """``--logprobs N``: an integer in [0, vocabulary size] (``vocab_size`` ``None``: unknown yet).

    Raises:
      UsageError: naming the flag, the bound and the fix.
    """
    if n is None:
        return
    if n < 0:
        raise UsageError(f"--logprobs must be an integer >= 0 (top alternatives per token), got {n}")
    if vocab_size is not None and n > vocab_size:
        raise UsageError(f"--logprobs {n} is more than the {vocab_size} tokens of the model's vocabulary{where}; "
                         f"use --logprobs {vocab_size} or less (e.g. --logprobs 5)")
