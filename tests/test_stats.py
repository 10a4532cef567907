"""RunStats: the one statistics type (merge, derived figures)."""

from specjax.runtime.stats import RunStats


def test_merge_and_derived_figures():
    a = RunStats.from_batch([{"new_tokens": 5, "target_calls": 2, "draft_calls": 2, "drafted_tokens": 4,
                              "accepted_tokens": 3, "checked_tokens": 4, "accept_hist": [0, 1, 1]},
                             {"new_tokens": 3, "target_calls": 3, "draft_calls": 3, "drafted_tokens": 0,
                              "accepted_tokens": 0, "checked_tokens": 0, "accept_hist": [3]}], decode_s=2.0)
    assert a.rows == 2 and a.new_tokens == 8 and a.accept_hist == (3, 1, 1) and a.decode_s == 2.0
    assert a.mean_accepted_tokens == 8 / 5 and a.acceptance_rate == 3 / 4 and a.tokens_per_s == 4.0
    b = RunStats.from_row({"new_tokens": 2, "target_calls": 1, "draft_calls": 1, "accepted_tokens": 1,
                           "checked_tokens": 1, "drafted_tokens": 4, "accept_hist": [0, 1, 0, 0, 0]})
    c = a + b
    assert c.accept_hist == (3, 2, 1, 0, 0) and c.rows == 3 and sum([a, b]) == c
    ar = RunStats.from_row({"new_tokens": 4, "target_calls": 4, "accept_hist": [4]})
    assert ar.acceptance_rate is None and ar.mean_accepted_tokens == 1.0 and ar.tokens_per_s is None
    assert RunStats().mean_accepted_tokens is None and c.summary()["accept_hist"] == [3, 2, 1, 0, 0]
    # per position: 6 rounds, 3 accepted >= 1 (α_1 = 3/6), 1 of those >= 2 (α_2 = 1/3), none >= 3
    # (α_3 = 0/1); no round reached position 4 (no data: None)
    assert c.acceptance_by_position == [0.5, 1 / 3, 0.0, None] and ar.acceptance_by_position is None


def test_no_data_is_none_everywhere():
    """One convention for "no data" (issue 27): ``None`` / JSON null, never 0.0 or NaN — in the
    derived figures, a row without a target call, a batch without decode time, the tables."""
    import json
    import math

    import numpy as np

    from specjax.runtime.results import GenerationResult, RowStats, row_stats
    from specjax.runtime.stats import difference, ratio
    from specjax.train.benchmark import bench_table

    assert ratio(3, 2) == 1.5 and ratio(0, 2) == 0.0
    assert all(ratio(a, b) is None for a, b in [(1, 0), (None, 1), (1, None), (math.nan, 1), (1, math.inf)])
    assert difference(3, 1) == 2.0 and difference(None, 1) is None and difference(1, math.nan) is None
    empty = RunStats()
    assert empty.mean_accepted_tokens is None and empty.tokens_per_s is None and empty.acceptance_rate is None
    # a row cut before its first token (a stop string completed by nothing kept): no target call
    s = row_stats(np.zeros(3, np.int64), np.zeros(3, np.int64), 0, True)
    assert s["target_calls"] == 0
    rs = RowStats(**s, mean_accepted_tokens=ratio(0, s["target_calls"]), acceptance_rate=None, finish_reason="stop")
    assert rs["mean_accepted_tokens"] is None
    assert GenerationResult([[]], [rs], 0.0, 0.0, 0.0).tokens_per_s is None
    spec = RunStats.from_batch([{"new_tokens": 6, "target_calls": 3, "draft_calls": 3, "drafted_tokens": 6,
                                 "accepted_tokens": 3, "checked_tokens": 6, "accept_hist": [1, 1, 1]}], decode_s=1.0)
    ar = RunStats.from_batch([{"new_tokens": 6, "target_calls": 6, "accept_hist": [6]}], decode_s=0.0)
    table = bench_table({"ar": ar, "spec": spec}, {"ar": {"x": ar}, "spec": {"x": spec}})
    assert table["ar"]["tokens_per_s"] is None and table["ar"]["alpha"] is None
    assert table["spec"]["speedup"] is None and table["spec"]["by_category"]["x"]["speedup"] is None
    assert table["spec"]["alpha"] == 0.5 and table["spec"]["tokens_per_call"] == 2.0
    json.dumps(table, allow_nan=False)  # valid JSON: no NaN anywhere


