"""``specjax distill``: train a feature-level drafter (:mod:`specjax.drafters.eagle`) to
match a target (DistillSpec, Zhou et al. 2023; EAGLE, Li et al. 2024).

Pipeline (everything under ``--out DIR``):

1. **data** (``DIR/data``, written to a temporary directory and renamed): the target's
   own greedy continuations of the training prompts (both turns of multi-turn
   questions, the second turn answered after the target's own first answer), then one
   teacher forward per sequence storing the target's final hidden states ``h`` [N, D],
   its top-k next-token probabilities and its argmax. With a tied head the hidden
   states determine the logits exactly; top-k is kept for the loss.
   ``--data drafter`` / ``both`` add on-policy sequences: continuations written by the
   trained-so-far drafter — each token its greedy first draft, made from the target's true
   feature of the previous position (re-anchored at every token; ``--gamma`` plays no part)
   — and scored by the target (:func:`specjax.train.data._onpolicy_fn`); generated once,
   after ``--onpolicy-after`` steps.
2. **sub-vocabulary**: the ``--sub-vocab`` most frequent target tokens in the training
   sequences (ties and the remainder filled by lowest id, i.e. earliest BPE merges).
3. **training** (optax AdamW, linear warmup + cosine decay, global-norm clipping) on
   windows of ``--window`` positions: loss = smooth-L1(f_t, h_t) + ``--ce-weight`` ×
   cross-entropy(p_t top-k restricted to the sub-vocabulary, q_t), plus the same terms
   for a second, unrolled pass that feeds the drafter's own predicted features (what
   drafts 2..γ see). Greedy α (first draft, teacher-forced with true features) on the
   held-out prompts every ``--eval-every`` steps.
4. **checkpoints**: orbax ``CheckpointManager`` in ``DIR/ckpt`` (params, optimizer state,
   step; written to a temporary directory and renamed by orbax, so a half-written step
   is never listed); ``--resume`` restores the latest one and continues with the same
   data order and keys (the batch and key of step s depend only on (seed, s)).
5. **export**: ``DIR/drafter`` (safetensors + ``drafter.json`` with the target fingerprint),
   loadable with :func:`specjax.drafters.eagle.load_drafter`.

Copy term (``--copy-ngram N``, :mod:`specjax.drafters.eagle`): the head also scores the
prompt-lookup candidate with learned per-match-length biases and a context weight. A
drafter fits its own training text far better than new text, so on that text copying
looks useless; ``--init-from D --train-only copy --self-prompts K`` therefore fits only
the copy term, on K prompts the target writes itself (:func:`self_prompts`, Magpie) and
their greedy answers — text the drafter never saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np

from specjax.train.batches import build_batch, make_windows, sub_positions, window_order
from specjax.train.benchmark import bench  # specjax.train.distill.bench: the --bench entry point
from specjax.train.common import DistillError, log
from specjax.train.data import choose_sub_vocab, collect_data, collect_parts, generate_data, join_rows, self_prompts
from specjax.train.text_data import teacher_forced_data, text_windows
from specjax.train.export import export_drafter
from specjax.train.loop import (TrainState, evaluate, format_alphas, make_eval_fn, make_optimizer, make_train_step,
                                open_checkpoints, record_eval, restore_latest, train)
from specjax.train.options import ADDED_KEYS, RUN_KEYS, check_args, check_out_dir, not_started
from specjax.train.records import generation_order, make_split, read_records, read_split, round_robin

__all__ = ["DistillError", "DistillRun", "bench", "load_run", "make_data", "open_run", "run", "split_indices"]  # the steps other trainers share


@dataclasses.dataclass
class DistillRun:
    """What the steps of one run share: its settings ``s`` (``run.json``), directory, target,
    prompt records, split and whether prompts are chat-templated."""

    s: argparse.Namespace
    out: str
    target: object
    records: list
    tr_ids: set
    ev_ids: set
    chat: bool

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target blocks a fused-feature drafter reads (``--feature-layers``), or ``()``."""
        from specjax.drafters import eagle

        return eagle.resolve_feature_layers(self.s.feature_layers, self.target.config)

    def generate(self, recs: list[dict], parts_dir: str, **kw) -> None:
        """:func:`specjax.train.data.generate_data` with the run's generation settings."""
        s = self.s
        generate_data(self.target, recs, max_new_tokens=s.max_new_tokens, batch=s.gen_batch, chat=self.chat,
                      max_prompt_tokens=s.max_prompt_tokens, topk=s.topk, parts_dir=parts_dir, log=log,
                      feature_layers=self.feature_layers, **kw)


