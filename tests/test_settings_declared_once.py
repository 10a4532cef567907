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
    cfg = bench.bench_config([], b, run, {}, started="t", total_s=0.0, model=None, drafts=[], gammas=[],
                              trees=[], dtypes=["float32"], draft_dtype="float32", chat=True, warmup=0)
    assert cfg["sampling"]["foo_weight"] == 1.0


def test_every_declared_field_is_a_flag_and_a_key():
    """Without monkeypatching: the shipped fields all reach the CLI and the config check."""
    from specjax.api import config_types
    from specjax.cli import build_parser

    parser = build_parser()
    flags = set(vars(parser.parse_args(["generate", "x"])))  # every flag's destination
    for name, k, _ in knobs(sampling_mod.Sampling):
        assert name in config_types()
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


# ---- a request field is declared once (issue 50)

@pytest.fixture
def new_request_field(monkeypatch):
    """:class:`~specjax.runtime.request.Request` with one more declared field, ``foo_limit`` (an integer
    in [0, 9], default 0): the only edit, as a developer would add it to the declaration."""
    from specjax.runtime import request as request_mod

    new = dataclasses.make_dataclass(
        "Request", [("foo_limit", int, knob(0, kind=int, check=lambda v: 0 <= v <= 9, expect="an integer in [0, 9]",
                                              help="a new request field"))],
        bases=(request_mod.Request,), frozen=True, init=False)
    monkeypatch.setattr(request_mod, "Request", new)
    return new


