"""`specjax bench` end to end on a tiny saved model (with a word-level tokenizer and a chat
template): JSON schema, speedup of the baseline, per-category entries, greedy speculative ==
autoregressive, a bad prompts file (exit 2 naming the line), --out never overwrites."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_model

WORDS = [f"w{i}" for i in range(3, 128)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tokenizers import Tokenizer as HFTok, models, pre_tokenizers

    from specjax.io.loading import save_model
    from specjax.io.tokenizer import Tokenizer

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    hf = HFTok(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = Tokenizer(hf, bos_token_id=0, eos_token_ids=(1,), add_bos=False,
                    chat_template="{% for m in messages %}<s> {{ m['content'] }} {% endfor %}w9",
                    special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    path = tmp_path_factory.mktemp("tiny") / "tiny-model"
    save_model(tiny_model(seed=3).replace(tokenizer=tok), str(path))
    return str(path)


def _prompts(tmp_path, lines):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(line + "\n" for line in lines))
    return str(f)


def _spec_bench(tmp_path):
    rows = []
    for qid, cat, words in [(1, "summarization", "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"),
                            (2, "summarization", "w10 w11 w12 w10 w11 w12 w10"),
                            (3, "summarization", "w20 w21 w22"),  # beyond --limit 2
                            (4, "qa", "w30 w31 w32 w33 w30 w31"),
                            (5, "qa", "w40 w41 w40 w41 w40 w41 w40"),
                            (6, "coding", "w50 w51")]:
        rows.append(json.dumps({"question_id": qid, "category": cat, "turns": [words, "w3 w4"]}))
    return _prompts(tmp_path, rows)


def _run(argv, capsys):
    from specjax.cli import main

    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_bench_json_and_out(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    prompts = _spec_bench(tmp_path)
    out_file = tmp_path / "res" / "results.json"
    out_file.parent.mkdir()  # bench makes no directory for --out (a missing one is refused)
    argv = ["bench", "--prompts", prompts, "--model", tiny_dir, "--categories", "summarization,qa", "--limit", "2",
            "--draft", "ngram", "--gamma", "2", "3", "--max-new-tokens", "8", "--batch-size", "2", "--ignore-eos",
            "--json", "--out", str(out_file), "--no-progress"]
    rc, out, err = _run(argv, capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert json.loads(out_file.read_text()) == res
    assert set(res) == {"config", "methods", "prompts", "fidelity"}
    assert res["fidelity"] == {"float32": {"mean_kl": 0.0, "top1_agreement": 1.0, "faithful": True}}
    cfg = res["config"]
    for key in ("model_name", "dtype", "temperature", "batch_size", "max_new_tokens", "chat", "ignore_eos",
                "bandwidth_formula", "machine", "weight_bytes", "prompts_per_category"):
        assert key in cfg, key
    assert cfg["chat"] is True and cfg["prompts_per_category"] == {"summarization": 2, "qa": 2}
    for key in ("jax", "devices", "cpu_count"):
        assert key in cfg["machine"]
    assert cfg["greedy_mismatches_vs_ar"] == 0  # greedy speculative == autoregressive (float32)
    assert list(res["methods"]) == ["ar", "ngram:3@γ2", "ngram:3@γ3"]
    fields = ("tokens_per_s", "speedup", "speedup_decode_time", "mean_accepted_tokens", "acceptance_rate",
              "new_tokens", "target_calls", "decode_s", "wall_s", "bandwidth_gb_s")
    for name, m in res["methods"].items():
        assert "compile_s" in m and m["compile_s"] >= 0
        assert set(m["per_category"]) == {"summarization", "qa"}
        for entry in [m["overall"], *m["per_category"].values()]:
            for f in fields:
                assert f in entry, (name, f)
            assert entry["new_tokens"] == 8 * entry["prompts"]  # --ignore-eos
            assert entry["tokens_per_s"] > 0 and entry["bandwidth_gb_s"] > 0
    ar = res["methods"]["ar"]
    assert ar["overall"]["speedup"] == 1.0 and ar["overall"]["speedup_decode_time"] == 1.0
    assert ar["overall"]["mean_accepted_tokens"] == 1.0 and ar["overall"]["acceptance_rate"] is None
    assert all(v["speedup"] == 1.0 for v in ar["per_category"].values())
    ng = res["methods"]["ngram:3@γ2"]
    assert ng["drafter"] == "ngram:3" and ng["gamma"] == 2 and ng["baseline"] == "ar"
    assert 0.0 <= ng["overall"]["acceptance_rate"] <= 1.0
    assert ng["overall"]["mean_accepted_tokens"] >= 1.0
    assert len(res["prompts"]) == 3 * 4
    rec = res["prompts"][0]
    for key in ("question_id", "category", "new_tokens", "decode_s", "stats", "method"):
        assert key in rec
    # --out never overwrites without --force (and fails before loading anything)
    before = out_file.read_text()
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and "exists" in err and "--force" in err
    assert out_file.read_text() == before


def test_bench_table_no_chat(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    prompts = _spec_bench(tmp_path)
    rc, out, err = _run(["bench", "--prompts", prompts, "--model", tiny_dir, "--categories", "coding",
                         "--draft", "none", "--max-new-tokens", "4", "--no-chat", "--warmup", "0"], capsys)
    assert rc == 0, err
    assert out.startswith("| method | tokens/s | speedup")
    assert "| ar |" in out and "| coding |" in out


def test_bench_prompt_text_and_progress_lines(tiny_dir, capsys, monkeypatch):
    """``--prompt TEXT`` (repeatable) instead of a file; without a terminal (capsys) the progress
    is plain lines on stderr: each method's warm-up with its compile time and the timed batches."""
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    rc, out, err = _run(["bench", "--prompt", "w3 w4 w5", "--prompt", "w6 w7", "--model", tiny_dir, "--batch-size", "1",
                         "--draft", "ngram", "--gamma", "2", "--max-new-tokens", "4", "--no-chat"], capsys)
    assert rc == 0, err
    assert "| cli |" in out and "ngram:3@γ2" in out
    assert "warm-up ar: compile" in err and "warm-up ngram:3@γ2: compile" in err
    assert "batch 2/2 timed (2 methods)" in err
    rc, out, err = _run(["bench", "--model", tiny_dir], capsys)
    assert rc == 2 and err.count("\n") == 1 and "--prompts FILE" in err and "--prompt TEXT" in err


