"""A sampling setting is declared once (issue 27): adding a field to
:class:`specjax.core.sampling.Sampling` — here by monkeypatching the declaration, no other edit —
makes it a CLI flag of every command, a validated pair-config key, a per-row array of
``SamplingParams``, part of the ``--gamma auto`` measurement cache key and of the bench JSON."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from specjax.core import sampling as sampling_mod
from specjax.core.settings import SettingError, knob, knobs


@pytest.fixture
def new_field(monkeypatch):
    """``Sampling`` with one more declared field, ``foo_weight`` (a float in [0, 3], default 0)."""
    base = sampling_mod.Sampling
    new = dataclasses.make_dataclass(
        "Sampling", [("foo_weight", float, knob(0.0, kind=float, check=lambda v: 0 <= v <= 3,
                                                  expect="a number in [0, 3] (0 = off)", help="a new sampling knob"))],
        bases=(base,), frozen=True)
    monkeypatch.setattr(sampling_mod, "Sampling", new)
    return new


def test_the_field_reaches_the_cli(new_field, capsys):
    from specjax.cli import build_parser
    from specjax.cli.common import UsageError, resolve

    parser = build_parser()
    for cmd in (["generate", "x"], ["bench", "--prompt", "x"], ["analyze", "--model", "m", "--draft", "ngram",
                                                                  "--prompt", "x"]):
        args = parser.parse_args(cmd + ["--foo-weight", "1.5"])
        assert args.foo_weight == 1.5
    s = resolve(parser.parse_args(["generate", "x", "--foo-weight", "2.5"]))
    assert isinstance(s["sampling"], new_field) and s["sampling"].foo_weight == 2.5
    with pytest.raises(UsageError, match=r"--foo-weight must be a number in \[0, 3\]"):
        resolve(parser.parse_args(["generate", "x", "--foo-weight", "4"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    assert "--foo-weight" in capsys.readouterr().out


def test_the_field_reaches_the_pair_config(new_field, tmp_path):
    from specjax.api import load_pair_config

    good = tmp_path / "good.toml"
    good.write_text('foo_weight = 0.5\ntemperature = 0.7\n')
    assert load_pair_config(str(good))["foo_weight"] == 0.5
    bad = tmp_path / "bad.toml"
    bad.write_text('foo_weight = 7.0\n')
    with pytest.raises(ValueError, match=r"foo_weight.*must be a number in \[0, 3\]"):
        load_pair_config(str(bad))
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('foo_weight = "x"\n')
    with pytest.raises(ValueError, match="foo_weight"):
        load_pair_config(str(wrong))


def test_the_field_reaches_sampling_params_and_settings(new_field):
    from specjax.runtime.settings import DecodeSettings

    sp = sampling_mod.SamplingParams.create(3, foo_weight=[0.0, 1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(sp.foo_weight), [0.0, 1.0, 2.0])
    assert sp.foo_weight.dtype == np.float32
    sp = sampling_mod.SamplingParams.from_rows([new_field(foo_weight=1.25)] * 2)
    np.testing.assert_array_equal(np.asarray(sp.foo_weight), [1.25, 1.25])
    with pytest.raises(SettingError, match="foo_weight"):
        sampling_mod.SamplingParams.create(2, foo_weight=9.0)
    st = DecodeSettings.create(max_new_tokens=4, foo_weight=0.75)
    assert st.foo_weight == 0.75 and st.sampling.foo_weight == 0.75


def test_the_field_reaches_the_measurement_key_and_bench_json(new_field):
    from specjax.eval import bench, measure
    from specjax.runtime.settings import DecodeSettings

    a = DecodeSettings.create(foo_weight=0.0)
    b = DecodeSettings.create(foo_weight=1.0)
    assert measure.sampling_key(a)["foo_weight"] == 0.0
    assert measure.sampling_key(a) != measure.sampling_key(b)  # a new value is a new cache key
    run = SimpleNamespace(prompt_records=[], model_name="m", weight_bytes=1, parse_special=True, chat=True)
    cfg = bench._bench_config([], b, run, {}, started="t", total_s=0.0, model=None, drafts=[], gammas=[],
                              trees=[], dtypes=["float32"], draft_dtype="float32", chat=True, warmup=0)
    assert cfg["sampling"]["foo_weight"] == 1.0


def test_every_declared_field_is_a_flag_and_a_key():
    """Without monkeypatching: the shipped fields all reach the CLI and the config check."""
    from specjax.api import _config_types
    from specjax.cli import build_parser

    parser = build_parser()
    flags = {a.dest for a in parser._subparsers._group_actions[0].choices["generate"]._actions}
    for name, k, _ in knobs(sampling_mod.Sampling):
        assert name in _config_types()
        assert (name in flags) == k.flag, name


def test_draft_default_uses_the_shipped_pairs_method():
    """``--draft default`` decodes with the shipped pair's γ with or without ``--config``; a flag wins."""
    from specjax.api import load_pair_config
    from specjax.cli import build_parser
    from specjax.cli.common import SHIPPED_PAIR, resolve

    p = build_parser()
    shipped = load_pair_config(SHIPPED_PAIR)["gamma"]
    assert resolve(p.parse_args(["generate", "x", "--draft", "default"]))["gamma"] == shipped
    assert resolve(p.parse_args(["generate", "x", "--config", SHIPPED_PAIR]))["gamma"] == shipped
    assert resolve(p.parse_args(["generate", "x", "--draft", "default", "--gamma", "5"]))["gamma"] == "5"
    assert resolve(p.parse_args(["generate", "x", "--draft", "ngram"]))["gamma"] is None  # parse_gamma's 4


def test_one_chat_template_rule():
    from specjax.cli.common import chat_default

    with_template = SimpleNamespace(tokenizer=SimpleNamespace(chat_template="{{ messages }}"))
    without = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None))
    assert chat_default(with_template, None) is True and chat_default(without, None) is False
    assert chat_default(SimpleNamespace(tokenizer=None), None) is False
    assert chat_default(with_template, False) is False and chat_default(without, True) is True


def test_logit_bias_outside_the_vocabulary_fails_before_loading(tmp_path, capsys, monkeypatch):
    """A pair config's logit_bias naming an id outside the vocabulary: one line, exit 2, no model load."""
    from specjax.cli import main

    cfg = tmp_path / "bias.toml"
    cfg.write_text('[logit_bias]\n"99999" = 5.0\n')
    monkeypatch.setattr("specjax.io.loading.load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert main(["generate", "--config", str(cfg), "x"]) == 2
    err = capsys.readouterr().err
    assert "logit_bias names token id 99999, outside the vocabulary [0, 49152)" in err, err
