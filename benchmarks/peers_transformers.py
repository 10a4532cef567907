#!/usr/bin/env python
"""The same benchmark as ``specjax bench``, run with Hugging Face transformers (PyTorch, CPU,
float32) on the same model and the same prompts, so the two can be compared line by line.

Methods (names match ``specjax bench``):

* ``ar``: plain greedy / sampled ``generate``;
* ``<draft>@γ<g>``: assisted generation (``assistant_model=``) with a draft model: by default
  the target's first ``--draft-layers`` (2) blocks + final norm + head, built by truncating
  ``model.model.layers`` (named ``first2``, like a ``specjax.io.loading.save_model(truncate_model(
  target, 2))`` directory called ``first2``), or ``--draft-model DIR`` (a Hugging Face directory);
  ``num_assistant_tokens = γ`` with a constant schedule and no confidence early-stop;
* ``ngram:<N>@γ<g>``: prompt lookup (``prompt_lookup_num_tokens=γ``, ``max_matching_ngram_size=N``).

transformers runs assisted generation and prompt lookup only at batch size 1: with
``--batch-size`` > 1 only ``ar`` runs (the others are listed under ``config.skipped``).

Timing: ``wall_s`` is the ``generate`` call; ``prefill_s`` is one separate forward over the
(left-padded) batch measured right before it, and ``decode_s = wall_s − prefill_s`` (an
estimate: transformers does not expose the prefill time). ``target_calls``: forward calls of the
target inside ``generate`` (prefill included, as it also yields the first token);
accepted/checked draft tokens are read from the candidate generator
(``update_candidate_strategy(num_matches)``). Same JSON schema as ``specjax bench``.

    python benchmarks/peers_transformers.py --prompts question.jsonl --limit 5 --max-new-tokens 128 \\
        --ignore-eos --gamma 4 --out results/peers.json

transformers and torch are optional dependencies of specjax: ``pip install transformers torch``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
import types

from specjax.eval.bench import (MethodSpec, json_default, baselines, check_out_path, machine_info, make_batches,
                           select_prompts, split_categories, summarize, write_json)
from specjax.eval.report import markdown_tables


def _import_transformers():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise SystemExit(
            f"peers_transformers.py needs transformers and torch ({e.name} is missing): "
            "pip install 'transformers>=4.45' torch  (or pip install -e '.[test]')"
        ) from None
    return torch, transformers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True, metavar="FILE", help="JSONL prompts (as specjax bench)")
    p.add_argument("--categories", nargs="+", default=None, metavar="C", help="categories to keep")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="at most N prompts per category")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--methods", nargs="+", default=["ar", "assisted", "lookup"], choices=["ar", "assisted", "lookup"])
    p.add_argument("--gamma", nargs="+", type=int, default=[4], help="draft tokens per round γ (several allowed)")
    p.add_argument("--ngram", type=int, default=3, help="prompt lookup: max_matching_ngram_size (default 3)")
    p.add_argument("--draft-model", default=None, metavar="DIR", help="assistant: a HF model directory")
    p.add_argument("--draft-layers", type=int, default=2, help="assistant: the target's first K blocks (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="chat template (default on)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS (fixed-length runs)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default os.cpu_count())")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs of the first batch per method")
    p.add_argument("--out", default=None, metavar="FILE", help="write the full results as JSON (refuses to overwrite)")
    p.add_argument("--force", action="store_true", help="allow --out to overwrite")
    p.add_argument("--json", action="store_true", help="print the full results as JSON on stdout (no table)")
    p.add_argument("--no-progress", action="store_true")
    return p


def load_tokenizer(model_path: str):
    """specjax's tokenizer for the model (same ids as transformers; shared prompt encoding)."""
    from specjax.io.tokenizer import Tokenizer

    if model_path.endswith(".gguf"):
        from specjax.io import gguf as gguf_loader

        return Tokenizer.from_gguf(gguf_loader.open_gguf(model_path))
    return Tokenizer.from_dir(model_path)


