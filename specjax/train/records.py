"""Prompt records for distillation: reading the JSONL prompts and the train/eval split,
making a split, tokenizing a record, and the order in which questions are generated."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import numpy as np

from specjax.io.prompts import jsonl_objects
from specjax.train.common import DistillError


def read_records(path: str) -> list[dict]:
    """JSONL records: Spec-Bench (``question_id``, ``category``, ``turns``), ``prompt`` text,
    or ``ids`` (a token-id list, for models without a tokenizer).

    Returns one dict per non-blank line: ``question_id`` (given, else the record's index),
    ``category`` (str, default ``"all"``) and either ``ids`` (list of int ≥ 0) or ``turns``
    (list of non-empty str; a ``prompt`` becomes one turn). A UTF-8 byte-order mark is accepted.

    Raises:
      ValueError: naming ``path:line``: missing file, a directory, not UTF-8, not JSON, not an
        object, a bad ``ids``/``turns``/``prompt`` value, or no prompts at all.
    """
    out = []
    for lineno, o in jsonl_objects(path, "'ids', 'turns' or 'prompt'"):
        rec = {"question_id": o.get("question_id", len(out)), "category": str(o.get("category", "all"))}
        if "ids" in o:
            if not isinstance(o["ids"], list) or not o["ids"] or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in o["ids"]):
                raise ValueError(f"{path}:{lineno}: 'ids' must be a non-empty list of token ids (integers >= 0)")
            rec["ids"] = [int(i) for i in o["ids"]]
        elif "turns" in o:
            t = o["turns"]
            if not isinstance(t, list) or not t or not all(isinstance(x, str) and x.strip() for x in t):
                raise ValueError(f"{path}:{lineno}: 'turns' must be a non-empty list of non-empty strings")
            rec["turns"] = list(t)
        elif "prompt" in o:
            if not isinstance(o["prompt"], str) or not o["prompt"].strip():
                raise ValueError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
            rec["turns"] = [o["prompt"]]
        else:
            raise ValueError(f"{path}:{lineno}: need 'ids', 'turns' or 'prompt'")
        out.append(rec)
    return out


def read_split(path: str) -> dict:
    """``{"train": [ids], "eval": [ids]}`` from a split JSON file.

    Raises:
      DistillError: naming the file: unreadable, not JSON, or without the two lists.
    """
    if not os.path.isfile(path):
        raise DistillError(f"--split {path}: no such file; give a JSON file {{'train': [ids], 'eval': [ids]}}")
    try:
        with open(path, encoding="utf-8-sig") as f:
            split = json.load(f)
    except json.JSONDecodeError as e:
        raise DistillError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); --split needs "
                           "{'train': [ids], 'eval': [ids]}") from None
    except UnicodeDecodeError:
        raise DistillError(f"--split {path}: not valid UTF-8; save it as UTF-8") from None
    if not isinstance(split, dict) or not all(isinstance(split.get(k), list) for k in ("train", "eval")):
        raise DistillError(f"--split {path}: expected a JSON object with lists 'train' and 'eval' (question ids)")
    return split


def make_split(records: list[dict], per_category: int = 5, small_category: int = 1, seed: int = 0) -> dict:
    """Disjoint train/eval question ids: ``per_category`` eval questions per category with
    at least 4×that many questions, ``small_category`` per smaller category (never all of a
    category). Returns ``{"train": [ids], "eval": [ids]}``, both sorted; the same for the
    same ``records`` and ``seed``."""
    rng = np.random.default_rng(seed)
    by = defaultdict(list)
    for r in records:
        by[r["category"]].append(r["question_id"])
    ev = []
    for cat in sorted(by):
        ids = sorted(by[cat])
        k = per_category if len(ids) >= 4 * per_category else small_category
        ev += sorted(int(i) for i in rng.choice(ids, size=min(k, len(ids) - 1), replace=False))
    ev_set = set(ev)
    tr = sorted(int(r["question_id"]) for r in records if r["question_id"] not in ev_set)
    return {"train": tr, "eval": sorted(ev)}


def encode_record(target, rec: dict, chat: bool, history: list[dict] | None = None) -> list[int]:
    """The prompt token ids of a record: its ``ids`` as given, else its first turn
    (chat-templated when ``chat``; ``history``: the messages to template instead).

    Raises:
      ValueError: a text record for a target without a tokenizer.
    """
    tok = target.tokenizer
    if "ids" in rec:
        return list(rec["ids"])
    if tok is None:
        raise ValueError("the target has no tokenizer: give prompts as token ids ({'ids': [...]} per line)")
    if not chat:
        return tok.encode(rec["turns"][0])
    msgs = history or [{"role": "user", "content": rec["turns"][0]}]
    return tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)


def generation_order(records: list[dict], ev_ids: set, tr_ids: set, batch: int) -> list:
    """One batch of eval questions (round-robin over categories), then the training
    questions round-robin over categories, then the other eval questions: a run stopped
    early still has held-out data and every category."""
    ev = round_robin(records, ev_ids)
    return ev[:batch] + round_robin(records, tr_ids) + ev[batch:]


def round_robin(records: list[dict], ids: set) -> list:
    """``ids`` ordered round-robin over categories (generation order of the eval questions)."""
    by = defaultdict(list)
    for r in records:
        if r["question_id"] in ids:
            by[r["category"]].append(r["question_id"])
    out = []
    while any(by.values()):
        for c in sorted(by):
            if by[c]:
                out.append(by[c].pop(0))
    return out

