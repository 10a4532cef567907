"""Subprocess worker for tests/test_sharding.py (device count is fixed at JAX start-up,
so every mesh check runs here, in a fresh process).

    python tests/sharding_worker.py tiny                 # 8 virtual CPU devices, several meshes
    python tests/sharding_worker.py default              # 3 virtual devices, the real default model
    python tests/sharding_worker.py dist PORT PID NPROC  # one process of a jax.distributed run

Prints one JSON line ``RESULT {...}`` on stdout at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

MODE = sys.argv[1] if len(sys.argv) > 1 else "tiny"
_DEVICES = {"tiny": 8, "default": 3, "dist": 2}[MODE]
# Lower LLVM optimization halves compile time on CPU; every run in a process (reference
# and meshes) uses the same flags, so the comparisons are unaffected.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_DEVICES}"
                           " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

_CACHE = os.environ.get("SPECJAX_TEST_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
os.makedirs(_CACHE, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

from conftest import tiny_model  # noqa: E402

from specjax.io import loading  # noqa: E402
from specjax.runtime import sharding  # noqa: E402
from specjax.runtime import decoder as decode
from specjax.drafters.model import ModelDrafter  # noqa: E402
from specjax.models import llama  # noqa: E402
from specjax.core.sampling import SamplingParams  # noqa: E402

TIE_MARGIN = 1e-3
MAX_NEW = 24
GAMMA = 3


def tiny_case():
    """The tiny target (8 heads, 2 KV heads), a drafter with another layout (4/4 heads,
    width 32, 1 layer) and 8 prompts of different lengths."""
    target = tiny_model(0)
    dm = tiny_model(1, hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=8, num_layers=1,
                    intermediate_size=96)
    drafter = ModelDrafter.from_model(dm, name="tiny-draft")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 128, size=n).tolist() for n in (3, 12, 7, 1, 9, 5, 4, 6)]
    return target, drafter, prompts


def spec_str(x) -> list:
    return [a for a in x.sharding.spec] + [None] * (x.ndim - len(x.sharding.spec))


def top2_margin(model, seq) -> float:
    """Top-2 logit margin of the single-device ``model`` after the token ids ``seq``."""
    cfg = model.config
    toks = jax.numpy.asarray([seq], jax.numpy.int32)
    pos = jax.numpy.arange(len(seq), dtype=jax.numpy.int32)[None]
    cache = llama.KVCache.create(cfg, 1, len(seq))
    logits = np.asarray(llama.apply(model.graphdef, model.params, toks, pos, cache, cfg).logits[0, -1])
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def compare(label, got, want, prompts, ref_model, greedy=True):
    """Rows of ``got`` vs ``want``: ``(failures, near_ties)``; a greedy row that diverges at a
    position whose reference top-2 margin is < TIE_MARGIN is a float32 near-tie, not a failure."""
    fails, ties = [], []
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        j = next((k for k in range(min(len(g), len(w))) if g[k] != w[k]), min(len(g), len(w)))
        if greedy and j < min(len(g), len(w)):
            m = top2_margin(ref_model, list(prompts[i]) + list(w[:j]))
            if m < TIE_MARGIN:
                ties.append({"case": label, "row": i, "pos": j, "margin": m, "tokens": [g[j], w[j]]})
                continue
            fails.append({"case": label, "row": i, "pos": j, "margin": m, "got": g, "want": w})
        else:
            fails.append({"case": label, "row": i, "pos": j, "got": g, "want": w})
    return fails, ties


def param_specs(params):
    pure = {}
    layer0 = params["layers"][0]
    for k in ("w_qkv", "wo", "w_gate_up", "w_down", "attn_norm"):
        pure[k] = spec_str(layer0[k][...])
    for k in ("embed", "lm_head", "final_norm"):
        if k in params:
            pure[k] = spec_str(params[k][...])
    return pure


def engine_cases(target, drafter, prompts, mesh):
    """4 requests (greedy: prompts 0 and 1, as ``compare`` reads them; seeded sampled at T = 1) through an Engine of 2 slots on ``mesh``
    (admitted as slots free up), against each request decoded alone on one device with
    ``request_keys(seed, 1)``; and slots that are not a multiple of ``data`` refused."""
    from specjax.core.sampling import Sampling
    from specjax.runtime.engine import Engine, EngineRequest

    reqs = [EngineRequest(prompts[i], max_new_tokens=MAX_NEW, seed=20 + i,
                          sampling=Sampling(temperature=1.0) if i >= 2 else Sampling()) for i in range(4)]
    eng = Engine(decode.Decoder(target, drafter, GAMMA, mesh=mesh), slots=2, max_context=96, max_logprobs=None)
    ids = {eng.submit(r): i for i, r in enumerate(reqs)}
    got = [[] for _ in reqs]
    for _ in range(200):
        for u in eng.step():
            got[ids[u.request_id]] += u.tokens
        if eng.idle:
            break
    alone = decode.Decoder(target, drafter, GAMMA)
    out = {}
    for greedy in (True, False):
        rows = [i for i, r in enumerate(reqs) if (r.sampling.temperature == 0) == greedy]
        want = [alone.generate([reqs[i].prompt], max_new_tokens=MAX_NEW, keys=decode.request_keys(reqs[i].seed, 1),
                               sampling=SamplingParams.from_rows([reqs[i].sampling])).tokens[0] for i in rows]
        res = type("R", (), {"tokens": [got[i] for i in rows], "compile_s": 0.0})()
        out["engine-" + ("greedy" if greedy else "sampled")] = (res, want, greedy)
    try:
        Engine(decode.Decoder(target, mesh=mesh), slots=3)
        out["engine-slots-refused"] = (type("R", (), {"tokens": [[0]], "compile_s": 0.0})(), [[1]], False)  # a failure
    except ValueError as e:
        assert "multiple of the mesh's data axis" in str(e), e
    return out


def run_tiny():
    target, drafter, prompts = tiny_case()
    sampled = SamplingParams.create(len(prompts), temperature=1.0)
    kw = dict(max_new_tokens=MAX_NEW, seed=7)
    out = {"timings": {}, "fails": [], "ties": [], "specs": {}, "compile_s": {}}
    t0 = time.perf_counter()
    ref = decode.Decoder(target)
    ref_g = ref.generate(prompts, **kw)
    ref_s = ref.generate(prompts, sampling=sampled, **kw)
    ref_sp_s = decode.Decoder(target, drafter, GAMMA).generate(prompts, sampling=sampled, **kw)
    out["timings"]["reference"] = time.perf_counter() - t0
    out["ref_greedy"] = ref_g.tokens
    out["prompts"] = prompts
    out["accepted_sampled"] = sum(s["accepted_tokens"] for s in ref_sp_s.stats)
    for shape in ((1, 1), (8, 1), (2, 4), (1, 8)):
        t0 = time.perf_counter()
        name = f"{shape[0]}x{shape[1]}"
        mesh = sharding.MeshSpec(*shape).make()
        ar = decode.Decoder(target, mesh=mesh)
        sp = decode.Decoder(target, drafter, GAMMA, mesh=mesh)
        results = {
            "ar-greedy": (ar.generate(prompts, **kw), ref_g.tokens, True),
            "ar-sampled": (ar.generate(prompts, sampling=sampled, **kw), ref_s.tokens, False),
            "spec-greedy": (sp.generate(prompts, **kw), ref_g.tokens, True),
            "spec-sampled": (sp.generate(prompts, sampling=sampled, **kw), ref_sp_s.tokens, False),
        }
        if shape == (2, 4):  # draft trees (issue 18): n-gram trie, tree call + compaction on the mesh
            from specjax.drafters.ngram import NgramDrafter

            tree = decode.Decoder(target, NgramDrafter(1), mesh=mesh, tree_nodes=6, tree_depth=3, tree_topk=2)
            results["tree-greedy"] = (tree.generate(prompts, **kw), ref_g.tokens, True)
        if shape == (2, 4):  # the serving engine (issue 31) on the mesh: slots split over data
            results.update(engine_cases(target, drafter, prompts, mesh))
        if shape[0] == 8:  # 5 rows padded to 8 reuse the compiled batch-8 programs
            s5 = SamplingParams.create(5, temperature=1.0)
            results["ar-greedy-b5"] = (ar.generate(prompts[:5], **kw), ref_g.tokens[:5], True)
            results["spec-sampled-b5"] = (sp.generate(prompts[:5], sampling=s5, **kw), ref_sp_s.tokens[:5], False)
        for case, (res, want, greedy) in results.items():
            if len(res.tokens) != len(want):
                out["fails"].append({"case": f"{name}/{case}", "rows": len(res.tokens), "want_rows": len(want)})
                continue
            f, t = compare(f"{name}/{case}", res.tokens, want, prompts, target, greedy)
            out["fails"] += f
            out["ties"] += t
        # intended layouts: parameters (target and drafter by their own configs) and caches
        prog, st, _, _ = sp.start(prompts, **kw)
        out["specs"][name] = {
            "target": param_specs(sp.target.params),
            "drafter": param_specs(sp.drafter.params),
            "target_cache_k": spec_str(st.target_cache.k[0]),
            "target_cache_v": spec_str(st.target_cache.v[-1]),
            "drafter_cache_k": spec_str(st.drafter_state.k[0]),
            "tokens": spec_str(st.tokens),
            "keys": spec_str(st.keys),
            "batch": int(st.tokens.shape[0]),
            "auto_mesh": decode.Decoder(sp.target).mesh is not None,
        }
        out["compile_s"][name] = sum(r[0].compile_s for r in results.values())
        out["timings"][name] = time.perf_counter() - t0
    return out


def run_default():
    from specjax.io.loading import load_model

    mesh = sharding.MeshSpec(1, 3).make()
    t0 = time.perf_counter()
    model = loading.load_model(None, mesh=mesh)  # every tensor placed into its sharding
    out = {"timings": {"load": time.perf_counter() - t0}, "fails": [], "ties": []}
    out["specs"] = param_specs(model.params)
    out["notes"] = {str(m): sharding.replication_notes(model.config, m) for m in (2, 3, 4, 8)}
    single = model.replace(params=jax.device_put(model.params, jax.devices()[0]))
    tok = model.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")]
    kw = dict(max_new_tokens=16, eos_ids=[])
    t0 = time.perf_counter()
    ref = decode.Decoder(single)
    assert ref.mesh is None
    want = ref.generate(prompts, **kw).tokens
    out["timings"]["single"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dec = decode.Decoder(model)  # no mesh argument: taken from the sharded parameters
    out["auto_mesh"] = dec.mesh is not None and dict(dec.mesh.shape) == {"data": 1, "model": 3}
    got = dec.generate(prompts, **kw).tokens
    out["timings"]["mesh_1x3"] = time.perf_counter() - t0
    f, t = compare("default/1x3", got, want, prompts, single)
    out["fails"], out["ties"] = f, t
    out["tokens"], out["want"] = got, want
    del load_model
    return out


def run_dist(port: int, pid: int, nproc: int):
    sharding.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    target, _, prompts = tiny_case()
    mesh = sharding.MeshSpec.parse("data=2,model=2").make()
    t0 = time.perf_counter()
    dec = decode.Decoder(target, mesh=mesh)
    kw = dict(max_new_tokens=MAX_NEW, seed=7)
    # Compile both programs before anything runs, then meet at a coordination-service barrier:
    # gloo gives a peer only 30 s to join a collective, less than a compile on a loaded machine.
    prog, args = dec.prepare(prompts, **kw)
    dec.compiled_program("start", prog, args)
    st = jax.eval_shape(lambda *a: decode.prefill(prog, *a), *args)
    st = jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                st, sharding.state_shardings(prog, st, mesh))
    limit = jax.ShapeDtypeStruct((), np.int32, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    dec.compiled_program("run", prog, (dec.target.params, None, st, limit))
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier("specjax_test_compiled", 600_000)
    res = dec.generate(prompts, **kw)
    assert res.compile_s == 0.0, "the programs compiled above were not reused"
    return {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "tokens": res.tokens, "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    if MODE == "tiny":
        result = run_tiny()
    elif MODE == "default":
        result = run_default()
    else:
        result = run_dist(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    print("RESULT " + json.dumps(result), flush=True)
    if MODE == "dist":
        jax.distributed.shutdown()
