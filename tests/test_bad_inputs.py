"""Issue 15: every bad input is one line ``specjax: error: …`` (naming the problem, the file
and line where there is one, and the fix), exit status 2, no traceback — and it is found
before anything expensive: where the input can be checked up front the model loader is
replaced by one that fails the test if it is called."""

from __future__ import annotations

import re
import json
import sys
import os
import pickle

import pytest
from conftest import FakeStdin, tiny_model

import specjax
from specjax import api, cli
from specjax.cli import common
from specjax.io import loading
from specjax.io.loading import save_model


class Loaded(Exception):
    """The model loader was reached (validation passed)."""


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    monkeypatch.setenv("SPECJAX_NO_PROGRESS", "1")
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)


@pytest.mark.parametrize("data, words", [(b"", "no prompt given"), (b"  \n", "no prompt given"),
                                         (b"caf\xe9", "standard input is not valid UTF-8")])
def test_bad_stdin_prompt(no_load, capsys, monkeypatch, data, words):
    """Piped standard input (no PROMPT, or PROMPT '-') that is empty or not UTF-8."""
    for argv in (["generate"], ["generate", "-"]):
        monkeypatch.setattr(sys, "stdin", FakeStdin(data, tty=False))
        one_line_error(capsys, cli.main(argv), [words])


@pytest.fixture
def no_load(monkeypatch):
    """Make any model load fail loudly: the input must be rejected before it."""
    def boom(*a, **k):
        raise Loaded(f"load_model{a}")

    monkeypatch.setattr(loading, "load_model", boom)
    monkeypatch.setattr(api, "load_model", boom)