def run(args) -> dict:
    """Distill a drafter for ``args.model`` into ``args.out`` (data, training, checkpoints,
    export; see the module docstring), or continue the run there with ``args.resume``.

    ``args``: the ``specjax distill`` options (:func:`specjax.cli.distill.add_args`); a
    resumed run keeps the settings in its ``run.json``. Returns ``{"out": directory,
    "final": the last α evaluation ({} without one), "train_s": training seconds this session,
    "step": steps done}``.

    Raises:
      DistillError: a bad option, ``--out`` a file, not empty without ``--resume``, missing or
        empty with ``--resume`` (no run to resume), not a distill run, or not writable; a split that is not disjoint; ``--export-only``
        without a checkpoint.
      ValueError: unreadable prompts (naming the file and line).
    """
    import math

    tb = getattr(args, "time_budget", 0.0) or 0.0
    if not (math.isfinite(tb) and tb >= 0):
        raise DistillError(f"--time-budget must be a number of seconds >= 0 (0 = no limit), got {tb}")
    r = load_run(open_run(args), args)
    seqs, data = make_data(r)
    train_idx, eval_idx = split_indices(seqs, r.ev_ids)
    init, sub_ids = _sub_vocabulary(r.s, r.target, seqs, train_idx)
    sub_pos = sub_positions(sub_ids, r.target.config.vocab_size)
    cov = np.mean([sub_pos[t] >= 0 for i in eval_idx for t in seqs[i]["ids"][seqs[i]["prompt_len"]:]] or [1.0])
    log(f"{len(train_idx)} train / {len(eval_idx)} eval sequences; {sum(len(seqs[i]['ids']) for i in train_idx)} "
        f"train tokens; sub-vocab {len(sub_ids)} covers {cov:.3f} of eval response tokens")
    cfg, state, train_s, fit_idx = _train(r, args, seqs, data, (train_idx, eval_idx), sub_ids, sub_pos, init)
    s, final = r.s, state.history[-1] if state.history else {}
    dd = export_drafter(r.out, cfg, state.params, sub_ids, r.target, extra={
        "steps": state.step, "steps_planned": s.steps, "seed": s.seed, "train_sequences": len(train_idx),
        "train_tokens": int(sum(len(seqs[i]["ids"]) for i in train_idx)), "eval": final,
        "init_from": s.init_from, "train_only": s.train_only, "fit_sequences": len(fit_idx)})
    stopped = state.step < s.steps
    log(f"{'stopped (time budget)' if stopped else 'done'}: {state.step} of {s.steps} steps ({train_s:.0f}s this "
        f"session), α by draft position {format_alphas(final)}; drafter in {dd}"
        + (f"; continue with: specjax distill --out {r.out} --resume [--time-budget SECONDS]" if stopped else ""))
    return {"out": r.out, "final": final, "train_s": train_s, "step": state.step}