def test_a_request_field_reaches_the_cli(new_request_field, capsys):
    from specjax.cli import build_parser
    from specjax.cli.common import UsageError, resolve

    parser = build_parser()
    for cmd in (["generate", "x"], ["bench", "--prompt", "x"], ["analyze", "--model", "m", "--draft", "ngram",
                                                                  "--prompt", "x"]):
        assert parser.parse_args(cmd + ["--foo-limit", "3"]).foo_limit == 3
    s = resolve(parser.parse_args(["generate", "x", "--foo-limit", "4", "--max-new-tokens", "7"]))
    assert isinstance(s["request"].request, new_request_field)
    assert s["request"].foo_limit == 4 and s["request"].max_new_tokens == 7
    assert resolve(parser.parse_args(["generate", "x"]))["request"].foo_limit == 0  # the declared default
    with pytest.raises(UsageError, match=r"--foo-limit must be an integer in \[0, 9\], got 12"):
        resolve(parser.parse_args(["generate", "x", "--foo-limit", "12"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    assert "--foo-limit" in capsys.readouterr().out


def test_a_request_field_reaches_the_pair_config(new_request_field, tmp_path):
    from specjax.api import load_pair_config
    from specjax.cli import build_parser
    from specjax.cli.common import UsageError, resolve

    good = tmp_path / "good.toml"
    good.write_text('foo_limit = 2\nmax_new_tokens = 9\n')
    assert load_pair_config(str(good))["foo_limit"] == 2
    s = resolve(build_parser().parse_args(["generate", "x", "--config", str(good)]))
    assert s["request"].foo_limit == 2 and s["request"].max_new_tokens == 9
    s = resolve(build_parser().parse_args(["generate", "x", "--config", str(good), "--foo-limit", "5"]))
    assert s["request"].foo_limit == 5  # a flag wins over the config
    bad = tmp_path / "bad.toml"
    bad.write_text('foo_limit = 11\n')
    with pytest.raises(ValueError, match=r"foo_limit.*must be an integer in \[0, 9\]"):
        load_pair_config(str(bad))
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('foo_limit = "x"\n')
    with pytest.raises(ValueError, match="foo_limit"):
        load_pair_config(str(wrong))
    cross = tmp_path / "cross.toml"  # a cross-field rule of the declaration, said as the config's key
    cross.write_text('min_tokens = 50\nmax_new_tokens = 5\n')
    with pytest.raises(UsageError, match=r"config .*cross.toml: min_tokens must be at most --max-new-tokens \(5\)"):
        resolve(build_parser().parse_args(["generate", "x", "--config", str(cross)]))


def test_a_request_field_reaches_generate_text(new_request_field):
    from specjax.api import decode_settings, generate_text
    from specjax.runtime.request import Request

    st = decode_settings(foo_limit=6, max_new_tokens=3, temperature=0.5, batch_size=2)
    assert st.foo_limit == 6 and st.request.foo_limit == 6 and st.temperature == 0.5 and st.batch_size == 2
    assert decode_settings(request=Request(foo_limit=1)).foo_limit == 1
    with pytest.raises(SettingError, match=r"foo_limit must be an integer in \[0, 9\]"):
        decode_settings(foo_limit=10)
    with pytest.raises(ValueError, match="not both"):
        decode_settings(request=Request(), foo_limit=2)
    # generate_text checks its keywords through the declaration before it encodes or decodes anything
    with pytest.raises(SettingError, match="foo_limit"):
        generate_text(SimpleNamespace(tokenizer=None), ["x"], foo_limit=10)
    with pytest.raises(TypeError, match="unknown keyword"):
        generate_text(SimpleNamespace(tokenizer=None), ["x"], foo_limitt=1)


def test_a_request_field_reaches_the_http_body(new_request_field):
    from serve_helpers import word_tokenizer
    from specjax.serve import protocol as P

    tok = word_tokenizer()
    d = P.ServeDefaults(model_name="m", context_limit=64, vocab_size=128)
    assert d.request.foo_limit == 0 and d.request.seed is None  # the server's defaults are a request's
    body = {"model": "m", "prompt": "w5 w6", "max_tokens": 3}
    req = P.parse_completion({**body, "foo_limit": 7}, tok, d)
    assert isinstance(req.request, new_request_field) and req.request.foo_limit == 7 and req.foo_limit == 7
    chat = P.parse_chat({"model": "m", "messages": [{"role": "user", "content": "w5"}], "foo_limit": 2}, tok, d)
    assert chat.request.foo_limit == 2
    assert P.parse_completion(body, tok, d).request.foo_limit == 0
    with pytest.raises(P.RequestError, match=r"foo_limit must be an integer in \[0, 9\]") as e:
        P.parse_completion({**body, "foo_limit": 10}, tok, d)
    assert e.value.param == "foo_limit" and e.value.status == 400
    with pytest.raises(P.RequestError, match="foo_limit") as e:
        P.parse_completion({**body, "foo_limit": "x"}, tok, d)
    assert e.value.param == "foo_limit"


def test_a_request_field_reaches_the_engine_and_bench_json(new_request_field):
    from specjax.eval import bench
    from specjax.runtime.engine import EngineRequest
    from specjax.runtime.settings import DecodeSettings

    assert EngineRequest([3, 4], foo_limit=3).foo_limit == 3
    st = DecodeSettings(foo_limit=8, max_new_tokens=5)
    run = SimpleNamespace(prompt_records=[], model_name="m", weight_bytes=1, parse_special=True, chat=True)
    cfg = bench.bench_config([], st, run, {}, started="t", total_s=0.0, model=None, drafts=[], gammas=[],
                             trees=[], dtypes=["float32"], draft_dtype="float32", chat=True, warmup=0)
    assert cfg["foo_limit"] == 8 and cfg["max_new_tokens"] == 5 and cfg["seed"] == 0


def test_cross_field_rules_are_the_declarations(capsys):
    """``min_tokens > max_new_tokens`` is refused in one line from every entry point (new-user pass)."""
    from serve_helpers import word_tokenizer
    from specjax.api import decode_settings
    from specjax.cli import main
    from specjax.serve import protocol as P

    assert main(["generate", "x", "--min-tokens", "50", "--max-new-tokens", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specjax: error: --min-tokens must be at most --max-new-tokens (5), got 50"], err
    with pytest.raises(SettingError, match="min_tokens must be at most max_new_tokens"):
        decode_settings(min_tokens=50, max_new_tokens=5)
    d = P.ServeDefaults(model_name="m", context_limit=64, vocab_size=128)
    with pytest.raises(P.RequestError, match=r"min_tokens must be at most max_tokens \(5\)") as e:
        P.parse_completion({"model": "m", "prompt": "w5", "max_tokens": 5, "min_tokens": 50}, word_tokenizer(), d)
    assert e.value.param == "min_tokens"
    with pytest.raises(P.RequestError, match="needs 'stream': true") as e:  # stream_options without stream
        P.parse_completion({"model": "m", "prompt": "w5", "stream_options": {"include_usage": True}},
                           word_tokenizer(), d)
    assert e.value.param == "stream_options"