@pytest.fixture(scope="module")
def f(tmp_path_factory):
    """Bad input files, by name; ``{name}`` in an argv template is replaced by its path."""
    root = tmp_path_factory.mktemp("bad")

    def w(name, data):
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(data, bytes) else p.write_text)(data)
        return str(p)

    m = tiny_model(seed=3)
    good = save_model(m, str(root / "good"))
    out = {"root": str(root), "good": good}
    out["ok_jsonl"] = w("ok.jsonl", '{"prompt": "hello there"}\n')
    out["latin1"] = w("latin1.jsonl", b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    out["empty"] = w("empty.jsonl", "\n\n")
    out["zero_bytes"] = w("zero.jsonl", "")
    out["notobj"] = w("notobj.jsonl", '{"prompt": "ok"}\n[1, 2]\n')
    out["prompts_dir"] = str(root)
    out["a_file"] = w("a_file.txt", "x")
    # checkpoints
    trunc = root / "trunc"
    trunc.mkdir()
    for name in os.listdir(good):
        data = open(os.path.join(good, name), "rb").read()
        (trunc / name).write_bytes(data[: len(data) // 2] if name == "model.safetensors" else data)
    out["trunc"] = str(trunc)
    for name, text in {"badjson": '{"model_type": "llama",\n  "vocab_size": 128,,\n}',
                       "nokeys": '{"model_type": "llama"}', "listcfg": "[1, 2]"}.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(text)
        out[name] = str(d)
    (root / "neg_temp.toml").write_text("temperature = -2\n")
    out["neg_temp_toml"] = str(root / "neg_temp.toml")
    (root / "emptydir").mkdir()
    out["emptydir"] = str(root / "emptydir")
    with open(root / "weights.bin", "wb") as fh:
        pickle.dump({"a": 1}, fh)
    out["bin"] = str(root / "weights.bin")
    out["small_vocab"] = save_model(tiny_model(seed=4, vocab_size=64), str(root / "small_vocab"))
    # pair configs
    out["bad_toml"] = w("bad.toml", 'gamma = 4\ntemperature = \n')
    out["latin1_toml"] = w("latin1.toml", b'model = "x"\n# caf\xe9\n')
    for key, val in {"gamma": '"x"', "temperature": '"hot"', "max_new_tokens": "1.5", "chat": '"yes"',
                     "draft": "5", "top_k": "2.5", "dtype": '"fp8"'}.items():
        out[f"toml_{key}"] = w(f"type_{key}.toml", f"{key} = {val}\n")
    out["split"] = w("split.json", json.dumps({"train": [0], "eval": [0]}))
    out["trunc_gguf"] = w("trunc.gguf", open(loading.default_model_path(), "rb").read(100_000))
    # a tiny GGUF, cut in its tensor data (its header whole) and in its header
    from test_weight_table import write_gguf

    tiny = open(write_gguf(m, str(root / "tiny.gguf"), "llama"), "rb").read()
    out["tiny_gguf"], out["tiny_gguf_size"] = str(root / "tiny.gguf"), str(len(tiny))
    out["cut_data_gguf"] = w("cut_data.gguf", tiny[:-100])
    out["cut_head_gguf"] = w("cut_head.gguf", tiny[:64])
    # a .bin that is no pickle: random bytes, text
    out["rand_bin"] = w("random.bin", bytes(range(1, 256)) * 40)
    out["text_bin"] = w("text.bin", "these are not weights\n")
    # drafter directories broken in their drafter.json or their weights (checked before the target loads)
    weights = open(os.path.join(good, "model.safetensors"), "rb").read()
    w("bad_drafter_json/drafter.json", '{"config": {"sub_vocab": 8,,\n  "num_heads": 2}}')
    w("bad_drafter_json/model.safetensors", weights)
    out["bad_drafter_json"] = str(root / "bad_drafter_json")
    w("trunc_drafter/drafter.json", '{"config": {}}')
    w("trunc_drafter/model.safetensors", weights[: len(weights) - 100])
    out["trunc_drafter"] = str(root / "trunc_drafter")
    w("no_weights_drafter/drafter.json", '{"config": {}}')  # its model.safetensors not copied
    out["no_weights_drafter"] = str(root / "no_weights_drafter")
    return out


def one_line_error(capsys, rc, words):
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specjax: error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


G = ["generate", "hi"]
# (argv template, words the one line must contain) — all rejected before any model load
EARLY = [
    (["generate", "caf\udce9"], ["prompt 0", "not valid UTF-8"]),
    (["generate", "--prompts", "{latin1}"], ["latin1.jsonl:2", "not valid UTF-8", "save the file as UTF-8"]),
    (["generate", "--prompts", "{prompts_dir}"], ["is a directory", "JSONL file"]),
    (["generate", "--prompts", "{empty}"], ["empty.jsonl", "no prompts", "it has only blank lines"]),
    (["generate", "--prompts", "{zero_bytes}"], ["zero.jsonl", "no prompts", "it is empty"]),
    (["generate", "--prompts", "{notobj}"], ["notobj.jsonl:2", "JSON object"]),
    ([*G, "--config", "{bad_toml}"], ["bad.toml", "not valid TOML", "line 2"]),
    ([*G, "--config", "{latin1_toml}"], ["latin1.toml:2", "UTF-8"]),
    ([*G, "--config", "{toml_gamma}"], ["type_gamma.toml", "'gamma'", "integer >= 1", "'x'"]),
    ([*G, "--config", "{toml_temperature}"], ["type_temperature.toml", "'temperature'", "a number", "'hot'"]),
    ([*G, "--config", "{toml_max_new_tokens}"], ["type_max_new_tokens.toml", "'max_new_tokens'", "an integer"]),
    ([*G, "--config", "{toml_chat}"], ["type_chat.toml", "'chat'", "true or false"]),
    ([*G, "--config", "{toml_draft}"], ["type_draft.toml", "'draft'", "a string"]),
    ([*G, "--config", "{toml_top_k}"], ["type_top_k.toml", "'top_k'", "integer"]),
    ([*G, "--config", "{toml_dtype}"], ["type_dtype.toml", "'dtype'", "float32"]),
    ([*G, "--config", "no_such_pair"], ["'no_such_pair' not found", "shipped configs"]),
    ([*G, "--config", "{root}"], ["is a directory", ".toml"]),
    ([*G, "--temperature", "nan"], ["--temperature", "finite"]),
    ([*G, "--temperature", "inf"], ["--temperature", "finite"]),
    ([*G, "--top-p", "2"], ["--top-p", "(0, 1]"]),
    ([*G, "--top-p", "nan"], ["--top-p", "finite"]),
    ([*G, "--top-k", "-1"], ["--top-k", ">= 0"]),
    ([*G, "--chat-template-kwargs", "{{enable_thinking: false}}"], ["--chat-template-kwargs", "not valid JSON"]),
    ([*G, "--chat-template-kwargs", "[1]"], ["--chat-template-kwargs", "JSON object"]),
    ([*G, "--no-chat", "--chat-template-kwargs", "{{}}"], ["--chat-template-kwargs", "drop --no-chat"]),
    ([*G, "--top-k", "abc"], ["specjax generate", "--top-k", "invalid int value", "--help"]),
    ([*G, "--dtype", "fp8"], ["--dtype", "invalid choice"]),
    ([*G, "--batch-size", "-3"], ["--batch-size", ">= 1"]),
    ([*G, "--seed", "-1"], ["--seed", "[0, 2**64)"]),
    ([*G, "--seed", str(2**64)], ["--seed", "[0, 2**64)"]),
    ([*G, "--max-new-tokens", "-5"], ["--max-new-tokens", ">= 1"]),
    ([*G, "--draft", "foo"], ["unknown --draft value 'foo'", "ngram"]),
    ([*G, "--draft", "ngram:x"], ["n-gram size", "ngram:3"]),
    ([*G, "--draft", "ngram:0"], ["n-gram size"]),
    ([*G, "--draft", "nosuch.gguf"], ["nosuch.gguf", "no such file"]),
    ([*G, "--draft", "./nosuch_dir"], ["nosuch_dir", "no such file"]),
    ([*G, "--draft", "ngram", "--gamma", "x"], ["--gamma", "integer"]),
    ([*G, "--draft", "ngram", "--gamma", "-2"], ["--gamma", ">= 1"]),
    ([*G, "--gamma", "auto"], ["--gamma auto needs a drafter", "--draft"]),
    ([*G, "--mesh", "garbage"], ["--mesh", "data=D,model=M"]),
    ([*G, "--mesh", "data=0"], ["--mesh"]),
    (["generate"], ["no prompt given"]),
    (["nosuchcommand"], ["invalid choice"]),
    (["generate", "Write", "a", "haiku"], ["unrecognized arguments: a haiku", "needs quotes", "specjax generate --help"]),
    (["generate", "hi", "--seed", "abc"], ["argument --seed", "invalid int value"]),
    ([*G, "--draft", "{emptydir}"], ["--draft", "no config.json", "drafter.json"]),
    ([*G, "--draft", "{ok_jsonl}"], ["--draft", "not a .gguf file"]),
    ([*G, "--config", "{neg_temp_toml}"], ["neg_temp.toml", "temperature", ">= 0"]),
    # bench: all checked before the benchmark (and the model load)
    (["bench", "--prompts", "{ok_jsonl}", "--out", "{a_file}/results.json"], ["--out", "a_file.txt", "not a directory"]),
    (["bench", "--prompts", "{ok_jsonl}", "--out", "{root}"], ["--out", "is a directory", "give a file name"]),
    (["bench", "--prompts", "{ok_jsonl}", "--categories", "nope"], ["--categories", "unknown", "'nope'"]),
    (["bench", "--prompts", "{ok_jsonl}", "--split", "{split}:nopart"], ["no list 'nopart'", "'eval'", "FILE:PART", "split.json:eval"]),
    (["bench", "--prompts", "{ok_jsonl}", "--split", "{ok_jsonl}"], ["--split", "not a split file", "question-id lists"]),
    (["bench", "--prompts", "{ok_jsonl}", "--limit", "0"], ["--limit", ">= 1"]),
    (["bench", "--prompts", "{ok_jsonl}", "--draft", "ngram", "foo"], ["unknown --draft value 'foo'"]),
    (["bench", "--prompts", "{ok_jsonl}", "--gamma", "3", "x"], ["--gamma", "integer"]),
    (["bench", "--prompts", "{ok_jsonl}", "--warmup", "-1"], ["--warmup", ">= 0"]),
    (["bench", "--prompts", "{ok_jsonl}", "--seed", "-4"], ["--seed"]),
    (["bench", "--prompts", "{latin1}"], ["latin1.jsonl:2", "UTF-8"]),
    # analyze
    (["analyze", "--alpha", "1.5", "--c", "0.1"], ["--alpha", "[0, 1]"]),
    (["analyze", "--alpha", "0.5", "--c", "-1"], ["--c", ">= 0"]),
    (["analyze", "--alpha", "0.5"], ["--alpha needs --c"]),
    (["analyze", "--alpha", "0.5", "--c", "0.1", "--mesh", "data=1,model=1"], ["unrecognized arguments: --mesh"]),
    (["analyze", "--prompt", "hi"], ["needs one drafter", "--draft"]),
    (["analyze", "--prompt", "hi", "--gamma", "3"], ["needs one drafter"]),
    (["analyze", "--prompt", "hi", "--draft", "ngram", "--top-p", "5"], ["--top-p"]),
    (["analyze", "--prompt", "hi", "--draft", "ngram", "--plot", "{a_file}/plot.png"], ["--plot", "not a directory"]),
    # distill: checked before anything is written or loaded
    (["distill", "--out", "{root}/d_steps", "--prompts", "{ok_jsonl}", "--steps", "-5"], ["--steps", ">= 0", "-5"]),
    (["distill", "--out", "{root}/d_ck", "--prompts", "{ok_jsonl}", "--checkpoint-every", "0"], ["--checkpoint-every"]),
    (["distill", "--out", "{root}/d_bs", "--prompts", "{ok_jsonl}", "--batch-size", "0"], ["--batch-size"]),
    (["distill", "--out", "{root}/d_lr", "--prompts", "{ok_jsonl}", "--lr", "0"], ["--lr", "> 0"]),
    (["distill", "--out", "{root}/d_lr2", "--prompts", "{ok_jsonl}", "--lr", "nan"], ["--lr", "finite"]),
    (["distill", "--out", "{root}/d_win", "--prompts", "{ok_jsonl}", "--window", "1"], ["--window", ">= 2"]),
    (["distill", "--out", "{root}/d_topk", "--prompts", "{ok_jsonl}", "--topk", "0"], ["--topk"]),
    (["distill", "--out", "{root}/d_seed", "--prompts", "{ok_jsonl}", "--seed", "-1"], ["--seed"]),
    (["distill", "--out", "{root}/d_temp", "--prompts", "{ok_jsonl}", "--data-temperature", "-1"],
     ["--data-temperature"]),
    (["distill", "--out", "{root}/d_onp", "--prompts", "{ok_jsonl}", "--data", "both"], ["--onpolicy-after"]),
    (["distill", "--out", "{root}/d_nop"], ["--prompts FILE is required"]),
    (["distill", "--out", "{root}/d_lat", "--prompts", "{latin1}"], ["latin1.jsonl:2", "UTF-8"]),
    (["distill", "--out", "{root}/d_dir", "--prompts", "{prompts_dir}"], ["is a directory"]),
    (["distill", "--out", "{root}/d_split", "--prompts", "{ok_jsonl}", "--split", "{ok_jsonl}"],
     ["ok.jsonl", "'train'"]),
    (["distill", "--out", "{root}/d_init", "--prompts", "{ok_jsonl}", "--init-from", "{root}/nope"], ["--init-from"]),
    (["distill", "--out", "{a_file}", "--prompts", "{ok_jsonl}"], ["--out", "is a file"]),
    (["distill", "--out", "{a_file}/run", "--prompts", "{ok_jsonl}"], ["--out", "not a directory"]),
    (["distill", "--out", "{root}/d_bg", "--bench", "default", "--prompts", "{ok_jsonl}", "--split", "{split}",
      "--bench-gammas", "2,x"], ["--bench-gammas"]),
    (["distill", "--out", "{root}/d_bn", "--bench", "{root}/nope", "--prompts", "{ok_jsonl}", "--split", "{split}"],
     ["--bench", "no such drafter directory"]),
    # upper bounds of the decode shapes (specjax.core.drafting.MAX_*), before any load
    ([*G, "--draft", "ngram", "--gamma", "100000"], ["--gamma 100000", "limit of 64", "--gamma 64 or less"]),
    ([*G, "--draft", "ngram", "--gamma", "65", "--max-new-tokens", "200"], ["--gamma 65", "limit of 64"]),
    ([*G, "--draft", "ngram:100000"], ["ngram:100000", "<= 16", "ngram:16 or less"]),
    ([*G, "--draft", "ngram", "--tree-nodes", "2000", "--tree-depth", "50", "--tree-topk", "8"],
     ["--tree-nodes", "<= 512", "got 2000", "at most 512"]),
    ([*G, "--draft", "ngram", "--tree-nodes", "100", "--tree-depth", "65", "--tree-topk", "2"],
     ["--tree-depth", "<= 64", "at most 64"]),
    ([*G, "--draft", "ngram", "--tree-nodes", "100", "--tree-depth", "4", "--tree-topk", "33"],
     ["--tree-topk", "<= 32", "at most 32"]),
    (["bench", "--prompts", "{ok_jsonl}", "--gamma", "2", "1000"], ["--gamma 1000", "limit of 64"]),
    (["analyze", "--prompt", "hi", "--draft", "ngram", "--gamma", "100000"], ["--gamma 100000", "limit of 64"]),
    (["analyze", "--prompt", "hi", "--draft", "ngram", "--gamma-max", "65"], ["--gamma-max", "[1, 64]", "65"]),
    # --logprobs above the vocabulary: read from the GGUF metadata / config.json, not the weights
    ([*G, "--logprobs", "100000"], ["--logprobs 100000", "49152 tokens", "--logprobs 49152 or less"]),
    ([*G, "--model", "{good}", "--logprobs", "129"], ["--logprobs 129", "128 tokens", "--logprobs 128 or less"]),
    # a drafter directory with a broken drafter.json or truncated weights, before the target loads
    ([*G, "--draft", "{bad_drafter_json}"], ["--draft", "bad_drafter_json/drafter.json:1", "not valid JSON",
                                             "re-download or re-copy the drafter"]),
    ([*G, "--draft", "{trunc_drafter}"], ["--draft", "trunc_drafter/model.safetensors", "truncated or corrupt",
                                          "re-download"]),
    ([*G, "--draft", "{trunc}"], ["--draft", "trunc/model.safetensors", "truncated or corrupt"]),
    # --resume without a run to resume
    (["distill", "--out", "{root}/d_no_run", "--resume"], ["--resume", "no run to resume", "d_no_run",
                                                            "does not exist", "drop --resume"]),
    (["distill", "--out", "{emptydir}", "--prompts", "{ok_jsonl}", "--resume"],
     ["no run to resume", "emptydir", "it is empty", "drop --resume"]),
    # --plot into a directory that does not exist (it is not created)
    (["analyze", "--alpha", "0.5", "--c", "0.1", "--plot", "{root}/no_plot_dir/out.png"],
     ["--plot", "no_plot_dir", "does not exist", "mkdir -p"]),
    # a truncated GGUF, from its header before anything is read: cut in the tensor data, in the header
    ([*G, "--model", "{cut_data_gguf}"], ["cut_data.gguf is truncated", "bytes, its header needs {tiny_gguf_size}",
                                          "re-download or re-copy it"]),
    ([*G, "--model", "{cut_head_gguf}"], ["cut_head.gguf is truncated: 64 bytes", "ends inside its header",
                                          "re-download or re-copy it"]),
    ([*G, "--model", "{trunc_gguf}"], ["trunc.gguf is truncated: 100000 bytes", "re-download or re-copy it"]),
    # a hub id not in the local Hugging Face cache: nothing downloads
    ([*G, "--model", "nobody-xyz/not-cached-model"], ["'nobody-xyz/not-cached-model' is not in the local Hugging Face "
                                                      "cache", "huggingface-cli download nobody-xyz/not-cached-model"]),
    # a drafter directory without its weights, named before the target loads
    ([*G, "--draft", "{no_weights_drafter}"], ["--draft", "no_weights_drafter/model.safetensors is missing",
                                               "has drafter.json", "copy the whole drafter directory",
                                               "--export-only"]),
    # --init-from a drafter with truncated weights: the check --draft uses, before any data is generated
    (["distill", "--out", "{root}/d_init_trunc", "--prompts", "{ok_jsonl}", "--init-from", "{trunc_drafter}"],
     ["--init-from", "trunc_drafter/model.safetensors", "truncated or corrupt", "re-download"]),
    # bench --out into a directory that does not exist (refused as --plot; nothing is created)
    (["bench", "--prompts", "{ok_jsonl}", "--out", "{root}/no_out_dir/res.json"],
     ["--out", "no_out_dir", "does not exist", "mkdir -p"]),
    # a value starting with '-' taken for a flag by argparse: the hint, and what the flag says of the value
    (["plan", "--device-memory", "-5GiB"], ["argument --device-memory: expected one argument",
                                            "must be written --device-memory=-5GiB", "must be a positive size"]),
    # a prompts file '-': read by name, not from standard input
    ([*G[:1], "--prompts", "-"], ["--prompts -", "not from standard input", "--prompts /dev/stdin",
                                  "specjax generate -"]),
]


@pytest.mark.parametrize("argv, words", EARLY, ids=[f"{i}-{' '.join(c[0][:1] + c[0][2:4])}" for i, c in enumerate(EARLY)])
def test_bad_input_one_line_before_load(f, no_load, capsys, argv, words):
    rc = cli.main([a.format(**f) for a in argv])
    one_line_error(capsys, rc, [w.format(**f) for w in words])


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="needs a path nobody may create")
@pytest.mark.parametrize("cmd", ["bench", "distill"])
def test_unwritable_out_before_work(f, no_load, capsys, cmd):
    # bench's --out in /sys itself (a directory that is missing is refused as missing: bench makes none)
    argv = [cmd, "--prompts", f["ok_jsonl"], "--out", "/sys/specjax-test" + (".json" if cmd == "bench" else "/out")]
    line = one_line_error(capsys, cli.main(argv), ["--out", "/sys/specjax-test", "cannot write"])
    assert "permitted" in line or "denied" in line or "Read-only" in line
    assert not os.path.exists("/sys/specjax-test")


# rejected while loading (cheap tiny checkpoints): the file is named
AT_LOAD = [
    ([*G, "--model", "{trunc}"], ["trunc/model.safetensors", "truncated or corrupt", "re-download"]),
    ([*G, "--model", "{badjson}"], ["badjson/config.json:2", "not valid JSON"]),
    ([*G, "--model", "{nokeys}"], ["nokeys/config.json", "missing key"]),
    ([*G, "--model", "{listcfg}"], ["listcfg/config.json", "JSON object"]),
    ([*G, "--model", "{emptydir}"], ["emptydir", "no config.json"]),
    ([*G, "--model", "{bin}"], ["weights.bin", "pickle", "safetensors"]),
    ([*G, "--model", "{root}/missing/model"], ["model path not found"]),
    ([*G, "--model", "{good}", "--draft", "{small_vocab}"], ["64 tokens", "128", "no tokenizer"]),
]


@pytest.mark.parametrize("argv, words", AT_LOAD, ids=[f"{i}-{c[1][0][:20]}" for i, c in enumerate(AT_LOAD)])
def test_bad_checkpoint_one_line(f, capsys, argv, words):
    rc = cli.main([a.format(**f) for a in argv])
    one_line_error(capsys, rc, words)


def test_debug_reraises(f, monkeypatch):
    monkeypatch.setenv("SPECJAX_DEBUG", "1")
    with pytest.raises(ValueError, match="not valid UTF-8"):
        cli.main(["generate", "--prompts", f["latin1"]])


def test_bom_prompts_file_accepted(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9"}\n')
    assert specjax.read_prompts(str(p))[0]["prompt"] == "café"
    from specjax.train.records import read_records

    assert read_records(str(p))[0]["turns"] == ["café"]


def test_gamma_without_draft_is_a_note(f, no_load, capsys):
    with pytest.raises(Loaded):
        cli.main([*G, "--gamma", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specjax: note: --gamma 5 has no effect without a drafter"), err


def test_largest_seed_accepted(no_load, capsys):
    with pytest.raises(Loaded):
        cli.main([*G, "--seed", str(2**64 - 1)])
    from specjax.runtime.decoder import seed_key

    assert seed_key(2**64 - 1).shape == (2,) and (seed_key(5) == __import__("jax").random.PRNGKey(5)).all()


def test_max_new_tokens_cap_note(capsys):
    target = tiny_model(seed=1, max_position_embeddings=16)
    common.note_context_cap(10**9, target)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"specjax: note: --max-new-tokens 1000000000 is capped to 16 − the prompt length: the context "
                   f"of {target.name} holds 16 tokens"]
    common.note_context_cap(16, target)
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def ctx16(tmp_path_factory):
    """A tiny model with a word tokenizer (``w3 w4 …``) and a 16-token context, saved."""
    from test_cli import word_tokenizer

    m = tiny_model(seed=21, max_position_embeddings=16)
    return save_model(m.replace(tokenizer=word_tokenizer(m.config.vocab_size)),
                      str(tmp_path_factory.mktemp("ctx") / "ctx16"))


@pytest.mark.parametrize("max_new", ["1000000000", "100", "13"])
def test_max_new_tokens_cap_note_end_to_end(ctx16, capsys, max_new):
    """The cap is kept (the run succeeds) and said once, on stderr, before the output, with the
    prompt's length and the new tokens it leaves — also when --max-new-tokens alone fits the
    context (100 or 13 < 16 + a 4-token prompt), which used to be silent."""
    rc = cli.main(["generate", "w3 w4 w5 w6", "--model", ctx16, "--max-new-tokens", max_new, "--ignore-eos",
                   "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["stats"]["new_tokens"] == 12  # 16-token context − 4 prompt tokens
    notes = [ln for ln in err.splitlines() if ln.startswith("specjax: ")]
    assert notes == [f"specjax: note: --max-new-tokens {max_new} is capped to 12: the prompt has 4 tokens and the "
                     "context of ctx16 holds 16 tokens"], err


def test_prompt_cap_note_names_each_capped_prompt(capsys):
    target = tiny_model(seed=1, max_position_embeddings=16)
    common.note_prompt_caps(13, [4, 2, 10, 9, 8, 3], target)
    assert capsys.readouterr().err.strip().splitlines() == [
        f"specjax: note: --max-new-tokens 13 is capped for 4 of 6 prompts to the context minus the prompt: prompt 0 "
        f"(4 tokens) to 12, prompt 2 (10 tokens) to 6, prompt 3 (9 tokens) to 7 and 1 more (the context of "
        f"{target.name} holds 16 tokens)"]
    common.note_prompt_caps(12, [4, 3], target)  # fits: no note
    common.note_prompt_caps(12, [16, 3], target)  # a prompt that does not fit at all: the decoder's error says it
    assert capsys.readouterr().err == ""


def test_distill_failed_run_does_not_block_rerun(f, no_load, capsys, tmp_path):
    out = str(tmp_path / "run")
    # without --prompts: nothing is written
    one_line_error(capsys, cli.main(["distill", "--out", out]), ["--prompts"])
    assert not os.path.exists(out)
    # a run stopped during the model load leaves only run.json: a rerun (with or without --resume) starts
    with pytest.raises(Loaded):
        cli.main(["distill", "--out", out, "--prompts", f["ok_jsonl"], "--steps", "3"])
    assert os.listdir(out) == ["run.json"]
    with pytest.raises(Loaded):
        cli.main(["distill", "--out", out, "--prompts", f["ok_jsonl"], "--steps", "4"])
    assert json.load(open(os.path.join(out, "run.json")))["steps"] == 4
    with pytest.raises(Loaded):
        cli.main(["distill", "--out", out, "--prompts", f["ok_jsonl"], "--resume"])


def test_analyze_unbounded_optimum(capsys):
    assert cli.main(["analyze", "--alpha", "1", "--c", "0.05", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["optimal_gamma"] is None and rep["optimal_speedup"] is None
    assert "unbounded" in rep["optimal_gamma_reason"] and "1/c = 20.000" in rep["optimal_gamma_reason"]
    assert cli.main(["analyze", "--c", "0", "--alpha", "0.8"]) == 0
    text = capsys.readouterr().out
    assert "optimal γ: unbounded: c = 0" in text and "= 64" not in text
    assert cli.main(["analyze", "--alpha", "0.8", "--c", "0.05", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["optimal_gamma"] == 8 and rep["optimal_gamma_reason"] is None


def test_api_string_instead_of_a_list_and_cli_version(capsys):
    """``generate_text(target, "Hi")`` must not decode "H" and "i" as two prompts (nor split a stop
    string into characters): one ValueError that shows the fix; ``specjax --version``."""
    import specjax
    from specjax.cli import main

    with pytest.raises(ValueError, match=r"one string; pass \['Hi'\]"):
        specjax.generate_text(None, "Hi")
    with pytest.raises(ValueError, match="stop must be a list"):
        specjax.generate_text(None, ["Hi"], stop="\n")
    try:
        rc = main(["--version"])
    except SystemExit as e:  # argparse's version action exits
        rc = e.code
    assert rc in (0, None) and capsys.readouterr().out.strip() == f"specjax {specjax.__version__}"


# --------------------------------------------------------------------------- bounds, caps, pipes, caches
def test_gamma_above_max_new_tokens_is_capped_with_a_note(no_load, capsys):
    """``--gamma 1000 --max-new-tokens 16`` runs with γ 16 and says so (one note, before the load);
    the bound of 64 applies to the γ that runs."""
    with pytest.raises(Loaded):
        cli.main([*G, "--draft", "ngram", "--gamma", "1000", "--max-new-tokens", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specjax: note: --gamma 1000 is more than --max-new-tokens 16: speculating with γ = 16 (a round "
                   "never drafts more than the tokens still to generate)"], err
    args, _ = cli.build_parser().parse_known_args([*G, "--draft", "ngram", "--gamma", "1000", "--max-new-tokens", "16"])
    assert common.resolve(args)["gamma"] == 16
    args, _ = cli.build_parser().parse_known_args([*G, "--draft", "ngram", "--gamma", "8", "--max-new-tokens", "16"])
    assert common.resolve(args)["gamma"] == "8" and capsys.readouterr().err.count("note") == 1  # the first resolve


def test_api_bounds_raise_value_error():
    """The Python API refuses the same bounds (``specjax.core.drafting.MAX_*``) with ValueError."""
    from test_cli import word_tokenizer

    from specjax.core.drafting import MAX_GAMMA, MAX_NGRAM, MAX_TREE_DEPTH, MAX_TREE_NODES, MAX_TREE_TOPK, TreeShape
    from specjax.drafters.ngram import NgramDrafter
    from specjax.runtime.decoder import Decoder

    assert (MAX_GAMMA, MAX_NGRAM, MAX_TREE_NODES, MAX_TREE_DEPTH, MAX_TREE_TOPK) == (64, 16, 512, 64, 32)
    m = tiny_model(seed=3)
    m = m.replace(tokenizer=word_tokenizer(m.config.vocab_size))
    with pytest.raises(ValueError, match="must be <= 64"):
        Decoder(m, NgramDrafter(3), gamma=65)
    with pytest.raises(ValueError, match="must be <= 64"):
        specjax.generate_text(m, ["w3 w4"], drafter=NgramDrafter(3), gamma=100000)
    for bad in ("x", None, True, float("nan"), 2.5, 0):  # "x": was "invalid literal for int()"
        with pytest.raises(ValueError, match=r"gamma \(num_draft_tokens\) must be an integer >= 1"):
            Decoder(m, NgramDrafter(3), gamma=bad)
    with pytest.raises(ValueError, match="tree nodes must be <= 512"):
        specjax.generate_text(m, ["w3 w4"], drafter=NgramDrafter(3), tree_nodes=2000, tree_depth=50, tree_topk=8)
    with pytest.raises(ValueError, match="tree depth must be <= 64"):
        TreeShape(100, 65, 2)
    with pytest.raises(ValueError, match="tree topk must be <= 32"):
        TreeShape(100, 4, 33)
    with pytest.raises(ValueError, match="max_ngram must be <= 16"):
        NgramDrafter(max_ngram=17)
    with pytest.raises(ValueError, match="<= 16"):
        specjax.load_drafter("ngram:17", m)
    assert Decoder(m, NgramDrafter(16), gamma=64).gamma == 64 and TreeShape(512, 64, 32).nodes == 512


def test_api_prompts_are_checked_before_decoding():
    """A new user's pass (turn 15) found token ids outside the vocabulary decoded silently (999999 gave
    [0, 0, 0, 0], -1 generated text), a flat list of ids a raw TypeError and a huge max_new_tokens
    a numpy TypeError: each is one ValueError naming the problem, before anything is compiled."""
    from specjax.runtime.decoder import Decoder

    m = tiny_model(seed=3)
    d = Decoder(m)
    v = m.config.vocab_size
    for prompts, kw, words in [
        ([[v + 5]], {}, f"token id {v + 5}, outside the vocabulary [0, {v})"),
        ([[-1, 5]], {}, "token id -1, outside the vocabulary"),
        ([1, 2, 3], {}, "flat list of ints; wrap it"),
        ([[1.5, 2.0]], {}, "not integer token ids"),
        ([[1, 2]], {"max_new_tokens": 10 ** 20}, "max_new_tokens must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            d.generate(prompts, **kw)
    assert len(d.generate([[v - 1, 0]], max_new_tokens=2, eos_ids=[]).tokens[0]) == 2  # the edges are ids


def test_broken_pipe_stops_quietly(tmp_path):
    """``specjax generate … | head -c 10``: the reader goes away; generation stops at the next write,
    with no error line, no traceback and exit status 141 (as a Unix tool killed by SIGPIPE)."""
    import fcntl
    import signal
    import subprocess

    from test_cli import word_tokenizer

    m = tiny_model(seed=5, max_position_embeddings=2048)
    d = save_model(m.replace(tokenizer=word_tokenizer(m.config.vocab_size)), str(tmp_path / "long"))
    env = dict(os.environ, SPECJAX_NO_CACHE="1", SPECJAX_NO_PROGRESS="1", JAX_PLATFORMS="cpu")
    env.pop("SPECJAX_DEBUG", None)
    # ~1500 words (≈ 6 KB) through a pipe of 4 KB: the child must write after the reader has gone
    p = subprocess.Popen([sys.executable, "-m", "specjax.cli", "generate", "w3 w4 w5", "--model", d, "--no-chat",
                          "--ignore-eos", "--max-new-tokens", "1500"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    fcntl.fcntl(p.stdout.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
    first = p.stdout.read(10)
    p.stdout.close()
    _, err = p.communicate(timeout=600)
    err = err.decode()
    assert len(first) == 10
    assert p.returncode in (0, 141, -signal.SIGPIPE), (p.returncode, err)
    assert "Traceback" not in err and "specjax: error" not in err and "Exception ignored" not in err, err
    assert "BrokenPipe" not in err and "Broken pipe" not in err, err
    assert "tokens/s" not in err, err  # the run stopped: no per-prompt summary line


def _interrupted_run(tmp_path, progress: bool, ready):
    """``python -m specjax.cli generate`` on a tiny model with a long generation (``--ignore-eos``),
    stdout and stderr piped, SIGINT (not ignored in the child) sent once ``ready(stdout, stderr)``
    holds for the bytes read so far. Returns ``(returncode, stdout read before SIGINT, all stdout,
    all stderr)``."""
    import signal
    import subprocess

    from test_cli import word_tokenizer

    m = tiny_model(seed=5, max_position_embeddings=16384)
    d = save_model(m.replace(tokenizer=word_tokenizer(m.config.vocab_size)), str(tmp_path / "long"))
    env = dict(os.environ, SPECJAX_NO_CACHE="1", JAX_PLATFORMS="cpu")
    env.pop("SPECJAX_DEBUG", None)
    env.pop("SPECJAX_NO_PROGRESS", None)
    if not progress:
        env["SPECJAX_NO_PROGRESS"] = "1"
    # SIGINT not ignored in the child (as it is in a background job): a handler here becomes SIG_DFL at exec
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([sys.executable, "-m", "specjax.cli", "generate", "w3 w4 w5", "--model", d, "--no-chat",
                              "--ignore-eos", "--max-new-tokens", "16000"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        import select
        import time

        out, err, end = b"", b"", time.time() + 300
        while not ready(out, err):
            fds, _, _ = select.select([p.stdout, p.stderr], [], [], max(0.0, end - time.time()))
            assert fds, f"timed out; stdout {out[-300:]!r}, stderr {err[-500:]!r}"
            for fh in fds:
                chunk = os.read(fh.fileno(), 1 << 16)
                assert chunk, f"{'stdout' if fh is p.stdout else 'stderr'} closed; stderr {err[-500:]!r}"
                if fh is p.stdout:
                    out += chunk
                else:
                    err += chunk
        p.send_signal(signal.SIGINT)
        rest_out, rest_err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, out + rest_out, (err + rest_err).decode()


def test_ctrl_c_while_streaming_keeps_the_text_and_exits_130(tmp_path):
    """Ctrl+C once text has streamed: "specjax: interrupted", exit status 130 (not a SIGSEGV at the
    interpreter's shutdown with XLA threads running, issue of turn 16), the streamed text kept."""
    rc, first, out, err = _interrupted_run(tmp_path, progress=False, ready=lambda out, err: len(out) > 0)
    assert rc == 130, (rc, err[-2000:])
    assert err.strip().splitlines()[-1] == "specjax: interrupted", err[-2000:]
    assert "Traceback" not in err and "Segmentation" not in err, err[-2000:]
    assert first.strip() and out.startswith(first) and first.split()[0].startswith(b"w"), (first[:100], out[:100])


def test_ctrl_c_while_compiling_exits_130(tmp_path):
    """Ctrl+C during the compile (its progress line open, XLA's compiler threads running): exit
    status 130 with "specjax: interrupted", not -11 (SIGSEGV) at shutdown."""
    rc, first, out, err = _interrupted_run(tmp_path, progress=True, ready=lambda out, err: b"specjax: compiling" in err)
    assert rc == 130, (rc, err[-2000:])
    assert err.rstrip().endswith("specjax: interrupted"), err[-2000:]
    assert "Traceback" not in err and "Segmentation" not in err, err[-2000:]


@pytest.mark.parametrize("case", ["parent_is_a_file", "path_is_a_file", "read_only_dir"])
def test_unusable_compile_cache_is_a_note(tmp_path, monkeypatch, capsys, case):
    """``SPECJAX_CACHE`` that cannot be written: one note naming the variable, the cache stays off
    (JAX's setting untouched), the run goes on."""
    import jax

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    if case == "read_only_dir":  # as root chmod does not stop writes: the write is refused as a read-only mount would
        path = str(tmp_path / "ro")

        def read_only(file, *a, **k):
            raise PermissionError(13, "Permission denied", file)

        monkeypatch.setattr(common, "open", read_only, raising=False)
    else:
        path = str(a_file / "sub") if case == "parent_is_a_file" else str(a_file)
    monkeypatch.setenv("SPECJAX_CACHE", path)
    before = jax.config.jax_compilation_cache_dir
    assert common.enable_compilation_cache() is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"specjax: note: the compilation cache {path} cannot be written"), err
    assert "SPECJAX_CACHE" in err[0] and "running without it" in err[0]
    assert jax.config.jax_compilation_cache_dir == before
    assert a_file.read_text() == "x"


def test_unusable_compile_cache_run_goes_on(ctx16, tmp_path):
    """End to end (a fresh process, the cache not turned off): ``SPECJAX_CACHE`` under a regular file
    generates, with one note and nothing from JAX on stderr."""
    import subprocess

    (tmp_path / "a_file").write_text("x")
    env = dict(os.environ, SPECJAX_NO_PROGRESS="1", JAX_PLATFORMS="cpu", SPECJAX_CACHE=str(tmp_path / "a_file" / "jax"))
    for k in ("SPECJAX_NO_CACHE", "SPECJAX_DEBUG"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "specjax.cli", "generate", "w3 w4", "--model", ctx16, "--no-chat",
                        "--max-new-tokens", "3", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) >= 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specjax: note: the compilation cache") \
        and "SPECJAX_CACHE" in lines[0], r.stderr


def test_cache_write_failures_during_a_run_are_silent(tmp_path):
    """A cache directory that breaks after it was enabled (here: replaced by a file) makes JAX warn
    "Error writing persistent compilation cache entry"; specjax silences that (the control, after
    the filters are reset, shows the warning is real)."""
    import subprocess
    import textwrap

    code = textwrap.dedent(f"""
        import os, shutil, sys, warnings
        import jax, jax.numpy as jnp
        from specjax.cli.common import enable_compilation_cache
        d = {str(tmp_path / "cache")!r}
        assert enable_compilation_cache(d)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()   # the cache is set up and written
        shutil.rmtree(d); open(d, "w").close()                       # ... then it breaks
        jax.jit(lambda x: x * 3)(jnp.ones(4)).block_until_ready()
        print("---control---", file=sys.stderr, flush=True)
        warnings.resetwarnings(); warnings.simplefilter("always")
        jax.jit(lambda x: x - 5)(jnp.ones(5)).block_until_ready()
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    before, _, after = r.stderr.partition("---control---")
    assert before.strip() == "", before
    assert "Error writing persistent compilation cache entry" in after, after


def test_acceptance_rate_is_null_without_checked_drafts(ctx16, capsys):
    """``--max-new-tokens 1`` with a drafter: the token comes from the prefill, no draft is checked,
    and ``acceptance_rate`` is null (no data), not 0.0."""
    from specjax.runtime.stats import RunStats

    rc = cli.main(["generate", "w3 w4 w3", "--model", ctx16, "--draft", "ngram", "--max-new-tokens", "1", "--no-chat",
                   "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    st = json.loads(out)["stats"]
    assert st["new_tokens"] == 1 and st["checked_tokens"] == 0 and st["acceptance_rate"] is None, st
    assert RunStats.from_row(dict(st, draft_calls=2)).acceptance_rate is None
    assert RunStats.from_row({"draft_calls": 1, "accepted_tokens": 1, "checked_tokens": 2}).acceptance_rate == 0.5


def test_plot_into_a_missing_directory_creates_nothing(f, capsys):
    where = os.path.join(f["root"], "no_plot_dir2", "deeper")
    one_line_error(capsys, cli.main(["analyze", "--alpha", "0.5", "--c", "0.1", "--plot", os.path.join(where, "p.png")]),
                   ["--plot", "does not exist"])
    assert not os.path.exists(os.path.join(f["root"], "no_plot_dir2"))


def test_api_text_prompts_and_chat_are_checked():
    """``chat="no"`` (truthy: it turned the template on) and ids where texts belong ("prompt 0 is
    empty" before) are one ValueError naming the fix (a new user's pass, turn 15)."""
    from test_cli import word_tokenizer

    m = tiny_model(seed=3)
    m = m.replace(tokenizer=word_tokenizer(m.config.vocab_size))
    with pytest.raises(ValueError, match="chat must be True or False, got 'no'"):
        specjax.generate_text(m, ["w3 w4"], chat="no")
    with pytest.raises(ValueError, match="prompt 0 is int, not text"):
        specjax.generate_text(m, [123])


def test_plot_never_overwrites_a_file_without_force(capsys, tmp_path):
    """``analyze --plot`` onto an existing file (a new user's JSON, turn 15: overwritten with a PNG)
    is refused in one line naming --force; with --force it is written."""
    mine = tmp_path / "existing.json"
    mine.write_text('{"mine": 1}')
    one_line_error(capsys, cli.main(["analyze", "--alpha", "0.7", "--c", "0.1", "--plot", str(mine)]),
                   ["--plot", "exists", "--force"])
    assert mine.read_text() == '{"mine": 1}'
    assert cli.main(["analyze", "--alpha", "0.7", "--c", "0.1", "--plot", str(mine), "--force"]) == 0
    assert mine.read_bytes()[:4] == b"\x89PNG"
    for extra in ([], ["--force"]):  # a directory: named as one, not sent to --force (turn 18's new-user pass)
        one_line_error(capsys, cli.main(["analyze", "--alpha", "0.7", "--c", "0.1", "--plot", str(tmp_path), *extra]),
                       ["--plot", "is a directory", "file name"])


def test_distill_resume_without_a_run_writes_nothing(f, no_load, capsys, tmp_path):
    out = tmp_path / "nothing_here"
    one_line_error(capsys, cli.main(["distill", "--out", str(out), "--prompts", f["ok_jsonl"], "--resume"]),
                   ["no run to resume", "drop --resume"])
    assert not out.exists()


def test_gamma_auto_that_does_not_pay_decodes_without_speculation(ctx16, capsys, monkeypatch):
    """``--gamma auto`` whose best γ is predicted slower than autoregressive decoding: no
    speculation (no draft calls), and the note says so."""
    from specjax.eval import measure

    rep = {"alpha": 0.1, "alpha_source": {"cached": False}, "c": [0.9, 0.9], "v": [1.1, 1.2],
           "costs_source": {"cached": True, "created": "2026-01-01"}, "predicted_speedup": 0.8}
    monkeypatch.setattr(measure, "recommend", lambda *a, **k: (2, rep))
    rc = cli.main(["generate", "w3 w4 w3 w4", "--model", ctx16, "--draft", "ngram", "--gamma", "auto",
                   "--max-new-tokens", "4", "--no-chat", "--json", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    notes = [ln for ln in err.splitlines() if ln.startswith("specjax: ")]
    assert len(notes) == 1 and "--gamma auto chose no speculation (autoregressive decoding)" in notes[0], err
    assert "not predicted to pay" in notes[0] and "best γ = 2" in notes[0] and "0.80×" in notes[0]
    st = json.loads(out)["stats"]
    assert st["draft_calls"] == 0 and st["acceptance_rate"] is None and st["new_tokens"] == 4, st


# --------------------------------------------------------------------------- a new user's pass (turn 16)
@pytest.mark.parametrize("name", ["rand_bin", "text_bin"])
def test_a_bin_that_is_no_pickle_is_not_called_one(f, no_load, capsys, name):
    """Only a file that is a pickle (protocol opcode 0x80, or torch's zip) is called one; random bytes
    or text named ``*.bin`` are "not a checkpoint format specjax reads" (before any load)."""
    line = one_line_error(capsys, cli.main([*G, "--model", f[name]]),
                          [os.path.basename(f[name]), "is not a checkpoint format specjax reads", "a .gguf file",
                           "model directory (config.json + model.safetensors)", "hub id"])
    assert "pickle" not in line
    one_line_error(capsys, cli.main([*G, "--model", f["bin"]]), ["weights.bin is a pickle file"])  # a real one


def test_plan_reads_a_gguf_shape(f, capsys):
    """``specjax plan --model X.gguf``: the shape from the GGUF's metadata (as the loader reads it;
    no weight), not the GGUF parsed as a config.json; a truncated one is named."""
    from specjax.eval.plan import model_shape

    name, cfg = model_shape(f["tiny_gguf"])
    want = tiny_model(seed=3).config
    assert name == "tiny.gguf" and [getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                                                              "num_kv_heads", "head_dim", "max_position_embeddings")] \
        == [128, 64, 2, 8, 2, 8, 512] == [want.vocab_size, want.hidden_size, want.num_layers, want.num_heads,
                                          want.num_kv_heads, want.head_dim, want.max_position_embeddings]
    one_line_error(capsys, cli.main(["plan", "--model", f["tiny_gguf"], "--device-memory", "1KiB"]),
                   ["tiny.gguf in bfloat16 at batch 1 × 512 tokens does not fit", "its weights alone take"])
    one_line_error(capsys, cli.main(["plan", "--model", f["cut_data_gguf"]]),
                   ["cut_data.gguf is truncated", "re-download or re-copy it"])


def test_bench_out_into_a_missing_directory_creates_nothing(f, capsys):
    where = os.path.join(f["root"], "no_bench_dir", "deeper")
    one_line_error(capsys, cli.main(["bench", "--prompts", f["ok_jsonl"], "--out", os.path.join(where, "r.json")]),
                   ["--out", "does not exist", "mkdir -p"])
    assert not os.path.exists(os.path.join(f["root"], "no_bench_dir"))


def test_cache_dir_that_is_a_file_is_one_note(f, tmp_path, monkeypatch, capsys):
    """``SPECJAX_CACHE_DIR`` pointing at a file: one note naming the variable and the fix (not "the
    cached conversion … was unreadable (NotADirectoryError)"); the model loads without the
    conversion cache, and nothing is written into or next to the file."""
    from specjax.core import paths

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(a_file))
    monkeypatch.delenv("SPECJAX_NO_CACHE", raising=False)
    paths.forget_refusals()
    for _ in range(2):  # said once per process
        model = loading.load_model(f["good"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"specjax: note: SPECJAX_CACHE_DIR={a_file} is a file, not a directory: running without specjax's "
                   "caches (converted weights, measurements: nothing is kept for the next run); point "
                   "SPECJAX_CACHE_DIR at a directory (or unset it)"], err
    assert model.config.vocab_size == 128 and a_file.read_text() == "x" and os.listdir(tmp_path) == ["a_file"]


def test_a_note_during_a_phase_line_starts_on_its_own_line(capsys):
    """A note written while a progress phase line waits for its time ends that line first; the
    phase then writes its whole line again (the note never lands mid-line)."""
    import time

    from specjax.runtime.progress import Progress, phase

    with phase(Progress(delay_s=0.01), "loading something"):
        time.sleep(0.2)  # the line "specjax: loading something … " is open
        common.note("in the middle")
        common.note("and another")
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[:3] == ["specjax: loading something … ", "specjax: note: in the middle", "specjax: note: and another"]
    assert len(lines) == 4 and re.fullmatch(r"specjax: loading something … \d+\.\d s", lines[3]), err


def test_api_sampling_rows_must_match_the_prompts():
    """``SamplingParams.create(3, …)`` for one prompt: a ValueError naming both sizes before anything
    is traced (JAX said "cond branches must have equal output types" after seconds of tracing)."""
    from specjax.runtime.decoder import Decoder

    d = Decoder(tiny_model(seed=3))
    with pytest.raises(ValueError, match=re.escape("sampling has 3 rows but 1 prompt is given; create it with one row "
                                                   "per prompt: SamplingParams.create(1, ...)")):
        d.generate([[1, 2, 3]], sampling=specjax.SamplingParams.create(3, temperature=0.7))
    with pytest.raises(ValueError, match="sampling must be a SamplingParams"):
        d.generate([[1, 2, 3]], sampling=specjax.Sampling(temperature=0.7))
    assert d.compiled == {}  # nothing was compiled


def test_serve_without_its_extra_names_both_installs(monkeypatch, capsys):
    from specjax.cli import serve

    monkeypatch.setattr(serve, "serve_extra_installed", lambda: False)
    one_line_error(capsys, cli.main(["serve"]), ['pip install -e ".[serve]" in a source checkout',
                                                 'pip install "specjax[serve]"'])


@pytest.mark.parametrize("after", [0.2, 1.0, 2.5])
def test_ctrl_c_while_importing_exits_130(tmp_path, after):
    """Ctrl+C in the first seconds of the `specjax` command (importing jax; turn 18's new-user pass:
    a traceback at 2 s, and at 1–3 s a KeyboardInterrupt swallowed by a JAX gc callback, the run going
    on to exit 0): "specjax: interrupted", exit status 130, no traceback."""
    import signal
    import subprocess
    import time

    script = tmp_path / "specjax"  # the console script's name: the handler is installed from the first import
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom specjax.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    env = dict(os.environ, SPECJAX_NO_CACHE="1", JAX_PLATFORMS="cpu", SPECJAX_NO_PROGRESS="1")
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([str(script), "generate", "--max-new-tokens", "4", "hi"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        time.sleep(after)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    err = err.decode()
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert err.rstrip().endswith("specjax: interrupted") and "Traceback" not in err, err[-2000:]
