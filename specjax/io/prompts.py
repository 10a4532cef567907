"""Prompt files: JSONL read line by line with errors that name ``file:line`` and the fix.

One reader (:func:`jsonl_objects`: missing file, directory, UTF-8 with an optional byte-order
mark, one JSON object per line) under the two record forms: :func:`read_prompts` (text
prompts for generation and benchmarks) and :func:`specjax.train.records.read_records`
(distillation records, which may also carry token ids).
"""

from __future__ import annotations

import json
import os
from typing import Iterator


def jsonl_objects(path: str, what: str = "'prompt' or 'turns'") -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of a JSONL file.

    Raises:
      ValueError: naming the file (and line): ``-`` (standard input is not read as a file), not
        found, a directory, not UTF-8 (a UTF-8 byte-order mark on the first line is accepted), not
        JSON, not a JSON object, or no object at all (empty, or only blank lines).
    """
    if path == "-":
        raise ValueError("--prompts - : a prompts file is read by name, not from standard input; give a JSONL file, "
                         "pipe one with --prompts /dev/stdin, or pipe one prompt text to `specjax generate -`")
    if not os.path.exists(path):
        raise ValueError(f"prompts file not found: {path}")
    if os.path.isdir(path):
        raise ValueError(f"--prompts {path} is a directory; give a JSONL file")
    lineno, found = 0, False
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start + 1} of the line); "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with {what}")
            found = True
            yield lineno, obj
    if not found:
        why = "it has only blank lines" if lineno else "it is empty"
        raise ValueError(f"{path}: no prompts in the file ({why}); write one JSON object with {what} per line")


def read_prompts(path: str) -> list[dict]:
    """Read a JSONL prompts file: each line an object with ``prompt`` (a string) or Spec-Bench
    ``turns`` (a list of strings; the first turn is used). Optional: ``question_id``, ``category``.

    Returns a list of dicts ``{"prompt", "question_id", "category"}``.

    Raises:
      ValueError: naming the file and line of an empty file (or one of blank lines), invalid JSON, a
        missing or wrongly typed ``prompt``/``turns`` field, or an empty prompt.
    """
    out = []
    for lineno, obj in jsonl_objects(path):
        if "prompt" in obj:
            text = obj["prompt"]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: 'prompt' must be a string")
        elif "turns" in obj:
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise ValueError(f"{path}:{lineno}: 'turns' must be a non-empty list of strings")
            text = turns[0]
        else:
            raise ValueError(f"{path}:{lineno}: missing field 'prompt' (a string) or 'turns' (Spec-Bench)")
        if not text.strip():
            raise ValueError(f"{path}:{lineno}: the prompt is empty")
        qid = obj.get("question_id", len(out))
        if isinstance(qid, (list, dict)):
            raise ValueError(f"{path}:{lineno}: 'question_id' must be a number or a string")
        out.append({"prompt": text, "question_id": qid, "category": str(obj.get("category", "all"))})
    return out