def open_run(args, keys=RUN_KEYS) -> tuple[str, argparse.Namespace]:
    """The run directory and its settings (``keys`` of ``args``; a block run adds
    :data:`~specjax.train.options.BLOCK_KEYS`, ``arch`` among them): a new run writes ``run.json``
    (after the options are checked); a resumed one reads it, refusing a run of another ``--arch``
    (a run without ``arch`` is an eagle one). Returns ``(out, settings)``."""
    out = os.path.abspath(args.out)
    run_file = os.path.join(out, "run.json")
    settings = {k: getattr(args, k) for k in keys}
    if settings.get("data_ids"):  # recorded absolute: a --resume from another directory finds the same files
        settings["data_ids"] = [os.path.abspath(x) for x in settings["data_ids"]]
    if os.path.exists(out) and not os.path.isdir(out):
        raise DistillError(f"--out {out} is a file; give a directory for the run")
    resuming = os.path.exists(out) and bool(os.listdir(out)) and not not_started(out)
    if args.resume and not resuming and not not_started(out):  # nothing there: refuse before any check or write
        where = "it does not exist" if not os.path.exists(out) else "it is empty"
        raise DistillError(f"--resume: no run to resume in {out} ({where}); drop --resume to start a new run there, "
                           "or give the --out of the run to continue")
    if resuming:
        if not args.resume:
            raise DistillError(f"{out} exists and is not empty; pass --resume to continue that run, "
                               "or choose a new --out (nothing there is overwritten)")
        if not os.path.exists(run_file):
            raise DistillError(f"{out} is not a specjax distill run (no run.json); refusing to touch it")
        with open(run_file) as f:
            saved = json.load(f)
        arch = saved.get("arch", "eagle")
        if arch != getattr(args, "arch", "eagle"):
            raise DistillError(f"--resume: the run in {out} trains a drafter of kind {arch!r}; resume it with "
                               f"--arch {arch}")
        # a setting the run predates takes its value of then (off), not this command line's
        settings = {k: saved.get(k, ADDED_KEYS.get(k, v)) for k, v in settings.items()}
    s = argparse.Namespace(**settings)
    check_args(s, export_only=getattr(args, "export_only", False))  # before anything is written or loaded
    if resuming:
        log(f"resuming the run in {out}")
        return out, s
    if not_started(out):
        log(f"{out} holds only the run.json of a run that never started; starting it anew")
    (_MADE_HERE.discard if os.path.exists(out) else _MADE_HERE.add)(out)
    check_out_dir(out)
    os.makedirs(out, exist_ok=True)
    with open(run_file + ".tmp", "w") as f:
        json.dump(settings, f, indent=2)
    os.replace(run_file + ".tmp", run_file)
    return out, s


_MADE_HERE: set[str] = set()  # run directories this process created (open_run), removed again if it never starts


def _forget_unstarted(out: str) -> None:
    """After an error in the checks that need the target: a run that holds only its ``run.json`` is
    removed again (the file, and the directory when this process created it and it is empty), so the
    same command, corrected, starts afresh without ``--resume``."""
    if not_started(out):
        os.remove(os.path.join(out, "run.json"))
        if out in _MADE_HERE and not os.listdir(out):
            os.rmdir(out)


def load_run(opened: tuple[str, argparse.Namespace], args) -> DistillRun:
    """Load the target, the prompts and the split (``--split`` or :func:`make_split`), and check what
    needs the target (``--feature-layers`` against its blocks); on such an error a new run's
    ``run.json`` is removed again.

    Raises:
      DistillError: a split that is not disjoint, feature layers that are not blocks of the target."""
    from specjax.drafters import eagle
    from specjax.io.loading import load_model

    out, s = opened
    target = load_model(s.model, dtype="float32")
    try:
        eagle.resolve_feature_layers(s.feature_layers, target.config)
        records = read_records(s.prompts)
        split = read_split(s.split) if s.split else make_split(records, seed=0)
        tr_ids, ev_ids = set(split["train"]), set(split["eval"])
        if tr_ids & ev_ids:
            raise DistillError(f"the split is not disjoint: {sorted(tr_ids & ev_ids)[:5]} in both")
    except (DistillError, ValueError):
        _forget_unstarted(out)
        raise
    chat = bool(s.chat) and target.tokenizer is not None and target.tokenizer.chat_template is not None
    return DistillRun(s, out, target, records, tr_ids, ev_ids, chat)


