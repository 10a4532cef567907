"""Drafter kinds declared once (issue 27): every drafter subclasses ``core.drafting.Drafter`` and
declares what the loop, measurement and training need; the kinds a ``--draft`` value names live in
``drafters/registry.py``, which the API, the CLI and ``distill --arch`` ask. A new kind (here a
stand-in "block" drafter: one pass per round) is its own class plus one registry entry."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_model
from specjax.core.drafting import CausalModel, Drafter, TreeShape, require_drafter
from specjax.drafters import eagle, registry
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


def _eagle(target, layers=()):
    cfg = eagle.EagleConfig.for_target(target.config, 16, 32, feature_layers=layers)
    return eagle.EagleDrafter(cfg)


def test_shipped_drafters_declare_the_protocol(target):
    """Each shipped drafter states its feature layers, trees, always-proposes, context limit,
    causal model and cost shape (drafter passes per round: n-gram 0; draft model and EAGLE γ per
    chain, D per tree — EAGLE: the re-encode, then one forest call per level)."""
    ng, md = NgramDrafter(3), ModelDrafter.from_model(tiny_model(1))
    ea, ea3 = _eagle(target), _eagle(target, (0, 1))
    tree = TreeShape(8, 4, 2)
    assert all(isinstance(d, Drafter) for d in (ng, md, ea, ea3))
    assert (ng.feature_layers, md.feature_layers, ea.feature_layers, ea3.feature_layers) == ((), (), (), (0, 1))
    assert (ng.proposes_trees, md.proposes_trees, ea.proposes_trees) == (True, False, True)
    assert (ng.always_proposes, md.always_proposes, ea.always_proposes) == (False, True, True)
    assert not dataclasses.replace(ea, min_confidence=0.5).always_proposes
    assert ng.context_limit is None and md.context_limit == tiny_model(1).config.max_position_embeddings
    assert ea.context_limit == target.config.max_position_embeddings
    assert ng.causal_model is None and ea.causal_model is None
    assert md.causal_model == CausalModel(md.graphdef, md.config, md.cache_dtype)
    assert [d.chain_passes(5) for d in (ng, md, ea)] == [0, 5, 5]
    assert [d.tree_passes(tree) for d in (ng, ea)] == [0, 4] and md.tree_passes(TreeShape(4, 4, 1)) == 4
    assert ea.scratch_slots(4, tree) == max(4, 2 * 3) and ng.scratch_slots(4, tree) == 0


def test_hash_and_equality_unchanged(target):
    """The base class adds no field, hash or equality: drafters still key compiled programs as before."""
    assert [f.name for f in dataclasses.fields(NgramDrafter)] == ["max_ngram", "min_ngram", "params"]
    assert hash(NgramDrafter(3)) == hash((3, 1, None)) and NgramDrafter(3) == NgramDrafter(3) != NgramDrafter(4)
    ea = _eagle(target)
    assert hash(ea) == hash((ea.config, "eagle", 0.0)) and ea == _eagle(target)
    assert eagle.EagleDrafter.__module__ == "specjax.drafters.eagle"  # the measurement cache's key


def test_declarations_are_checked():
    """A class that says it proposes trees must define ``propose_tree`` (and the reverse); the
    Decoder refuses an object that is not a Drafter."""
    with pytest.raises(TypeError, match="declare proposes_trees = False"):
        class Liar(Drafter):  # noqa: F841
            proposes_trees = True
    with pytest.raises(TypeError, match="declare proposes_trees = True"):
        class Shy(Drafter):  # noqa: F841
            def propose_tree(self, *a):
                return None
    require_drafter(None)
    with pytest.raises(TypeError, match="must subclass specjax.core.drafting.Drafter"):
        require_drafter(object())
    from specjax.runtime.decoder import Decoder

    with pytest.raises(TypeError, match="must subclass"):
        Decoder(tiny_model(0), object(), 2)


def test_spec_kinds(tmp_path):
    """A --draft value's kind: by its string, or by the file that marks its directory; whether it
    proposes trees is its drafter class's declaration (api.draft_spec_proposes_trees agrees)."""
    from specjax import api

    ed, md, bd = tmp_path / "ed", tmp_path / "md", tmp_path / "bd"
    ed.mkdir()
    md.mkdir()
    bd.mkdir()
    (ed / "drafter.json").write_text("{}")
    (bd / "block_drafter.json").write_text("{}")
    (md / "config.json").write_text("{}")
    cases = {"ngram": "ngram", "ngram:5": "ngram", "default": "default", str(ed): "eagle", str(bd): "block",
             str(md): "model", "shipped:smollm2-135m-instruct-eagle3": "shipped",
             "org/name": "model", "x.gguf": "model"}
    for spec, name in cases.items():
        kind = registry.kind_of(spec)
        assert kind.name == name, spec
        assert api.draft_spec_proposes_trees(spec) == kind.drafter.proposes_trees == (name != "model")
    assert registry.kind_of(None) is None and registry.kind_of("none") is None
    assert not api.draft_spec_proposes_trees(None) and not api.draft_spec_proposes_trees("foo")
    with pytest.raises(ValueError, match="unknown --draft value 'foo'"):
        registry.kind_of("foo")
    with pytest.raises(ValueError, match=r"the directory has no config.json \(a draft model\) or block_drafter.json "
                                         r"\(a block drafter from specjax distill\) or drafter.json "
                                         r"\(a drafter from specjax distill\)"):
        api.check_draft_spec(str(tmp_path))
    (ed / "drafter.json").write_text("{")
    with pytest.raises(ValueError, match="drafter.json"):
        api.check_draft_spec(str(ed))


