"""The command line: every bad input is one line ``specjax: error: …`` with exit status 2
and no traceback (in-process through ``specjax.cli.main`` and through a subprocess), and
``specjax generate --json`` on the real model."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
from conftest import tiny_model

import specjax
from specjax import cli
from specjax.io.loading import save_model
from specjax.io.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def _cli_env(monkeypatch):
    # keep the test session's compilation cache (main() would point JAX at ~/.cache otherwise)
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)


def word_tokenizer(vocab_size):
    """Word-level tokenizer: ``<s>`` 0, ``</s>`` 1, ``<unk>`` 2, ``w3`` … (ids match tiny_config)."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tk = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(tk, bos_token_id=0, eos_token_ids=(1,), add_bos=False,
                     special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoint directories: a tiny model with a 16-token context and a tokenizer, and
    broken variants of it."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("cli")
    m = tiny_model(seed=21, max_position_embeddings=16)
    good = save_model(m.replace(tokenizer=word_tokenizer(m.config.vocab_size)), str(root / "ctx16"))
    with open(os.path.join(good, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(good, "model.safetensors"))

    def variant(name, cfg_update=None, drop=None, reshape=None, weights=True):
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**config, **(cfg_update or {})}))
        if weights:
            t = dict(tensors)
            if drop:
                t.pop(drop)
            if reshape:
                t[reshape] = t[reshape][:-1]
            save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        return str(d)

    out = {
        "ctx16": good,
        "missing_tensor": variant("missing_tensor", drop="model.layers.0.self_attn.v_proj.weight"),
        "wrong_shape": variant("wrong_shape", reshape="model.layers.1.mlp.down_proj.weight"),
        "gpt2": variant("gpt2", cfg_update={"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}),
        "yarn": variant("yarn", cfg_update={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
        "gelu": variant("gelu", cfg_update={"hidden_act": "gelu"}),
        "pickle": variant("pickle", weights=False),
    }
    with open(os.path.join(out["pickle"], "pytorch_model.bin"), "wb") as f:
        pickle.dump({"a": 1}, f)
    bad_jsonl = root / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "ok"}\n{not json\n')
    out["bad_jsonl"] = str(bad_jsonl)
    no_field = root / "nofield.jsonl"
    no_field.write_text('{"question": "where is the prompt?"}\n')
    out["no_field_jsonl"] = str(no_field)
    return out


LONG = " ".join(f"w{i}" for i in range(3, 23))  # 20 tokens > the 16-token context

# (argv, words the one-line message must contain); {name} is a path from `ckpts`
ERROR_CASES = [
    (["generate", ""], ["prompt 0 is empty"]),
    (["generate", "   ", "--model", "{ctx16}"], ["empty"]),
    (["generate", LONG, "--model", "{ctx16}"], ["20 tokens", "context of 16", "shorten"]),
    (["generate", "hi", "--temperature", "-1"], ["--temperature", ">= 0"]),
    (["generate", "hi", "--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["generate", "hi", "--top-p", "1.5"], ["--top-p", "(0, 1]"]),
    (["generate", "hi", "--top-k", "-1"], ["--top-k", ">= 0"]),
    (["generate", "hi", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["generate", "hi", "--batch-size", "0"], ["--batch-size", ">= 1"]),
    (["generate", "hi", "--draft", "ngram", "--gamma", "0"], ["--gamma", ">= 1"]),
    (["generate", "hi", "--model", "{ctx16}/../no_such_model"], ["not found", "no_such_model"]),
    (["generate", "hi", "--model", "{missing_tensor}"], ["missing tensor", "layers.0.wv"]),
    (["generate", "hi", "--model", "{wrong_shape}"], ["layers.1.w_down", "shape"]),
    (["generate", "hi", "--model", "{pickle}"], ["pickle", "pytorch_model.bin", "safetensors"]),
    (["generate", "hi", "--model", "{gpt2}"], ["gpt2", "not supported"]),
    (["generate", "hi", "--model", "{yarn}"], ["yarn", "not supported"]),
    (["generate", "hi", "--model", "{gelu}"], ["gelu", "not supported"]),
    (["generate", "--prompts", "{ctx16}/none.jsonl"], ["prompts file not found"]),
    (["generate", "--prompts", "{bad_jsonl}"], ["bad.jsonl:2", "not valid JSON"]),
    (["generate", "--prompts", "{no_field_jsonl}"], ["nofield.jsonl:1", "'prompt'", "'turns'"]),
    (["generate"], ["no prompt given"]),
]


def error_lines(err: str) -> list[str]:
    """The one ``specjax: error:`` line of stderr; any other line must be a progress line of a
    phase that ran before the error (``specjax: loading … 0.2 s``), or the failing phase's own
    line when it ran long enough to be shown (``… 0.4 s (failed)``, the line just before the error)."""
    lines = err.strip().splitlines()
    errs = [ln for ln in lines if ln.startswith("specjax: error: ")]
    assert len(errs) == 1 and lines[-1] == errs[0], err
    assert all(ln.startswith("specjax: ") and " … " in ln and ln.endswith(" s") or ln.startswith("specjax: generating")
               or (k == len(lines) - 2 and " … " in ln and ln.endswith(" s (failed)"))
               for k, ln in enumerate(lines[:-1])), err  # completed phases (a phase that fails at once prints nothing)
    return errs


@pytest.mark.parametrize("argv, words", ERROR_CASES, ids=[f"{i}-{c[1][0]}" for i, c in enumerate(ERROR_CASES)])
def test_cli_errors_are_one_line_exit_2(ckpts, capsys, argv, words):
    argv = [a.format(**ckpts) for a in argv]
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert out == ""
    assert "Traceback" not in err
    lines = error_lines(err)
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_cli_tiny_model_runs(ckpts, capsys):
    """A good run of the same tiny checkpoint (so the errors above are about the input):
    the prompt that fits is clipped to the context."""
    rc = cli.main(["generate", " ".join(f"w{i}" for i in range(3, 17)), "--model", ckpts["ctx16"],
                   "--max-new-tokens", "5", "--ignore-eos", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rec = json.loads(out)
    assert rec["stats"]["new_tokens"] == len(rec["tokens"]) == 2  # 14-token prompt, 16-token context


def _run_cli(*args):
    env = dict(os.environ, SPECJAX_NO_CACHE="1", JAX_PLATFORMS="cpu")
    env.pop("SPECJAX_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "specjax.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_subprocess_errors(tmp_path):
    r = _run_cli("generate", "hello", "--top-p", "1.5")
    assert r.returncode == 2 and r.stdout == ""
    assert "Traceback" not in r.stderr
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("specjax")]
    assert errs == ["specjax: error: --top-p must be a finite number in (0, 1] (1 = off), got 1.5"], r.stderr
    r = _run_cli("generate", "hello", "--model", str(tmp_path / "absent"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("specjax")]
    assert len(errs) == 1 and "model path not found" in errs[0] and "absent" in errs[0], r.stderr


def test_generate_json_real_model(default_model, tmp_path, capsys):
    """One invocation: a positional prompt, a Spec-Bench ``turns`` line and a ``prompt`` line,
    ``--chat --json``; one JSON object per prompt per line."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Name a fruit.", "Now name another."]})
        + "\n\n" + json.dumps({"prompt": "What is the capital of France?"}) + "\n"
    )
    max_new = 8
    rc = cli.main(["generate", "Give me three tips for sleeping better at night.", "--prompts", str(prompts),
                   "--chat", "--json", "--max-new-tokens", str(max_new)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 3, out
    recs = [json.loads(ln) for ln in lines]
    assert [r["question_id"] for r in recs] == [0, 81, 1]
    tok = default_model.tokenizer
    for r in recs:
        assert set(r) >= {"text", "tokens", "stats"}
        st = r["stats"]
        for k in ("new_tokens", "prefill_s", "decode_s", "tokens_per_s", "compile_s"):
            assert isinstance(st[k], (int, float)) and st[k] >= 0, (k, st)
        assert 1 <= st["new_tokens"] == len(r["tokens"]) <= max_new
        assert r["text"] == tok.decode(r["tokens"])
        assert st["decode_s"] > 0 and abs(st["tokens_per_s"] - st["new_tokens"] / st["decode_s"]) < 1e-6 * st["tokens_per_s"] + 1e-9
    assert recs[0]["stats"]["compile_s"] > 0
    assert recs[1]["stats"]["compile_s"] == 0 and recs[2]["stats"]["compile_s"] == 0  # same bucket: no recompile
    # the output is the model's greedy continuation of the chat-templated prompt
    want = specjax.generate_text(default_model, ["What is the capital of France?"], chat=True, max_new_tokens=max_new)
    assert recs[2]["tokens"] == want[0]["tokens"]
    assert "Paris" in recs[2]["text"]