def test_tau_and_tokens_per_s_are_defined_once():
    """τ and tokens/s have one formula each (runtime/stats.py, issue 50): RunStats, a batch's
    GenerationResult and a row's τ in results.py, a prompt's tokens/s in eval/bench.py call it."""
    import math
    import pathlib
    import re

    from specjax.runtime.results import GenerationResult
    from specjax.runtime.stats import tau, tokens_per_second

    assert tau(6, 3) == 2.0 and tau(0, 3) == 0.0 and tau(5, 0) is None and tau(None, 2) is None
    assert tokens_per_second(10, 2.0) == 5.0 and tokens_per_second(0, 2.0) == 0.0
    assert all(tokens_per_second(10, d) is None for d in (0, 0.0, -1.0, None, math.nan, math.inf))
    r = GenerationResult([[1, 2, 3], [4]], [], 0.0, 0.0, 2.0)
    assert r.tokens_per_s == tokens_per_second(4, 2.0) == RunStats(new_tokens=4, decode_s=2.0).tokens_per_s == 2.0
    src = pathlib.Path(__file__).resolve().parent.parent / "specjax"
    own = re.compile(r"/\s*\w+\.decode_s\b|/\s*\w+\[\"target_calls\"\]|ratio\(.*\b(decode_s|target_calls)\b")
    for rel in ("runtime/results.py", "eval/bench.py"):
        lines = [ln for ln in (src / rel).read_text(encoding="utf-8").splitlines() if own.search(ln)]
        assert not lines, f"{rel} computes τ or tokens/s itself (use specjax.runtime.stats): {lines}"


def test_decode_settings_validate_and_derive():
    import pytest

    from specjax.runtime.settings import DecodeSettings

    s = DecodeSettings(max_new_tokens=8, temperature=0.7, top_k=5, batch_size=2, ignore_eos=True, seed=2 ** 63)
    assert [list(r) for r in s.batches(5)] == [[0, 1], [2, 3], [4]] and s.eos_ids() == []
    assert s.params(3).temperature.shape == (3,) and s.sampling.top_k == 5 and hash(s) == hash(DecodeSettings(**vars(s)))
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(temperature=float("nan")), dict(top_k=-1),
                dict(top_p=0), dict(top_p=1.5), dict(seed=-1), dict(seed=2 ** 64), dict(batch_size=0)):
        with pytest.raises(ValueError):
            DecodeSettings(**bad)


def test_row_stats_are_typed_and_read_as_the_documented_mapping():
    """``GenerationResult.stats[i]`` is a :class:`specjax.RowStats`: typed fields, and a read-only
    mapping with exactly the documented JSON field names (``dict(stats)``, ``stats[name]``), equal to
    that dict; unknown names raise ``KeyError``; it cannot be changed."""
    import dataclasses
    import json

    from conftest import tiny_model

    import specjax
    from specjax.drafters.ngram import NgramDrafter

    res = specjax.Decoder(tiny_model(seed=1), NgramDrafter(3), gamma=2).generate([[3, 4, 3, 4, 3]], max_new_tokens=6,
                                                                              eos_ids=[])
    s = res.stats[0]
    assert isinstance(s, specjax.RowStats)
    names = ["new_tokens", "target_calls", "draft_calls", "drafted_tokens", "accepted_tokens", "checked_tokens",
             "mean_accepted_tokens", "acceptance_rate", "accept_hist", "finish_reason"]
    assert list(s) == names and list(dict(s)) == names
    assert s.new_tokens == s["new_tokens"] == 6 and s.finish_reason == "length"
    assert s == dict(s) and dict(s) == s and s != dict(s, new_tokens=5)
    assert s.mean_accepted_tokens == 6 / s.target_calls and s.get("absent") is None
    json.dumps(dict(s))  # plain JSON types
    try:
        s["absent"]
        raise AssertionError("an unknown name must raise KeyError")
    except KeyError:
        pass
    try:
        s.new_tokens = 0
        raise AssertionError("RowStats must be frozen")
    except dataclasses.FrozenInstanceError:
        pass
