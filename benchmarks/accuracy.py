"""Accuracy of the bfloat16 and int8 weight formats against float32 on real prompts.

    python benchmarks/accuracy.py --prompts tests/data/spec_bench/question_excerpt.jsonl --limit 2 --max-new-tokens 64

(the Spec-Bench excerpt carried in the repository; Spec-Bench's whole ``data/spec_bench/question.jsonl``
works the same way).

Prints a markdown table (top-1 agreement, mean KL(p_f32 ‖ p_format), greedy agreement
length) and, with --out, the full JSON report.
"""

import argparse
import collections
import json
import sys

from specjax.api import encode_prompts
from specjax.io.prompts import read_prompts
from specjax.eval.formats import accuracy_report, format_report
from specjax.io.loading import load_model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=2, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--formats", nargs="+", default=["bfloat16", "int8"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = read_prompts(a.prompts)
    seen = collections.Counter()
    picked = []
    for r in rows:
        if seen[r["category"]] < a.limit:
            seen[r["category"]] += 1
            picked.append(r)
    ref = load_model(a.model, dtype="float32")
    ids = encode_prompts(ref, [r["prompt"] for r in picked], chat=True)
    others = {f: load_model(a.model, dtype=f) for f in a.formats}
    rep = accuracy_report(ref, others, ids, a.max_new_tokens)
    print(f"{len(ids)} prompts ({a.limit} per category), {a.max_new_tokens} greedy tokens each\n")
    print(format_report(rep, a.max_new_tokens))
    if a.out:
        with open(a.out, "x") as f:
            json.dump({"command": " ".join(sys.argv), "report": rep}, f, indent=1)


if __name__ == "__main__":
    main()