@pytest.mark.parametrize("lines, where", [
    (['{"prompt": "w3 w4"}', '{not json'], ":2:"),
    (['{"prompt": "w3 w4"}', '', '{"category": "qa"}'], ":3:"),
    (['[1, 2]'], ":1:"),
    ([], "empty"),
])
def test_bench_bad_prompts_file(tmp_path, capsys, lines, where):
    prompts = _prompts(tmp_path, lines)
    rc, out, err = _run(["bench", "--prompts", prompts, "--model", "/nonexistent"], capsys)
    assert rc == 2
    assert err.startswith("specjax: error:") and err.count("\n") == 1
    assert where in err and "prompts.jsonl" in err


def test_bench_unknown_category(tmp_path, capsys):
    rc, out, err = _run(["bench", "--prompts", _spec_bench(tmp_path), "--categories", "poetry"], capsys)
    assert rc == 2 and "poetry" in err and "summarization" in err


def test_select_and_batches():
    from specjax.eval.bench import make_batches, select_prompts

    ps = [{"prompt": "x", "question_id": i, "category": c} for i, c in enumerate("aabbbab")]
    sel = select_prompts(ps, ["a", "b"], 2)
    assert [p["question_id"] for p in sel] == [0, 1, 2, 3]
    assert make_batches(ps, 2) == [[0, 1], [5], [2, 3], [4, 6]]


