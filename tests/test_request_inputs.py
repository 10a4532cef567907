"""Contradictions and empty values a new-user pass found (issue 50): each one line, exit 2, before
anything loads; and the quick start's first note is short and true."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr("specjax.io.loading.load_model", refuse)


@pytest.mark.parametrize("argv, words", [
    (["generate", "x", "--min-tokens", "50", "--max-new-tokens", "5"],
     "--min-tokens must be at most --max-new-tokens (5), got 50"),
    (["bench", "--prompt", "x", "--min-tokens", "9", "--max-new-tokens", "4"], "--min-tokens must be at most"),
    (["generate", "x", "--stop", ""], "--stop must be non-empty strings"),
    (["generate", "x", "--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    (["generate", "x", "--logprobs", "-1"], "--logprobs must be an integer >= 0"),
    (["serve", "--served-model-name", ""], "--served-model-name is empty"),
    (["serve", "--served-model-name", "  "], "--served-model-name is empty"),
])
def test_contradictions_are_one_line(argv, words, capsys, no_load):
    from specjax.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specjax: error: ") and words in err[0], err


def test_the_predicted_format_note_is_one_short_line():
    """The first stderr line of every quick start (``--dtype auto`` on the default model): the choice and
    why, without advice that would not change it (it was 420 characters)."""
    from specjax.cli.common import auto_dtype_line
    from specjax.eval.auto import PREDICTED_FORMATS

    for _, fmt, why in PREDICTED_FORMATS:
        line = auto_dtype_line(fmt, {"source": {"predicted": why}})
        assert line.startswith(f"--dtype auto chose {fmt}: ") and len(line) <= 160 and "bench" not in line, line
