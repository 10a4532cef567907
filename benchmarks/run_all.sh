#!/usr/bin/env bash
# Produce every table of BENCHMARKS.md (hours on a 2-core CPU: run it on an otherwise idle machine).
#
#   PROMPTS=/path/to/spec_bench/question.jsonl bash benchmarks/run_all.sh
#
# Spec-Bench prompts: data/spec_bench/question.jsonl of https://github.com/hemingkx/Spec-Bench
# (13 categories; the first turn of each question is used, with the chat template).
# Results go to $OUT (default results/, git-ignored): one JSON (full results) and one .md (the
# table) per step. A step whose JSON already exists is skipped, so the script can be resumed;
# delete a file to redo its step.
#
# Settings (environment): PROMPTS, OUT, LIMIT (prompts per category, 5), TOKENS (128),
# GAMMAS (γ values at batch 1, "3 4 5"), GAMMA (γ for the other tables, 4),
# EOS (--ignore-eos: fixed-length outputs; set EOS= to stop at EOS), DTYPES (weight formats).
set -euo pipefail
cd "$(dirname "$0")/.."

PROMPTS=${PROMPTS:?set PROMPTS to Spec-Bench data/spec_bench/question.jsonl}
OUT=${OUT:-results}
LIMIT=${LIMIT:-5}
TOKENS=${TOKENS:-128}
GAMMAS=${GAMMAS:-"3 4 5"}
GAMMA=${GAMMA:-4}
EOS=${EOS---ignore-eos}
mkdir -p "$OUT"

step() {  # step NAME COMMAND...: run COMMAND unless $OUT/NAME.json exists; table -> $OUT/NAME.md
  local name=$1; shift
  if [[ -e "$OUT/$name.json" ]]; then echo "== $name: $OUT/$name.json exists, skipped" >&2; return; fi
  echo "== $name: $*" >&2
  "$@" --out "$OUT/$name.json" | tee "$OUT/$name.md"
}

# The untrained early-exit drafter: the target's first 2 blocks + final norm + head, saved once
# as a Hugging Face directory named first2 (method names: first2@γG, in specjax and transformers).
DRAFT_DIR=${DRAFT_DIR:-$OUT/drafters/first2}
if [[ ! -e "$DRAFT_DIR/model.safetensors" ]]; then
  python -c "
from specjax.io.loading import load_model, save_model, truncate_model
save_model(truncate_model(load_model(), 2, name='first2'), '$DRAFT_DIR')
print('saved $DRAFT_DIR')"
fi
DRAFTS=(ngram "$DRAFT_DIR")
# the trained drafter, when one is shipped
if python -c "from specjax.io.shipped import shipped_drafter_path; shipped_drafter_path()" 2>/dev/null; then
  DRAFTS+=(default)
fi

COMMON=(--prompts "$PROMPTS" --limit "$LIMIT" --max-new-tokens "$TOKENS" $EOS)

# Foundation targets: bandwidth floor, specjax vs transformers (batch 1 and 8), peak memory.
step baseline python benchmarks/baseline.py --prompts "$PROMPTS" --max-new-tokens "$TOKENS"

# Spec-Bench, greedy, batch 1: ar, n-gram, the truncated draft model, the trained drafter.
step specbench_greedy_b1 specjax bench "${COMMON[@]}" --draft "${DRAFTS[@]}" --gamma $GAMMAS --batch-size 1

# Batch 4 and 8.
for B in 4 8; do
  step "specbench_greedy_b$B" specjax bench "${COMMON[@]}" --draft "${DRAFTS[@]}" --gamma "$GAMMA" --batch-size "$B"
done

# Temperature 0.7 (sampled; the output distribution is the target's).
step specbench_t07_b1 specjax bench "${COMMON[@]}" --draft "${DRAFTS[@]}" --gamma "$GAMMA" --temperature 0.7 --seed 0

# transformers on the same model and prompts: greedy, assisted generation with the same first2
# draft model, prompt lookup (n-gram 3) at batch 1; plain greedy at batch 4 and 8.
step peers_transformers_b1 python benchmarks/peers_transformers.py "${COMMON[@]}" --gamma "$GAMMA" \
  --draft-model "$DRAFT_DIR" --ngram 3 --batch-size 1
for B in 4 8; do
  step "peers_transformers_b$B" python benchmarks/peers_transformers.py "${COMMON[@]}" --methods ar --batch-size "$B"
done
step peers_transformers_t07_b1 python benchmarks/peers_transformers.py "${COMMON[@]}" --gamma "$GAMMA" \
  --draft-model "$DRAFT_DIR" --ngram 3 --batch-size 1 --temperature 0.7

# Weight formats (speedups relative to the float32 autoregressive baseline of the same run).
# DTYPES: the formats load_model(dtype=...) implements (default: all three).
read -r -a FORMATS <<< "${DTYPES:-float32 bfloat16 int8}"
step weight_formats_b1 specjax bench "${COMMON[@]}" --draft ngram --gamma "$GAMMA" --dtype "${FORMATS[@]}" --batch-size 1

# Where the decode step's time goes, per weight format at batch 1: the decode loop per token, one
# jitted step, blocks only, projection matmuls + head, the bandwidth floor and v(T) (minutes).
step step_split_b1 python benchmarks/step_split.py --dtype "${FORMATS[@]}" --batch 1

# What limits the speedup: α, c, v(γ) and predicted vs measured speedup, per drafter
# (JSON from `specjax analyze --json`, rendered to markdown by the same code as the text output).
for D in "${DRAFTS[@]}"; do
  name=analyze_$(basename "$D")
  if [[ -e "$OUT/$name.json" ]]; then echo "== $name: exists, skipped" >&2; continue; fi
  echo "== $name" >&2
  specjax analyze --draft "$D" --prompts "$PROMPTS" --limit "$LIMIT" --max-new-tokens "$TOKENS" --chat $EOS \
    --json > "$OUT/$name.json.tmp"
  mv "$OUT/$name.json.tmp" "$OUT/$name.json"
  python -c "
import json, sys
from specjax.eval.report import render_models
print(render_models(json.load(open(sys.argv[1]))))" "$OUT/$name.json" > "$OUT/$name.md" \
    || echo "(could not render $OUT/$name.json as markdown; the JSON is complete)" >&2
done

echo "done: tables in $OUT/*.md, full results in $OUT/*.json" >&2
