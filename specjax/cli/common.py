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


def enable_compilation_cache(path: str | None = None) -> None:
    """Persistent JAX compilation cache (``$SPECJAX_CACHE`` or ``~/.cache/specjax/jax``)."""
    import jax

    path = path or os.environ.get("SPECJAX_CACHE") or os.path.expanduser("~/.cache/specjax/jax")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (1 = off)")
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


TREE_FLAGS = ("tree_nodes", "tree_depth", "tree_topk")


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
        "temperature": pick("temperature", 0.0),
        "top_k": pick("top_k", 0),
        "top_p": pick("top_p", 1.0),
        "chat": pick("chat", None),  # None: the command's default (generate: the model's template if any)
        "parse_special": bool(pick("parse_special", True)),
        # given by the user (flag or config), not the default: only then is a cap worth a note
        "max_new_tokens_given": getattr(args, "max_new_tokens", None) is not None or "max_new_tokens" in cfg,
    }
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
    """A tree needs a drafter that proposes trees (top-k > 1: not a draft model) and, unless
    ``tree_with_gamma``, no ``--gamma``. Raises UsageError."""
    from specjax.api import draft_spec_proposes_trees

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
            if not draft_spec_proposes_trees(d):
                raise UsageError(f"--draft {d} is a draft model, which proposes chains only; a tree with "
                                 f"--tree-topk {tree.topk} needs --draft default, ngram or an EAGLE drafter "
                                 "directory (or use --tree-topk 1)")


def _finite(name: str, v) -> None:
    if v != v or v in (float("inf"), float("-inf")):
        raise UsageError(f"{name} must be a finite number, got {v}")


def _check_settings(args, s: dict) -> None:
    from specjax.api import check_draft_spec

    _finite("--temperature", s["temperature"])
    _finite("--top-p", s["top_p"])
    if s["max_new_tokens"] < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {s['max_new_tokens']}")
    if s["temperature"] < 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {s['temperature']}")
    if not 0 < s["top_p"] <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {s['top_p']}")
    if s["top_k"] < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = off), got {s['top_k']}")
    if getattr(args, "batch_size", 1) < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    from specjax.runtime.decoder import SEED_LIMIT

    seed = getattr(args, "seed", 0)
    if not 0 <= seed < SEED_LIMIT:
        raise UsageError(f"--seed must be an integer in [0, 2**64), got {seed}")
    drafts = s["draft"] if isinstance(s["draft"], (list, tuple)) else [s["draft"]]
    for d in drafts:
        check_draft_spec(d)
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


def parse_gamma(value, default=4) -> int | str:
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
    return g


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
    """``--dtype auto``'s one line: the chosen format, the step time of each, measured or cached."""
    src = info["source"]
    if src.get("predicted"):
        return (f"--dtype auto chose {fmt} ({src['predicted']}; `specjax bench --dtype auto` measures this "
                "host and later runs use the measurement)")
    ms = ", ".join(f"{f} {t:.1f} ms" for f, t in info["step_ms"].items())
    if src["cached"]:
        how = f"cached, measured {src['created']}"
    else:
        how = "measured now" + ("; cached for the next run" if src.get("path") else "")
    return (f"--dtype auto chose {fmt}: the fastest target step on this host ({ms} per "
            f"{info['tokens']}-token call; {how})")


def load_target_and_drafter(s: dict, draft_spec=None, mesh=None, target=None):
    """Load the target (unless ``target`` is given, already loaded in ``s["dtype"]``) and
    (optionally) one drafter from resolved settings (``dtype`` ``auto`` is resolved first:
    :func:`resolve_auto_dtype`)."""
    from specjax.api import load_drafter
    from specjax.io.loading import load_model

    if s.get("dtype") == "auto":
        target = resolve_auto_dtype(s, mesh=mesh)
    if target is None:
        target = load_model(s["model"], dtype=s["dtype"], mesh=mesh)
    spec = s["draft"] if draft_spec is None else draft_spec
    drafter = load_drafter(spec, target, dtype=s["draft_dtype"])
    if s.get("max_new_tokens_given", True):
        note_context_cap(s["max_new_tokens"], target, drafter)
    return target, drafter


def note_context_cap(max_new_tokens: int, target, drafter=None) -> None:
    """A ``specjax: note:`` when ``--max-new-tokens`` exceeds the context (it is capped there)."""
    lim = target.config.max_position_embeddings
    dcfg = getattr(drafter, "config", None)
    lim = min(lim, getattr(dcfg, "max_position_embeddings", lim) or lim)
    if max_new_tokens > lim:
        note(f"--max-new-tokens {max_new_tokens} is capped to {lim} − the prompt length: the context of "
             f"{target.name}{' and its drafter' if lim < target.config.max_position_embeddings else ''} "
             f"holds {lim} tokens")