def make_data(r: DistillRun) -> tuple[list[dict], dict]:
    """Generate (or reuse: ``--data-dir``, or ``--data-ids`` teacher-forced) the target data set,
    and the self-prompt and installed-text data sets; returns them merged
    (:func:`specjax.train.data.collect_data`)."""
    s, out = r.s, r.out
    given = [s.data_dir] if isinstance(s.data_dir, str) else list(s.data_dir or [])
    data_dirs = [os.path.abspath(x) for x in given] + replay_token_ids(r)
    if not data_dirs:
        data_dirs = [os.path.join(out, "data")]
        recs = [q for q in r.records if q["question_id"] in r.tr_ids or q["question_id"] in r.ev_ids]
        if s.data not in ("target", "both"):
            log("--data drafter: the first data set still comes from the target (the drafter starts untrained)")
        r.generate(recs, data_dirs[0], first_ids=generation_order(r.records, r.ev_ids, r.tr_ids, s.gen_batch),
                   samples=s.samples_per_prompt, temperature=s.data_temperature, seed=s.seed,
                   greedy_only=r.ev_ids)
    if s.self_prompts:
        recs = self_prompts(r.target, s.self_prompts, s.seed, os.path.join(out, "self_prompts.jsonl"),
                            batch=s.gen_batch, log=log)
        r.generate(recs, os.path.join(out, "data_self"))
        data_dirs = data_dirs + [os.path.join(out, "data_self")]
    if s.text_corpus:
        held_out = [t for q in r.records if q["question_id"] in r.ev_ids for t in q.get("turns", [])]
        windows = text_windows(r.target, list(s.text_corpus), s.text_tokens, s.text_window, exclude=held_out,
                               seed=s.seed, log=log)
        teacher_forced_data(r.target, windows, window=s.text_window, batch=max(1, s.gen_batch // 4), topk=s.topk,
                            parts_dir=os.path.join(out, "data_text"), feature_layers=r.feature_layers, log=log)
        data_dirs = data_dirs + [os.path.join(out, "data_text")]
    return collect_data(data_dirs)


def replay_token_ids(r: DistillRun) -> list[str]:
    """The data directories made from the run's ``--data-ids`` files: each file's sequences
    teacher-forced into ``OUT/data_ids/<i>-<name>`` (:func:`specjax.train.token_ids.replay_data`;
    resumable part by part). Returns the directories, in the order given."""
    from specjax.train.token_ids import check_replay_source, file_source, read_token_ids, replay_data

    s, dirs = r.s, []
    for i, path in enumerate(getattr(s, "data_ids", None) or []):
        seqs, meta = read_token_ids(path, r.target)
        d = os.path.join(r.out, "data_ids", f"{i}-{os.path.splitext(os.path.basename(path))[0]}")
        check_replay_source(d, file_source(path), path)  # finished parts are reused only for the same content
        log(f"--data-ids {path}: {meta['sequences']} sequences, {meta['tokens']} tokens; teacher forcing into {d}")
        replay_data(r.target, seqs, batch=s.gen_batch, topk=s.topk, parts_dir=d, feature_layers=r.feature_layers,
                    log=log)
        dirs.append(d)
    return dirs


def split_indices(seqs: list[dict], ev_ids: set) -> tuple[list[int], list[int]]:
    """Mark each sequence's ``split`` and return ``(train indices, eval indices)``; the eval
    sequences are the greedy first-turn continuations of the eval questions."""
    for q in seqs:
        q["split"] = "eval" if q["question_id"] in ev_ids else "train"
    train_idx = [i for i, q in enumerate(seqs) if q["split"] == "train"]
    eval_idx = [i for i, q in enumerate(seqs) if q["split"] == "eval" and q["turn"] == 0 and not q.get("sample")]
    return train_idx, eval_idx


def _sub_vocabulary(s, target, seqs, train_idx):
    """``(init drafter or None, sub-vocabulary ids)``: a warm start (``--init-from``) keeps its
    weights, sub-vocabulary and MLP width (``s.intermediate`` is set to it); otherwise the
    most frequent training tokens (:func:`specjax.train.data.choose_sub_vocab`)."""
    from specjax.drafters import eagle

    if not s.init_from:
        return None, choose_sub_vocab([seqs[i] for i in train_idx], target.config.vocab_size, s.sub_vocab)
    init = eagle.load_drafter(s.init_from, target)
    sub_ids = np.asarray(init.params["frozen"]["sub_ids"])
    s.intermediate = init.config.layer.intermediate_size
    log(f"starting from the drafter in {s.init_from} (its sub-vocabulary of {len(sub_ids)} and MLP width "
        f"{s.intermediate})")
    return init, sub_ids


def _fit_indices(s, seqs, train_idx) -> list[int]:
    """The training sequences fitted: all of them, or with ``--train-only copy
    --self-prompts`` only the self-prompt ones (text the drafter has not memorized)."""
    if not (s.train_only == "copy" and s.self_prompts):
        return train_idx
    fit_idx = [i for i in train_idx if seqs[i]["category"] == "self"]
    log(f"--train-only copy: fitting on the {len(fit_idx)} self-prompt sequences")
    return fit_idx


def _init_drafter(s, target, sub_ids, init):
    """``(EagleConfig, frozen params, trainable params)``: fresh, or those of ``init`` (its
    copy term too if it has the same one; otherwise a fresh, zero copy term, or none)."""
    from specjax.drafters import eagle

    cfg = eagle.EagleConfig.for_target(target.config, len(sub_ids), s.intermediate, copy_ngram=s.copy_ngram,
                                       feature_layers=eagle.resolve_feature_layers(s.feature_layers, target.config))
    frozen = eagle.frozen_params(target, sub_ids)
    if init is not None and tuple(init.config.feature_layers) != tuple(cfg.feature_layers):
        raise DistillError(f"--init-from {s.init_from}: that drafter reads target blocks "
                           f"{tuple(init.config.feature_layers) or 'none (last hidden state)'}, --feature-layers "
                           f"{s.feature_layers} gives {tuple(cfg.feature_layers) or 'none'}")
    if init is None:
        return cfg, frozen, eagle.init_params(cfg, s.seed, target.params["final_norm"][...])
    same = init.config.copy_ngram == s.copy_ngram
    tp = {k: v for k, v in init.params["train"].items() if same or k not in eagle.COPY_KEYS}
    tp.update({k: v for k, v in eagle.init_copy_params(cfg).items() if k not in tp})
    return cfg, frozen, tp


def _train(r: DistillRun, args, seqs, data, split_idx, sub_ids, sub_pos, init):
    """Set up the optimizer and checkpoints (restoring the latest), then train (or, with
    ``--export-only``, only restore). ``split_idx``: ``(train indices, eval indices)``.
    Returns ``(cfg, TrainState, training seconds, indices of the fitted sequences)``."""
    s, out = r.s, r.out
    train_idx, eval_idx = split_idx
    cfg, frozen, tp = _init_drafter(s, r.target, sub_ids, init)
    opt = make_optimizer(s.steps, s.lr, s.warmup, s.weight_decay, freeze_base=s.train_only == "copy")
    state = TrainState(tp, opt.init(tp))
    step_fn = make_train_step(cfg, opt, s.ce_weight, s.unroll_weight, s.ce == "full", ttt_steps=s.ttt_steps or 3)
    width = data["hidden"].shape[1]
    if width != cfg.feature_size:
        raise DistillError(f"the data set holds target features of width {width}, but this drafter reads "
                           f"{cfg.feature_size} (--feature-layers {s.feature_layers}): use data made with the same "
                           "--feature-layers")
    ev_fn = make_eval_fn(cfg)
    ckdir = os.path.join(out, "ckpt")
    mngr = open_checkpoints(ckdir)
    latest = restore_latest(mngr, ckdir, state, os.path.join(out, "history.json"))
    fit_idx = _fit_indices(s, seqs, train_idx)
    windows = [(fit_idx[i], st) for i, st in make_windows([seqs[i] for i in fit_idx], s.window)]
    ds = {"seqs": seqs, "data": data, "windows": windows}
    onpolicy = s.data in ("drafter", "both") and 0 < s.onpolicy_after < s.steps
    add_onpolicy = lambda params: _add_onpolicy(r, cfg, {"train": params, "frozen": frozen}, ds)

    def batch_for(step):  # depends only on (seed, step): exact resume
        idx = window_order(s.seed, step, s.batch_size, len(ds["windows"]))
        return build_batch(ds["seqs"], ds["data"], [ds["windows"][i] for i in idx], sub_pos, s.window,
                           cfg.feature_size, copy_ngram=s.copy_ngram)

    def eval_at(step):
        return record_eval(out, state, step, evaluate(ev_fn, state.params, frozen, seqs, data, eval_idx, sub_pos,
                                                      s.window, cfg.feature_size, s.batch_size, s.copy_ngram))

    if getattr(args, "export_only", False):  # write DIR/drafter from the latest checkpoint, no training
        if latest is None:
            raise DistillError(f"{out}: no complete checkpoint to export")
        s.steps = state.step
    elif onpolicy and state.step >= s.onpolicy_after:
        add_onpolicy(state.params)
    if state.step == 0 and s.eval_every and s.steps > 0:
        r0 = eval_at(0)
        log(f"step 0: α by draft position {format_alphas(r0)}")
    train_s = train(state, mngr, steps=s.steps, step_fn=step_fn, frozen=frozen, batch_for=batch_for,
                    eval_at=eval_at, eval_every=s.eval_every, checkpoint_every=s.checkpoint_every,
                    onpolicy_after=s.onpolicy_after if onpolicy else None, add_onpolicy=add_onpolicy,
                    time_budget=getattr(args, "time_budget", 0.0) or 0.0, tokens_per_step=s.batch_size * s.window)
    return cfg, state, train_s, fit_idx


def _add_onpolicy(r: DistillRun, cfg, params: dict, ds: dict) -> None:
    """Drafter-generated, target-scored sequences from the train prompts (``params``: the
    drafter's of step ``onpolicy_after``; parts on disk, so a resume regenerates nothing it
    has) added to the training windows ``ds`` (in place): with ``--data drafter`` they
    replace the target windows, with ``both`` they are added to them."""
    s = r.s
    od = os.path.join(r.out, "data_onpolicy")
    recs = [q for q in r.records if q["question_id"] in r.tr_ids]
    r.generate(recs, od, first_ids=round_robin(r.records, r.tr_ids), drafter=(cfg, params))
    oseqs, odata = collect_parts(od)
    seqs, data, windows = ds["seqs"], ds["data"], ds["windows"]
    n0 = len(data["argmax"])
    base = [] if s.data == "drafter" else windows
    allseqs = seqs + [dict(q, offset=q["offset"] + n0, split="train") for q in oseqs]
    alldata = {k: (join_rows([data[k], odata[k]]) if k == "hidden" else np.concatenate([data[k], odata[k]]))
               for k in data}
    ow = make_windows(oseqs, s.window)
    ds.update(seqs=allseqs, data=alldata, windows=base + [(len(seqs) + i, st) for i, st in ow])
    log(f"on-policy data: {len(oseqs)} drafter sequences; {len(ds['windows'])} training windows now")