def test_shipped_drafters_by_name(capsys):
    """``--draft shipped:NAME`` names any drafter under ``models/`` (EAGLE or block, by its marker);
    a name that is not shipped is a one-line error listing the shipped ones, before anything loads;
    ``shipped:<the default's directory>`` is the ``default`` drafter."""
    from specjax import api
    from specjax.cli import main
    from specjax.io.loading import load_model

    names = registry.shipped_names()
    assert "smollm2-135m-instruct-eagle3" in names
    with pytest.raises(ValueError, match=r"--draft shipped:nope: no shipped drafter 'nope'; shipped: shipped:"):
        registry.check_spec("shipped:nope")
    assert main(["generate", "--draft", "shipped:nope", "Hi"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no shipped drafter 'nope'" in err[0] and "Traceback" not in err[0], err
    target = load_model(dtype="float32")
    by_name = api.load_drafter("shipped:smollm2-135m-instruct-eagle3", target)
    default = api.load_drafter("default", target)
    assert by_name.config == default.config and by_name.name == default.name == "default"


def test_training_entries():
    """``distill --arch`` names a kind; every declared training entry imports; a kind without one
    (or an unknown name) fails in one line naming the trainable kinds."""
    import importlib

    from specjax.cli.distill import trainer
    from specjax.train.block_distill import run as run_block
    from specjax.train.distill import run

    assert registry.trainable_kinds() == ["block", "eagle"] and trainer("eagle") is run
    assert trainer("block") is run_block
    for name in registry.trainable_kinds():
        module, _, fn = registry.KINDS[name].trainer.partition(":")
        assert callable(getattr(importlib.import_module(module), fn))
    with pytest.raises(ValueError, match="'ngram' has no training entry; trainable kinds: block, eagle"):
        trainer("ngram")
    with pytest.raises(ValueError, match="unknown drafter kind; trainable kinds: block, eagle"):
        trainer("nope")


def test_distill_arch_cli(tmp_path, capsys, monkeypatch):
    from specjax import cli

    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")
    assert cli.main(["distill", "--out", str(tmp_path / "run"), "--arch", "model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainable kinds: block, eagle" in err and not (tmp_path / "run").exists()


@dataclasses.dataclass(frozen=True)
class BlockDrafter(Drafter):
    """A stand-in for a new kind: proposes a whole block in one pass (here: γ copies of the last token)."""

    block: int = 4
    params: None = None
    name: str = "block"
    always_proposes = True

    def chain_passes(self, gamma: int) -> int:
        return 1

    def scratch_slots(self, gamma: int, tree=None) -> int:
        return 3 * gamma  # more than the target writes: the buffers grow for it

    def init_state(self, params, context, max_len):
        return ()

    def propose(self, params, state, context, keys, gamma, vocab_size):
        import jax
        import jax.numpy as jnp

        from specjax.core.drafting import Proposal

        last = jnp.take_along_axis(context.tokens, (context.lengths - 1)[:, None], axis=1)
        toks = jnp.broadcast_to(last, (last.shape[0], gamma)).astype(jnp.int32)
        return Proposal(toks, jax.nn.one_hot(toks, vocab_size), jnp.full(last.shape[:1], gamma, jnp.int32), state)


def test_a_new_kind_is_its_class_and_one_registry_entry(monkeypatch, target):
    """Registering a kind (its class and one DrafterKind, inserted before the catch-all ``model``)
    is all the API, the CLI's tree check and the Decoder need."""
    from specjax import api
    from specjax.cli.common import UsageError, check_tree
    from specjax.runtime.decoder import Decoder, decode_buffer_len

    def check(spec):
        if not spec.split(":", 1)[1].isdigit():
            raise ValueError(f"--draft {spec!r}: the block size must be an integer")

    kind = registry.DrafterKind("block", "a block drafter", BlockDrafter, lambda s: s.startswith("block:"), check,
                                load=lambda spec, tgt, dtype: BlockDrafter(int(spec.split(":")[1])))
    kinds = dict(registry.KINDS)
    model = kinds.pop("model")
    monkeypatch.setattr(registry, "KINDS", {**kinds, "block": kind, "model": model})
    assert api.load_drafter("block:3", target) == BlockDrafter(3)
    with pytest.raises(ValueError, match="block size"):
        api.check_draft_spec("block:x")
    assert not api.draft_spec_proposes_trees("block:3")

    class Args:
        gamma = None
    with pytest.raises(UsageError, match="--draft block:3 is a block drafter, which proposes chains only"):
        check_tree(Args(), {"tree": TreeShape(4, 2, 2), "draft": "block:3"}, False)
    dec = Decoder(target, BlockDrafter(3), 4)
    assert dec.program(10, 20).buffer_len == decode_buffer_len(10, 20, 12, dec.prompt_bucket)
    res = dec.generate([[5, 6, 7]], max_new_tokens=6)
    assert len(res.tokens[0]) == 6
