"""GGUF checkpoints (llama.cpp): config from metadata, weights dequantized with ``gguf``.

llama.cpp's converter permutes the rows of Q and K for the ``llama`` architecture
(interleaved RoPE); :func:`unpermute_qk` undoes it, after which every tensor equals the
Hugging Face weight. Quantized tensors (Q4_1, Q8_0, …) are dequantized to float32 by
``gguf.quants.dequantize``, which returns the HF ``[out, in]`` layout — except for the int8
format, which keeps the 8-bit codes and the per-block scale and offset of Q4_0, Q4_1 and Q8_0
tensors exactly (:func:`block_codes`; zero weight error, issue 26).
"""

from __future__ import annotations

import struct

import numpy as np

from specjax.models.config import QK_NORM_TYPES, CheckpointError, ModelConfig, UnsupportedModelError

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # llama.cpp's names, equal to the HF model_type

_MISSING = object()


def field(reader, key, default=_MISSING):
    """Value of GGUF metadata ``key`` (scalars, strings, lists), or ``default``."""
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            return None
        return default
    return f.contents()


def drop_fields(reader) -> None:
    """Free the reader's metadata (config and tokenizer already read); tensors stay readable."""
    import gc

    reader.fields.clear()
    gc.collect()


def check_complete(path: str) -> None:
    """A GGUF file's size against its header (:func:`specjax.io.files.check_gguf`; milliseconds,
    no tensor read). Raises CheckpointError naming the file, its size, the size its header needs
    and the fix."""
    from specjax.io.files import check_gguf

    check_gguf(path, CheckpointError, "re-download or re-copy it")


class _Field:
    """A metadata value, read as ``gguf``'s ``ReaderField.contents()`` reads it."""

    __slots__ = ("_value",)

    def __init__(self, value):
        self._value = value

    def contents(self):
        return self._value


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SIZES = {k: struct.calcsize(v) for k, v in _SCALARS.items()}
_ITEMS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}


class HeaderReader:
    """The parts of ``gguf.GGUFReader`` that specjax reads — ``fields[key].contents()`` and
    ``tensors`` (``gguf``'s own ``ReaderTensor`` records, ``data`` a read-only view of the file
    with the reader's dtype and shape) — parsed with :mod:`struct` over a memory map.

    Why: ``GGUFReader`` builds a numpy view for every item of every metadata array, 5.3 s of a
    cold start for the default model's 49,152-token vocabulary and 48,900 merges (gguf 0.19;
    the upstream speed-up, llama.cpp PR #13378, is not merged); this reads the same header in
    ≈ 0.1 s. Little-endian GGUF versions 2 and 3 only; anything else (or anything it cannot
    parse) raises ``ValueError`` and :func:`open_gguf` falls back to ``GGUFReader``.
    ``tests/test_loading.py`` compares both readers field by field and tensor by tensor."""

    def __init__(self, path: str):
        import mmap

        from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType
        from gguf.gguf_reader import ReaderTensor
        from gguf.quants import quant_shape_to_byte_shape

        self._unpack = struct.unpack_from
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            if mm[:4] != b"GGUF":
                raise ValueError("not a GGUF file")
            version, n_tensors, n_fields = struct.unpack_from("<IQQ", mm, 4)
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (or a big-endian file)")
            self._mm, pos = mm, 24
            self.fields: dict[str, _Field] = {"GGUF.version": _Field(version), "GGUF.tensor_count": _Field(n_tensors),
                                              "GGUF.kv_count": _Field(n_fields)}  # as GGUFReader lists them
            for _ in range(n_fields):
                key, pos = self._string(pos)
                (vtype,) = struct.unpack_from("<I", mm, pos)
                value, pos = self._value(vtype, pos + 4)
                self.fields[key] = _Field(value)
            infos = []
            for _ in range(n_tensors):
                name, pos = self._string(pos)
                (nd,) = struct.unpack_from("<I", mm, pos)
                dims = struct.unpack_from(f"<{nd}Q", mm, pos + 4)
                ttype, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * nd)
                pos += 4 + 8 * nd + 12
                infos.append((name, dims, ttype, offset))
        finally:
            self._mm = None
            mm.close()
        align = self.fields.get("general.alignment")
        align = int(align.contents()) if align is not None else GGUF_DEFAULT_ALIGNMENT
        start = pos + (-pos % align)
        self.data = np.memmap(path, mode="r")
        plain = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}
        self.tensors, seen = [], set()
        for name, dims, ttype, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice")
            seen.add(name)
            ggml_type = GGMLQuantizationType(ttype)
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elems * type_size // block
            np_dims = tuple(reversed(dims))
            item = plain.get(ggml_type)
            if item is None:
                item, count, np_dims = np.uint8, n_bytes, quant_shape_to_byte_shape(np_dims, ggml_type)
            else:
                count = n_elems
            at = start + offset
            size = np.dtype(item).itemsize * count
            if at + size > self.data.size:
                raise ValueError(f"tensor {name!r} ends past the file")
            data = self.data[at: at + size].view(item)[:count].reshape(np_dims)
            self.tensors.append(ReaderTensor(name=name, tensor_type=ggml_type, shape=np.array(dims, np.uint64),
                                             n_elements=n_elems, n_bytes=n_bytes, data_offset=at, data=data,
                                             field=None))

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = self._unpack("<Q", self._mm, pos)
        end = pos + 8 + n
        if end > len(self._mm):
            raise ValueError("a string runs past the file")
        return self._mm[pos + 8: end].decode("utf-8"), end

    def _value(self, vtype: int, pos: int):
        if vtype == 8:
            return self._string(pos)
        fmt = _SCALARS.get(vtype)
        if fmt is not None:
            return self._unpack(fmt, self._mm, pos)[0], pos + _SIZES[vtype]
        if vtype != 9:
            raise ValueError(f"metadata value type {vtype}")
        itype, n = self._unpack("<IQ", self._mm, pos)
        pos += 12
        if itype == 8:
            out = []
            for _ in range(n):
                text, pos = self._string(pos)
                out.append(text)
            return out, pos
        item = _ITEMS.get(itype)
        if item is None:
            raise ValueError(f"array item type {itype}")
        a = np.frombuffer(self._mm, dtype=item, count=n, offset=pos)
        return a.tolist(), pos + a.nbytes


