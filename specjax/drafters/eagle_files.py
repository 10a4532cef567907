"""The EAGLE drafter's files: what identifies the target it was trained for
(:func:`target_fingerprint`, :func:`fingerprint_mismatch`), the file layout of its trainable
parameters (:func:`flat_trainable` / :func:`unflat_trainable`) and :func:`save_drafter`
(``model.safetensors`` + ``drafter.json``). Loading is :func:`specjax.drafters.eagle.load_drafter`,
which re-exports every name here.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from specjax.drafters.eagle_params import COPY_KEYS, EagleConfig, block_weights, target_embed
from specjax.models import weights


def target_fingerprint(target) -> dict:
    """What identifies the target a drafter was trained for: ``config`` (SHA-256 of its
    config), ``tokenizer`` (:meth:`Tokenizer.fingerprint`) — both compared exactly — and
    ``weights``: a few weight statistics (L2 norms of 8 first and 8 last embedding rows,
    the first 16 entries of the final norm and of layer 0's attention norm), compared with
    a 2% tolerance so bfloat16/int8 loads of the same weights still match."""
    import hashlib

    cfg = target.config
    source = getattr(target, "source_config", None) or cfg  # the checkpoint's, under a --max-model-len cap
    c = json.dumps(source.identity(), sort_keys=True, default=str)
    emb = np.asarray(target_embed(target, np.r_[0:8, cfg.vocab_size - 8:cfg.vocab_size]), np.float64)
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    w = np.concatenate([np.linalg.norm(emb, axis=1), f32(target.params["final_norm"][...])[:16],
                        f32(target.params["layers"][0]["attn_norm"][...])[:16]])
    tok = getattr(target, "tokenizer", None)
    return {"config": hashlib.sha256(c.encode()).hexdigest(),
            "tokenizer": tok.fingerprint() if tok is not None else None,
            "weights": [round(float(x), 6) for x in w]}


def fingerprint_mismatch(saved: dict, fp: dict) -> str | None:
    """Why ``fp`` (the loaded target) is not ``saved`` (the trained-for target), or None."""
    if saved.get("tokenizer") != fp["tokenizer"]:
        return "its tokenizer differs"
    if saved.get("config") != fp["config"]:
        return "its config differs"
    a, b = np.asarray(saved.get("weights", []), float), np.asarray(fp["weights"], float)
    if a.shape != b.shape or not np.allclose(a, b, rtol=2e-2, atol=1e-3):
        return "its weights differ"
    return None


def check_trained_for(meta: dict, target, path, what: str = "drafter", arch: str = "") -> None:
    """Raises CheckpointError unless the drafter described by ``meta`` (its JSON) was trained for
    ``target`` (:func:`fingerprint_mismatch`); ``what`` names it, ``arch`` the ``--arch`` to retrain."""
    from specjax.models.config import CheckpointError

    why = fingerprint_mismatch(meta.get("target_fingerprint") or {}, target_fingerprint(target))
    if why:
        raise CheckpointError(
            f"the {what} in {path} was trained for target {meta.get('target_name')!r}, not for "
            f"{target.name!r} ({why}); use --draft ngram, or train one for it with `specjax distill{arch}`")


def flat_trainable(tp: dict, cfg: EagleConfig) -> dict[str, np.ndarray]:
    """``{file name: array}`` of the trainable parameters; the block's fused weights are written
    as their parts (``layer.wq``, ``layer.wk``, …: the file layout of every drafter so far)."""
    out = {"fc": tp["fc"], "fc_b": tp["fc_b"], "out_norm": tp["out_norm"]}
    out.update({k: tp[k] for k in COPY_KEYS + ("fuse",) if k in tp})
    for spec in block_weights():
        for t, a in weights.split(spec, cfg.layer, np.asarray(tp["layer"][spec.name])):
            out[f"layer.{t.name}"] = a
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def unflat_trainable(flat: dict, cfg: EagleConfig) -> dict:
    """The inverse of :func:`flat_trainable` (the parts of a fused block weight concatenated)."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    layer = {}
    for spec in block_weights():
        parts = [f32(flat[f"layer.{t.name}"]) for t in spec.tensors()]
        layer[spec.name] = weights.fuse(spec, cfg.layer, parts) if spec.parts else parts[0]
    tp = {"fc": f32(flat["fc"]), "fc_b": f32(flat["fc_b"]), "out_norm": f32(flat["out_norm"]), "layer": layer}
    tp.update({k: jnp.asarray(flat[k], jnp.float32) for k in COPY_KEYS + ("fuse",) if k in flat})
    return tp


def save_drafter(path: str, cfg: EagleConfig, trainable: dict, sub_ids, target, extra: dict | None = None,
                 dtype: str = "float32") -> None:
    """Write ``model.safetensors`` (trainable weights + ``sub_ids``) and ``drafter.json``
    (config, target fingerprint) into the directory ``path`` (created; must not exist or be empty)."""
    import os

    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = flat_trainable(trainable, cfg)
    if dtype == "bfloat16":
        import ml_dtypes

        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    tensors["sub_ids"] = np.asarray(sub_ids, np.int32)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "specjax-eagle"})
    meta = {"config": cfg.to_json(), "target_fingerprint": target_fingerprint(target), "target_name": target.name}
    meta.update(extra or {})
    with open(os.path.join(path, "drafter.json"), "w") as f:
        json.dump(meta, f, indent=2)