def load_hf(model_path: str, torch, transformers):
    if model_path.endswith(".gguf"):
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(model_path)), gguf_file=os.path.basename(model_path), dtype=torch.float32)
    return transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def truncated_copy(model, k: int):
    """The target's first ``k`` blocks + final norm + head, as an independent transformers model."""
    n = model.config.num_hidden_layers
    if not 1 <= k <= n:
        raise SystemExit(f"--draft-layers must be in [1, {n}], got {k}")
    d = copy.deepcopy(model)
    d.model.layers = d.model.layers[:k]
    d.config.num_hidden_layers = k
    if getattr(d.config, "layer_types", None):
        d.config.layer_types = list(d.config.layer_types)[:k]
    return d


def weight_bytes(model) -> int:
    return int(sum(p.numel() * p.element_size() for p in model.parameters()))  # tied weights counted once


class Counter:
    """Counts forward calls of a module and, for assisted/lookup generation, drafted /
    accepted / checked tokens per round (patched candidate-generator methods)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.calls = 0
        self.rounds = []  # (drafted, accepted)
        self._cand = 0

    def hook(self, *_):
        self.calls += 1


@contextlib.contextmanager
def count_candidates(counter: Counter):
    from transformers.generation import candidate_generator as cg

    patched = []

    def wrap_get(cls):
        orig = getattr(cls, "get_candidates")

        def get_candidates(self, input_ids, *a, **kw):
            out = orig(self, input_ids, *a, **kw)
            counter._cand = int(out[0].shape[1] - input_ids.shape[1])
            return out

        patched.append((cls, "get_candidates", cls.__dict__.get("get_candidates")))
        setattr(cls, "get_candidates", get_candidates)

    def wrap_update(cls):
        orig = getattr(cls, "update_candidate_strategy")

        def update_candidate_strategy(self, input_ids, scores, num_matches):
            counter.rounds.append((counter._cand, int(num_matches)))
            return orig(self, input_ids, scores, num_matches)

        patched.append((cls, "update_candidate_strategy", cls.__dict__.get("update_candidate_strategy")))
        setattr(cls, "update_candidate_strategy", update_candidate_strategy)

    for cls in (cg.AssistedCandidateGenerator, cg.PromptLookupCandidateGenerator):
        wrap_get(cls)
    for cls in (cg.AssistedCandidateGenerator, cg.PromptLookupCandidateGenerator):
        wrap_update(cls)  # (an inherited method is wrapped on the subclass and removed afterwards)
    try:
        yield
    finally:
        for cls, name, orig in reversed(patched):
            if orig is None:
                delattr(cls, name)
            else:
                setattr(cls, name, orig)


def run_peers(prompts, args) -> dict:
    torch, transformers = _import_transformers()
    from tqdm.auto import tqdm

    from specjax.api import encode_prompts
    from specjax.io.loading import default_model_path

    torch.set_num_threads(args.threads or os.cpu_count())
    model_path = os.path.expanduser(args.model) if args.model else default_model_path()
    tok = load_tokenizer(model_path)
    ids = encode_prompts(types.SimpleNamespace(tokenizer=tok, name=os.path.basename(model_path)),
                         [p["prompt"] for p in prompts], args.chat)
    print("peers_transformers: loading the target with transformers (float32)", file=sys.stderr, flush=True)
    model = load_hf(model_path, torch, transformers).eval()
    eos = list(tok.eos_token_ids)
    pad = eos[0] if eos else 0
    if args.ignore_eos:
        model.generation_config.eos_token_id = None  # so generate() does not fill it back in
    tbytes = weight_bytes(model)

    skipped = {}
    methods: list[tuple[MethodSpec, dict, object]] = []  # spec, generate kwargs, draft model
    methods.append((MethodSpec("ar", None, None, "float32", tbytes), {}, None))
    batch1 = args.batch_size == 1
    draft = None
    if "assisted" in args.methods:
        if not batch1:
            skipped["assisted"] = "transformers runs assisted generation only at batch size 1"
        else:
            if args.draft_model:
                draft = load_hf(os.path.expanduser(args.draft_model), torch, transformers).eval()
                dname = os.path.basename(os.path.normpath(args.draft_model))
            else:
                draft = truncated_copy(model, args.draft_layers).eval()
                dname = f"first{args.draft_layers}"
            if args.ignore_eos:
                draft.generation_config.eos_token_id = None
            dbytes = weight_bytes(draft)
            for g in args.gamma:
                methods.append((MethodSpec(f"{dname}@γ{g}", dname, g, "float32", tbytes, dbytes,
                                           extra={"transformers_method": "assisted"}),
                                {"assistant_model": draft, "num_assistant_tokens": g}, draft))
    if "lookup" in args.methods:
        if not batch1:
            skipped["lookup"] = "transformers runs prompt lookup only at batch size 1"
        else:
            for g in args.gamma:
                methods.append((MethodSpec(f"ngram:{args.ngram}@γ{g}", f"ngram:{args.ngram}", g, "float32", tbytes, 0,
                                           extra={"transformers_method": "prompt_lookup"}),
                                {"prompt_lookup_num_tokens": g, "max_matching_ngram_size": args.ngram}, None))

    tcount, dcount = Counter(), Counter()
    model.register_forward_hook(tcount.hook)
    if draft is not None:
        draft.register_forward_hook(dcount.hook)
    batches = make_batches(prompts, args.batch_size)

    def tensors(idx):
        rows = [ids[i] for i in idx]
        L = max(len(r) for r in rows)
        inp = torch.full((len(rows), L), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), L), dtype=torch.long)
        for j, r in enumerate(rows):
            inp[j, L - len(r):] = torch.tensor(r)
            mask[j, L - len(r):] = 1
        return inp, mask

    def gen(kw, draft_model, idx):
        inp, mask = tensors(idx)
        gkw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0, pad_token_id=pad,
                   eos_token_id=None if args.ignore_eos else eos)
        if args.temperature > 0:
            gkw.update(temperature=args.temperature, top_k=0, top_p=1.0)
        if draft_model is not None:
            dg = draft_model.generation_config
            dg.num_assistant_tokens = kw["num_assistant_tokens"]
            dg.num_assistant_tokens_schedule = "constant"
            dg.assistant_confidence_threshold = 0.0
        call = {k: v for k, v in kw.items() if k != "num_assistant_tokens"}
        torch.manual_seed(args.seed + idx[0])
        tcount.reset()
        dcount.reset()
        with torch.inference_mode(), count_candidates(tcount):
            t0 = time.perf_counter()
            out = model.generate(input_ids=inp, attention_mask=mask, **call, **gkw)
            wall = time.perf_counter() - t0
        new = out[:, inp.shape[1]:].tolist()
        if not args.ignore_eos and eos:
            new = [r[: r.index(next(t for t in r if t in eos)) + 1] if any(t in eos for t in r) else r for r in new]
        return new, wall

    def prefill_s(idx):
        inp, mask = tensors(idx)
        with torch.inference_mode():
            t0 = time.perf_counter()
            model(input_ids=inp, attention_mask=mask, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t0

    records = {s.name: [] for s, _, _ in methods}
    prompt_records = []
    bar = tqdm(total=len(batches) * len(methods), desc="transformers", unit="batch", file=sys.stderr,
               disable=args.no_progress, dynamic_ncols=True)
    try:
        for s, kw, dm in methods:
            for _ in range(max(0, args.warmup)):
                bar.set_postfix_str(f"warm-up {s.name}")
                _, wall = gen(kw, dm, batches[0])
                s.warmup_s += wall
        for bi, idx in enumerate(batches):
            cat = prompts[idx[0]]["category"]
            pre = prefill_s(idx)
            ar_tokens = None
            for s, kw, dm in methods:
                bar.set_postfix_str(s.name)
                new, wall = gen(kw, dm, idx)
                drafted = sum(d for d, _ in tcount.rounds)
                accepted = sum(a for _, a in tcount.rounds)
                checked = sum(a + (1 if a < d else 0) for d, a in tcount.rounds)
                rows = []
                for j, toks in enumerate(new):
                    calls = len(toks) if s.drafter is None else tcount.calls  # ar: one token per call per row
                    st = {"new_tokens": len(toks), "target_calls": calls,
                          "draft_calls": len(tcount.rounds) if s.drafter else 0,
                          "drafted_tokens": drafted if s.drafter else 0,
                          "accepted_tokens": accepted if s.drafter else 0,
                          "checked_tokens": checked if s.drafter else 0,
                          "mean_accepted_tokens": len(toks) / calls if calls else 0.0,
                          "acceptance_rate": accepted / checked if (s.drafter and checked) else 0.0,
                          "finish_reason": "eos" if toks and toks[-1] in eos and not args.ignore_eos else "length"}
                    rows.append({"question_id": prompts[idx[j]]["question_id"], "category": cat,
                                 "new_tokens": len(toks), "stats": st})
                    same = None
                    if args.temperature == 0 and s.drafter is not None and ar_tokens is not None:
                        same = toks == ar_tokens[j]
                    dec = max(0.0, wall - pre)
                    prompt_records.append({
                        "method": s.name, "question_id": prompts[idx[j]]["question_id"], "category": cat, "batch": bi,
                        "batch_size": len(idx), "prompt_tokens": len(ids[idx[j]]), "new_tokens": len(toks),
                        "decode_s": dec, "prefill_s": pre, "tokens_per_s": len(toks) / dec if dec > 0 else None,
                        "same_as_ar": same, "stats": st})
                if s.drafter is None:
                    ar_tokens = new
                records[s.name].append({
                    "method": s.name, "category": cat, "batch": bi, "batch_size": len(idx),
                    "decode_s": max(0.0, wall - pre), "prefill_s": pre, "wall_s": wall,
                    "calls": tcount.calls, "draft_steps": dcount.calls, "rows": rows})
                bar.update(1)
    finally:
        bar.close()
    specs = [s for s, _, _ in methods]
    base = baselines(specs, False)
    cats = {}
    for p in prompts:
        cats[p["category"]] = cats.get(p["category"], 0) + 1
    info = machine_info()
    info.update(torch=torch.__version__, transformers=transformers.__version__, torch_threads=torch.get_num_threads())
    config = {
        "library": "transformers",
        "model": args.model or "default", "model_name": os.path.basename(model_path),
        "methods": args.methods, "gammas": args.gamma, "ngram": args.ngram,
        "draft_model": args.draft_model, "draft_layers": None if args.draft_model else args.draft_layers,
        "dtypes": ["float32"], "dtype": "float32", "temperature": args.temperature, "seed": args.seed,
        "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "chat": args.chat,
        "ignore_eos": args.ignore_eos, "warmup": args.warmup, "num_prompts": len(prompts),
        "prompts_per_category": cats, "prompts_file": os.path.abspath(args.prompts),
        "categories": split_categories(args.categories), "limit": args.limit, "skipped": skipped,
        "weight_bytes": {"float32": {"target": tbytes, **({s.drafter: s.drafter_bytes for s in specs if s.drafter})}},
        "baselines": base,
        "greedy_mismatches_vs_ar": (sum(1 for r in prompt_records if r["same_as_ar"] is False)
                                    if args.temperature == 0 else None),
        "bandwidth_formula": "as specjax bench: (batch target forward calls × target weight bytes + assistant "
                             "forward calls × assistant weight bytes) / decode_s / 1e9",
        "timing": "wall_s = generate(); prefill_s = one separate forward over the padded batch; "
                  "decode_s = wall_s - prefill_s (estimate); warm-up excluded (warmup_s)",
        "machine": info,
    }
    return {"config": config, "methods": summarize(specs, records, base), "prompts": prompt_records}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from specjax.io.prompts import read_prompts
    from specjax.cli import UsageError

    try:
        check_out_path(args.out, args.force)
        if args.max_new_tokens < 1 or args.batch_size < 1 or any(g < 1 for g in args.gamma) or args.ngram < 1:
            raise UsageError("--max-new-tokens, --batch-size, --gamma and --ngram must be >= 1")
        prompts = select_prompts(read_prompts(args.prompts), args.categories, args.limit)
    except ValueError as e:
        print(f"peers_transformers: error: {e}", file=sys.stderr)
        return 2
    results = run_peers(prompts, args)
    if args.out:
        write_json(args.out, results, args.force)
        print(f"peers_transformers: wrote {args.out}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, default=json_default))
    else:
        print(markdown_tables(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
