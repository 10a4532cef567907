"""specjax's GGUF header reader (:class:`specjax.io.gguf.HeaderReader`) against ``gguf.GGUFReader``.

The loader reads GGUF files through ``HeaderReader`` (a cold start of the default model spent
5.3 s in ``GGUFReader``'s metadata parse); it must give exactly what ``GGUFReader`` gives for
everything specjax reads: every field's ``contents()`` (value and Python type, in order) and
every tensor's name, type, shape, sizes, offset and data (dtype, shape, bytes). Compared on the
default model's GGUF and on a written file with every metadata value type, F32/F16/Q8_0/Q4_1
tensors and a non-default alignment; a big-endian file falls back to ``GGUFReader``.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from specjax.io.gguf import HeaderReader, open_gguf
from specjax.io.loading import default_model_path


def _same(path):
    a, b = HeaderReader(path), gguf.GGUFReader(path)
    assert list(a.fields) == list(b.fields)
    for key in a.fields:
        x, y = a.fields[key].contents(), b.fields[key].contents()
        assert x == y and type(x) is type(y), key
        if isinstance(x, list) and x:
            assert type(x[0]) is type(y[0]), key
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for s, t in zip(a.tensors, b.tensors):
        assert (s.tensor_type, list(s.shape), s.n_elements, s.n_bytes, s.data_offset) == \
            (t.tensor_type, list(t.shape), t.n_elements, t.n_bytes, t.data_offset), s.name
        assert s.data.dtype == t.data.dtype and s.data.shape == t.data.shape, s.name
        assert np.array_equal(np.asarray(s.data).view(np.uint8), np.asarray(t.data).view(np.uint8)), s.name
    return a


def test_the_default_model_reads_the_same():
    r = _same(default_model_path())
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 49152


def _write(path, endianess=gguf.GGUFEndian.LITTLE):
    from gguf.quants import quantize

    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.0 / 3.0)
    w.add_uint64("t.u64", 2 ** 63 + 5)
    w.add_int64("t.i64", -(2 ** 62))
    w.add_float64("t.f64", 1.0 / 7.0)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "Ġthe", "✓✓"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("a.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.f16", rng.standard_normal((4, 7)).astype(np.float16))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    for t in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        w.add_tensor(f"c.{t.name}", quantize(x, t), raw_shape=quantize(x, t).shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_every_value_type_and_tensor_type_reads_the_same(tmp_path):
    r = _same(_write(tmp_path / "all.gguf"))
    assert r.fields["general.alignment"].contents() == 64


def test_a_big_endian_file_falls_back_to_the_library(tmp_path):
    path = _write(tmp_path / "big.gguf", gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError):
        HeaderReader(path)
    r = open_gguf(path)
    assert isinstance(r, gguf.GGUFReader) and r.fields["t.u32"].contents() == 4_000_000_000