def open_gguf(path: str):
    """A reader of ``path`` (:class:`HeaderReader`; ``gguf.GGUFReader`` for a file it does not
    read), after :func:`check_complete`, so a truncated file is named before anything is read.

    Raises:
      CheckpointError: a truncated file, or one the reader cannot parse.
    """
    import gguf

    check_complete(path)
    try:
        return HeaderReader(path)
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError, KeyError, ImportError):
        pass  # the library's reader: it parses more (or an older gguf lacks a name used here), or says what is wrong
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors on bad files
        raise CheckpointError(f"{path} is not a readable GGUF file, truncated or corrupt ({e}); "
                              "re-download it or convert the model again") from e


def config_from_gguf(reader) -> ModelConfig:
    """ModelConfig from GGUF metadata (architectures ``llama``, ``qwen2`` and ``qwen3``).

    Raises:
      UnsupportedModelError: another architecture, or RoPE scaling stored as GGUF
        ``rope_freqs`` factors / a scaling type other than none/linear.
    """
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})."
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(
            "this GGUF stores Llama-3.1 RoPE frequency factors (rope_freqs.weight), which the GGUF "
            "loader does not read; load the Hugging Face safetensors checkpoint instead."
        )
    scaling_type = field(reader, f"{arch}.rope.scaling.type", "none")
    scaling = None
    if scaling_type == "linear":
        scaling = (("factor", float(field(reader, f"{arch}.rope.scaling.factor"))), ("type", "linear"))
    elif scaling_type not in ("none", None):
        raise UnsupportedModelError(f"GGUF rope scaling type {scaling_type!r} is not supported.")
    d = int(field(reader, f"{arch}.embedding_length"))
    heads = int(field(reader, f"{arch}.attention.head_count"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    head_dim = field(reader, f"{arch}.attention.key_length") or d // heads
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=d,
        intermediate_size=int(field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings=_lm_head_name() not in names,
        attention_bias=arch == "qwen2",
        qk_norm=arch in QK_NORM_TYPES,
        model_type=arch,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _lm_head_name() -> str:
    from specjax.models import llama

    return llama.weight_spec("lm_head").gguf_name


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: ``w [out, in]`` → HF row order."""
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


# GGUF block types whose blocks of 32 are exactly int8 codes with a scale and an offset
# (llama.cpp ggml-common.h): bytes per block, where the scale d (float16) sits, and the codes
EXACT_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def block_codes(data, type_name: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The int8 format of a Q4_0 / Q4_1 / Q8_0 tensor's raw blocks, exactly
    (:func:`specjax.models.weights.quantize_int8`'s layout; ``w = d · code + m`` per block of 32):

    * Q4_1 (d, m float16; 16 bytes of 4-bit codes, element j in the low nibble of byte j, element
      j + 16 in the high one): codes 0..15, the block's d and m;
    * Q4_0 (d; 4-bit codes, w = d · (q − 8)): codes q, m = −8 · d;
    * Q8_0 (d; 32 int8 q, w = d · q): codes q + 128, m = −128 · d.

    Args:
      data: the tensor's raw bytes (``ReaderTensor.data``, uint8, any shape).
      k: elements per row (the innermost dimension, a multiple of 32).
    Returns:
      ``(codes uint8 [rows, k], scale float32 [2, rows, k / 32])`` in the file's row order.
    """
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
    raw = np.ascontiguousarray(np.asarray(data, np.uint8)).reshape(-1, size)
    d = raw[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)
    if type_name == "Q8_0":
        codes = (raw[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        m = np.float32(-128) * d
    else:
        qs = raw[:, 4:20] if type_name == "Q4_1" else raw[:, 2:18]
        codes = np.concatenate([qs & 15, qs >> 4], axis=1)
        m = raw[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32) if type_name == "Q4_1" \
            else np.float32(-8) * d
    rows = raw.shape[0] * 32 // k
    return codes.reshape(rows, k), np.stack([d, m]).reshape(2, rows, k // 32)


def iter_gguf_tensors(reader, cfg: ModelConfig, blocks: bool = False):
    """Yield ``(param_path, float32 array in specjax layout)`` for every tensor, one at a time
    (so at most one dequantized tensor is alive besides what the caller keeps). Names,
    transposes and the Q/K row permutation come from the weight table
    (:data:`specjax.models.weights.WEIGHTS`); the parts of a fused weight are yielded at the
    parts' paths (``("layers", i, "wq")``) and fused by :func:`specjax.io.loading.assemble_params`.
    With ``blocks`` (the int8 format), a matmul weight stored as Q4_0 / Q4_1 / Q8_0 comes as a
    :class:`specjax.models.weights.BlockCodes` of its exact codes and block scales instead.

    Raises:
      CheckpointError: a tensor name this architecture does not have.
    """
    from gguf.quants import dequantize

    from specjax.models import llama

    arch_permutes = cfg.model_type == "llama"  # llama.cpp permutes Q/K rows for this architecture only
    names = llama.checkpoint_names(cfg, "gguf")
    for t in reader.tensors:
        name = t.name
        hit = names.get(name)
        if hit is None:
            raise CheckpointError(f"unexpected tensor {name!r} in GGUF file")
        path, spec, tensor = hit  # tensor: the spec, or the part of a fused weight (path: the part's)
        if spec.tied_to is not None and not spec.present(cfg):
            continue  # a copy of the weight it is tied to
        shape = tuple(tensor.shape(cfg))
        stored = shape[::-1] if tensor.gguf_transpose else shape  # the [out, in] layout of the file
        if (blocks and spec.quant_axis is not None and t.tensor_type.name in EXACT_BLOCK_TYPES and len(stored) == 2
                and stored[1] % 32 == 0 and spec.quant_axis == (0 if tensor.gguf_transpose else len(shape) - 1)):
            codes, scale = block_codes(t.data, t.tensor_type.name, stored[1])
            if arch_permutes and tensor.gguf_permute is not None:
                n = getattr(cfg, tensor.gguf_permute)
                codes = unpermute_qk(codes, n)
                scale = np.stack([unpermute_qk(s, n) for s in scale])
            if tensor.gguf_transpose:
                codes, scale = np.ascontiguousarray(codes.T), np.ascontiguousarray(scale.transpose(0, 2, 1))
            yield path, llama.BlockCodes(codes, scale)
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if w.size == int(np.prod(stored)):
            w = w.reshape(stored)
        if arch_permutes and tensor.gguf_permute is not None:
            w = unpermute_qk(w, getattr(cfg, tensor.gguf_permute))
        yield path, (w.T if tensor.gguf_transpose else w)
