"""``--max-model-len N`` (issue 29): the target's context capped at load (its config's
``max_position_embeddings``, ``load_model(max_model_len=)``), validated before any weight is read."""

from __future__ import annotations

import os

import pytest
from conftest import tiny_model

from specjax import api, cli
from specjax.cli import common
from specjax.io import loading
from specjax.io.loading import load_model, save_model
from specjax.runtime.decoder import Decoder


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    monkeypatch.setenv("SPECJAX_NO_PROGRESS", "1")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A saved tiny model (context 512) and a copy whose weights file is garbage."""
    path = save_model(tiny_model(), str(tmp_path_factory.mktemp("mml") / "tiny"))
    broken = str(tmp_path_factory.mktemp("mml") / "broken")
    os.makedirs(broken)
    with open(os.path.join(path, "config.json")) as f, open(os.path.join(broken, "config.json"), "w") as g:
        g.write(f.read())
    with open(os.path.join(broken, "model.safetensors"), "wb") as g:
        g.write(b"not a safetensors file")
    return path, broken


@pytest.mark.parametrize("n, words", [(1, "must be an integer >= 2"), (513, "more than the 512 tokens")])
def test_bad_max_model_len_is_one_error_before_the_weights(tiny_dir, n, words):
    _, broken = tiny_dir  # unreadable weights: the check must come first
    with pytest.raises(ValueError, match=words):
        load_model(broken, max_model_len=n)


@pytest.mark.parametrize("n, words", [("1", "--max-model-len must be an integer >= 2"),
                                      ("513", "--max-model-len 513 is more than the 512 tokens")])
@pytest.mark.parametrize("cmd", ["generate", "bench"])
def test_bad_max_model_len_flag_one_line_before_load(tiny_dir, monkeypatch, capsys, cmd, n, words):
    def boom(*a, **k):
        raise AssertionError("loaded a model")

    monkeypatch.setattr(loading, "load_model", boom)
    monkeypatch.setattr(api, "load_model", boom)
    argv = [cmd, "--model", tiny_dir[0], "--max-model-len", n] + (["--prompt", "hi"] if cmd == "bench" else ["hi"])
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("specjax: error: ") and words in err[0], err


def test_good_max_model_len_caps_the_context(tiny_dir):
    path, _ = tiny_dir
    model = load_model(path, max_model_len=64)
    assert model.config.max_position_embeddings == 64 and model.source_config.max_position_embeddings == 512
    assert Decoder(model, None, 1).context_limit() == 64
    full = load_model(path)
    assert full.source_config is None and Decoder(full, None, 1).context_limit() == 512
    s = {"model": path, "dtype": "float32", "draft": None, "draft_dtype": "float32", "max_new_tokens": 8,
         "max_model_len": 100}
    target, drafter = common.load_target_and_drafter(s)  # the CLI's load (generate, serve, analyze)
    assert drafter is None and common.context_limit(target) == 100
