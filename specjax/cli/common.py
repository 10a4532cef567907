"""Shared pieces of the command line: argument groups, settings from flags and pair configs
(validated before anything expensive: :mod:`specjax.cli.flags`), prompts, the compilation cache,
loading the target and drafter (``--dtype auto``, context notes), and the one-line error form
(:mod:`specjax.cli.errors`). The commands import these helpers from here.

Every user error becomes one line ``specjax: error: …`` (:func:`describe_error`) with exit
status 2; ``SPECJAX_DEBUG=1`` re-raises with the traceback.
"""

from __future__ import annotations

import json
import os

from specjax.cli.errors import UsageError, Parser, user_errors, describe_error, note  # noqa: F401  (re-exported)
from specjax.core import env
from specjax.cli.flags import (  # noqa: F401  (re-exported)
    DTYPES, SHIPPED_PAIR, TREE_FLAGS, cap_gamma, check_settings, check_tree, tree_setting, add_knob_args,
    add_draft_flags, add_dtype_flag, add_mesh_flag, add_model_args, add_model_flag, chat_default, parse_gamma, resolve,
    sampling_class, sampling_of, shipped_pair_method,
)


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

    given = path or env.get("SPECJAX_CACHE")
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
    # every program, also the dozens of small eager ones of a load (≈ 20 ms each to compile,
    # ≈ 0.8 s a run together): read back rather than compiled again
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return True


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
    if src.get("predicted"):  # (a rule for this host kind; `specjax bench --dtype auto` measures instead)
        return f"--dtype auto chose {fmt}: {src['predicted']}{dropped}"
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
    from specjax.io.loading import limit_context, load_model

    check_max_model_len(s)  # before any weights are read
    if s.get("dtype") == "auto":
        target = resolve_auto_dtype(s, mesh=mesh)
    else:
        note_unfaithful_format(s)
    if target is None:
        target = load_model(s["model"], dtype=s["dtype"], mesh=mesh)
    target = _limit(limit_context, target, s.get("max_model_len"))
    spec = s["draft"] if draft_spec is None else draft_spec
    drafter = load_drafter(spec, target, dtype=s["draft_dtype"])
    if cap_note and s.get("max_new_tokens_given", True):
        note_context_cap(s["max_new_tokens"], target, drafter)
    return target, drafter


def peek_context(model) -> int | None:
    """The target's ``max_position_embeddings`` without loading it (a model directory's
    ``config.json``, a ``.gguf`` file's ``<arch>.context_length``; milliseconds), or ``None``
    when that is not cheap (a hub id) or the file does not say."""
    from specjax.io.files import gguf_context_length

    return _peek_config(model, gguf_context_length, "max_position_embeddings", 2048)  # from_hf_config's default


def check_max_model_len(s: dict) -> None:
    """``--max-model-len`` against the target's context, read cheaply before loading
    (:func:`peek_context`; a hub id: checked after the load instead).

    Raises:
      UsageError: more than the model's context, naming it and the fix."""
    n = s.get("max_model_len")
    if n is None:
        return
    ctx = peek_context(s.get("model"))
    if ctx is not None and n > ctx:
        raise UsageError(f"--max-model-len {n} is more than the {ctx} tokens of the model's context; "
                         f"use --max-model-len {ctx} or less")


def _limit(limit_context, target, n):
    try:
        return limit_context(target, n)
    except ValueError as e:
        raise UsageError("--" + str(e).replace("max_model_len", "max-model-len", 1)) from None


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

    return _peek_config(model, gguf_vocab_size, "vocab_size")


def _peek_config(model, from_gguf, key: str, default=None) -> int | None:
    """A positive integer of the target's config read cheaply: ``from_gguf(path)`` for a ``.gguf``
    file, ``config.json[key]`` (``default`` when absent) for a model directory; ``None`` otherwise."""
    from specjax.io.loading import DEFAULT_MODEL, default_model_path

    path = default_model_path() if model in (None, DEFAULT_MODEL) else os.path.expanduser(str(model))
    if path.endswith(".gguf") and os.path.isfile(path):
        return from_gguf(path)
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        try:
            with open(cfg, encoding="utf-8") as f:
                v = json.load(f).get(key, default)
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
