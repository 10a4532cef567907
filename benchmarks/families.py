"""What the Qwen3 and Gemma 3 differences cost (issue 30's target): prefill and decode throughput of
≈ 0.45 B-parameter random models of the same size in the Llama, Qwen3 and Gemma 3 shapes, side by
side in one run (same width, depth, heads, MLP and vocabulary; only the family's differences change:
Qwen3's q/k norms; Gemma 3's √D embeddings, sandwich norms, GeGLU, q/k norms, 5 sliding-window
layers of 6 with a 512-token window and a local RoPE base).

    python benchmarks/families.py [--dtype float32] [--prompt 1024] [--new 64] [--repeats 3]

Prints one JSON line per family (``prefill_tokens_per_s``, ``decode_tokens_per_s``: medians over
``--repeats`` warm runs, compile excluded; batch 1, greedy) and the host's CPU flags. Random weights:
throughput only (the outputs are meaningless).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import numpy as np

from specjax.eval.hostcache import host_fingerprint
from specjax.io.loading import Model
from specjax.models import llama
from specjax.models.config import ModelConfig
from specjax.runtime.decoder import Decoder

BASE = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=36, num_heads=16,
                   num_kv_heads=8, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
                   tie_word_embeddings=True, eos_token_ids=(), bos_token_id=None)
SHAPES = {
    "llama": BASE,
    "qwen3": dataclasses.replace(BASE, model_type="qwen3", qk_norm=True),
    "gemma3": dataclasses.replace(
        BASE, model_type="gemma3_text", qk_norm=True, hidden_act="gelu_tanh", sandwich_norms=True,
        norm_weight_offset=1.0, scale_embeddings=True, query_pre_attn_scalar=64.0, sliding_window=512,
        sliding_layers=tuple(i for i in range(BASE.num_layers) if (i + 1) % 6), rope_local_theta=1e4),
}


def run(name: str, cfg: ModelConfig, dtype: str, prompt_len: int, new: int, repeats: int) -> dict:
    graphdef, params = llama.init_model(cfg, seed=0)
    model = Model(cfg, graphdef, params, None, name=name)
    if dtype != "float32":
        from specjax.io.loading import convert_model

        model = convert_model(model, dtype)
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, size=prompt_len).tolist()
    dec = Decoder(model)
    dec.generate([prompt], max_new_tokens=new, eos_ids=[])  # compile
    pre, dec_s = [], []
    for _ in range(repeats):
        r = dec.generate([prompt], max_new_tokens=new, eos_ids=[])
        pre.append(r.prefill_s)
        dec_s.append(r.decode_s)
    return {"family": name, "params": llama.num_params(cfg), "dtype": dtype, "prompt_tokens": prompt_len,
            "new_tokens": new, "prefill_tokens_per_s": prompt_len / statistics.median(pre),
            "decode_tokens_per_s": new / statistics.median(dec_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma list of families (default: all)")
    a = ap.parse_args()
    print(json.dumps({"host": host_fingerprint()}))
    for name, cfg in SHAPES.items():
        if a.only and name not in a.only.split(","):
            continue
        print(json.dumps(run(name, cfg, a.dtype, a.prompt, a.new, a.repeats)), flush=True)


if __name__ == "__main__":
    main()