def test_peers_transformers_same_schema(tiny_dir, tmp_path, capsys, monkeypatch):
    """benchmarks/peers_transformers.py on the tiny model: the same JSON schema as specjax bench."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "peers_transformers.py")
    spec = importlib.util.spec_from_file_location("peers_transformers", path)
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    import torch

    threads = torch.get_num_threads()
    try:
        rc = peers.main(["--prompts", _spec_bench(tmp_path), "--model", tiny_dir, "--categories", "qa", "coding",
                         "--limit", "1", "--gamma", "2", "--draft-layers", "1", "--max-new-tokens", "4", "--ignore-eos",
                         "--warmup", "0", "--threads", "1", "--json", "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads(out)
    assert set(res) == {"config", "methods", "prompts"} and res["config"]["library"] == "transformers"
    assert list(res["methods"]) == ["ar", "first1@γ2", "ngram:3@γ2"]
    for m in res["methods"].values():
        assert set(m["per_category"]) == {"qa", "coding"}
        for f in ("tokens_per_s", "speedup", "mean_accepted_tokens", "acceptance_rate", "new_tokens",
                  "target_calls", "decode_s", "wall_s", "bandwidth_gb_s"):
            assert f in m["overall"]
        assert m["overall"]["new_tokens"] == 8
    assert res["methods"]["ar"]["overall"]["speedup"] == 1.0
    assert res["config"]["greedy_mismatches_vs_ar"] == 0


def test_split_keeps_the_listed_question_ids(tmp_path):
    from specjax.io.prompts import read_prompts
    from specjax.eval.bench import filter_split

    prompts = read_prompts(_spec_bench(tmp_path))
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [1, 2, 3, 6], "eval": [4, 5]}))
    assert [p["question_id"] for p in filter_split(prompts, str(split))] == [4, 5]
    assert [p["question_id"] for p in filter_split(prompts, f"{split}:train")] == [1, 2, 3, 6]
    with pytest.raises(ValueError, match="has no list 'dev'"):
        filter_split(prompts, f"{split}:dev")
    with pytest.raises(ValueError, match="no such file"):
        filter_split(prompts, str(tmp_path / "missing.json"))
    split.write_text(json.dumps({"eval": [99]}))
    with pytest.raises(ValueError, match="none of the prompts"):
        filter_split(prompts, str(split))
    # the drafter's committed split is found by name among the shipped configs
    shipped = [{"prompt": "x", "question_id": q, "category": "c"} for q in (81, 82, 83)]
    from importlib import resources

    ev = json.loads((resources.files("specjax.shipped_configs") / "spec_bench_split.json").read_text())["eval"]
    shipped.append({"prompt": "y", "question_id": ev[0], "category": "c"})
    assert [p["question_id"] for p in filter_split(shipped, "spec_bench_split.json")] == [ev[0]]


def test_bench_request_keys_are_the_old_per_prompt_keys():
    """bench's vectorized keys (``request_keys``, indexed by a batch's prompt indices, which
    are not contiguous when categories interleave) equal the former per-prompt loop
    ``fold_in(seed_key(seed), i)``, so benchmark results do not change."""
    import jax
    import numpy as np

    from specjax.eval.bench import BenchRun, make_batches
    from specjax.runtime.decoder import seed_key
    from specjax.runtime.settings import DecodeSettings

    prompts = [{"prompt": "w3", "category": c} for c in "abab ab"]
    for seed in (0, 7, 2 ** 40 + 3):
        run = BenchRun(prompts, DecodeSettings(seed=seed, batch_size=2), make_batches(prompts, 2))
        for idx in run.batches:
            old = jax.numpy.stack([jax.random.fold_in(seed_key(seed), i) for i in idx])
            np.testing.assert_array_equal(np.asarray(run.keys[np.asarray(idx)]), np.asarray(old))


def test_generate_text_settings_object_or_keywords(tiny_dir):
    """``specjax.generate_text`` takes a DecodeSettings or the old keywords (same results);
    both at once is an error naming the keyword."""
    import specjax
    from specjax.io.loading import load_model
    from specjax.runtime.settings import DecodeSettings

    target = load_model(tiny_dir)
    texts = ["w5 w6 w7 w5 w6", "w10 w11 w12"]
    kw = dict(max_new_tokens=5, temperature=0.8, top_k=20, seed=3, batch_size=1, ignore_eos=True)
    a = specjax.generate_text(target, texts, **kw)
    b = specjax.generate_text(target, texts, settings=DecodeSettings(**kw))
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b] and all(len(r["tokens"]) == 5 for r in a)
    assert all(r["stats"]["tokens_per_s"] > 0 and r["stats"]["batch_size"] == 1 for r in b)
    with pytest.raises(ValueError, match="seed"):
        specjax.generate_text(target, texts, seed=4, settings=DecodeSettings(**kw))


def test_step_split_tiny(tmp_path, capsys):
    """benchmarks/step_split.py on a tiny random model (--tiny): one table row and one JSON entry
    per weight format, every column a positive time, the host line (CPU, AVX flags, jax)."""
    import importlib.util
    import math
    import os

    import jax

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "step_split.py")
    spec = importlib.util.spec_from_file_location("step_split", path)
    split = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(split)
    out_file = tmp_path / "split.json"
    rc = split.main(["--tiny", "--dtype", "float32", "int8", "--repeats", "1", "--tokens", "4", "--verify-tokens", "2",
                     "--json", str(out_file)])
    out, _ = capsys.readouterr()
    assert rc == 0
    res = json.loads(out_file.read_text())
    assert list(res["formats"]) == ["float32", "int8"]
    assert res["host"]["jax"] == jax.__version__ and res["bandwidth"]["gb_s"] > 0
    for fmt, r in res["formats"].items():
        for col in split.COLUMNS:
            assert math.isfinite(r[col]) and r[col] > 0, (fmt, col, r[col])
        assert set(r["v"]) == {"2"} and r["v"]["2"] > 0
        assert r["matmul_count"] >= 2 * 2 + 1  # ≥ 2 projections per layer (2 layers) + the head
        assert f"| {fmt} |" in out
    assert res["formats"]["int8"]["weight_bytes"] < res["formats"]["float32"]["weight_bytes"]
    assert out.startswith("host: ") and f"jax {jax.__version__}" in out and "(f) v(2)" in out
    with pytest.raises(SystemExit):  # never overwrites
        split.main(["--tiny", "--json", str(out_file)])
