"""Reading a small text file whole, with an error that names the file, the line and the fix."""

from __future__ import annotations


def read_utf8(path: str, error: type[Exception] = ValueError, fix: str = "save the file as UTF-8") -> str:
    """The text of ``path`` (UTF-8; a byte-order mark is accepted and dropped).

    Raises:
      error: ``path:line: not valid UTF-8; <fix>`` when the bytes are not UTF-8.
      OSError: the file cannot be read (the CLI turns it into one line naming the path).
    """
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise error(f"{path}:{line}: not valid UTF-8; {fix}") from None


def read_json(path: str, error: type[Exception] = ValueError, fix: str = "fix the file"):
    """The JSON value in ``path`` (UTF-8).

    Raises:
      error: ``path:line: not valid JSON (…); <fix>`` (or not UTF-8).
      OSError: the file cannot be read.
    """
    import json

    text = read_utf8(path, error, fix)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno}); {fix}") from None


def check_safetensors(path: str, error: type[Exception] = ValueError, fix: str = "re-download or re-save it") -> None:
    """Check that ``path`` is a complete safetensors file from its header alone (no tensor is
    read): an 8-byte little-endian header length, a JSON header, and at least as many bytes
    after it as the largest ``data_offsets`` end.

    Raises:
      error: ``path: truncated or corrupt safetensors file (…); <fix>``.
      OSError: the file cannot be read.
    """
    import json
    import os
    import struct

    size = os.path.getsize(path)
    why = None
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None:
            why = f"{size} bytes, shorter than the 8-byte header length"
        elif n > size - 8:
            why = f"the header length says {n} bytes, the file has {size - 8} after it"
        else:
            raw = f.read(n)
    if why is None:
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
        if not isinstance(header, dict):
            why = "the header is not a JSON object"
        else:
            end = 0
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                offs = t.get("data_offsets") if isinstance(t, dict) else None
                if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(x, int) for x in offs)):
                    why = f"tensor {name!r} has no valid data_offsets"
                    break
                end = max(end, offs[1])
            if why is None and size < 8 + n + end:
                why = f"{size} bytes, the header describes {8 + n + end}"
    if why is not None:
        raise error(f"{path}: truncated or corrupt safetensors file ({why}); {fix}")


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # scalar value types
_GGUF_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


class _GGUFHeader:
    """Reads a GGUF file's header (magic, counts, metadata, tensor table) with plain file reads,
    seeking over what it does not need; :class:`EOFError` where the file ends inside it."""

    def __init__(self, f):
        import struct

        self.f = f
        self._struct = struct
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        version = self.read("<I")
        count = "<I" if version == 1 else "<Q"
        self.tensors, self.fields = self.read(count), self.read(count)

    def read(self, fmt):
        size = self._struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise EOFError
        return self._struct.unpack(fmt, data)[0]

    def string(self) -> str:
        n = self.read("<Q")
        if n > 1 << 20:
            raise ValueError(f"a string of {n} bytes")
        data = self.f.read(n)
        if len(data) != n:
            raise EOFError
        return data.decode("utf-8", "replace")

    def skip(self, vtype: int, n: int | None = None, itype: int | None = None) -> None:
        """Skip a value of ``vtype`` (an array: its item type ``itype`` and length ``n`` when
        already read)."""
        if vtype == 9:
            if itype is None:
                itype, n = self.read("<I"), self.read("<Q")
            if itype in _GGUF_SIZES:
                self.f.seek(n * _GGUF_SIZES[itype], 1)
            elif itype == 8:
                for _ in range(n):
                    self.f.seek(self.read("<Q"), 1)
            else:
                raise ValueError(f"array item type {itype}")
        elif vtype == 8:
            self.f.seek(self.read("<Q"), 1)
        elif vtype in _GGUF_SIZES:
            self.f.seek(_GGUF_SIZES[vtype], 1)
        else:
            raise ValueError(f"value type {vtype}")


def gguf_vocab_size(path: str) -> int | None:
    """The vocabulary size of a GGUF file from the start of its metadata (``<arch>.vocab_size``,
    else the length of ``tokenizer.ggml.tokens``) without reading the vocabulary or any tensor
    (milliseconds; opening the file with ``gguf`` takes seconds). ``None`` when it cannot tell."""
    return _gguf_int(path, ".vocab_size", tokens=True)


def gguf_context_length(path: str) -> int | None:
    """A GGUF file's ``<arch>.context_length`` (the model's ``max_position_embeddings``) read
    as :func:`gguf_vocab_size` reads the vocabulary size; ``None`` when it cannot tell."""
    return _gguf_int(path, ".context_length", tokens=False)


def _gguf_int(path: str, suffix: str, tokens: bool) -> int | None:
    """The first integer metadata value whose key ends with ``suffix`` (``tokens``: or the length
    of ``tokenizer.ggml.tokens``, if that comes first); ``None`` when not found or unreadable."""
    import struct

    try:
        with open(path, "rb") as f:
            h = _GGUFHeader(f)
            for _ in range(h.fields):
                key, vtype = h.string(), h.read("<I")
                if vtype == 9:  # array: item type, count, items
                    itype, n = h.read("<I"), h.read("<Q")
                    if tokens and key == "tokenizer.ggml.tokens":
                        return int(n)
                    if itype == 8 and n > 4096 and tokens:  # a long string array before the vocabulary: give up
                        return None
                    h.skip(vtype, n, itype)
                elif key.endswith(suffix) and vtype in _GGUF_INTS:
                    return int(h.read(_GGUF_INTS[vtype]))
                else:
                    h.skip(vtype)
    except (OSError, EOFError, struct.error, OverflowError, ValueError):
        return None
    return None


def check_gguf(path: str, error: type[Exception] = ValueError, fix: str = "re-download or re-copy it") -> None:
    """Check that the GGUF file ``path`` is complete from its header alone (no tensor is read):
    the metadata and tensor table end inside the file, and every tensor's data (its offset plus
    its size, from its shape and type) does too. A header this cannot parse, or a tensor type it
    does not know, is left to the reader.

    Raises:
      error: ``path is truncated: N bytes, …; <fix>``.
      OSError: the file cannot be read.
    """
    import os
    import struct

    try:
        from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT
    except ImportError:  # pragma: no cover  (a dependency)
        return
    sizes = {int(k): v for k, v in GGML_QUANT_SIZES.items()}
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        try:
            h = _GGUFHeader(f)
            align = GGUF_DEFAULT_ALIGNMENT
            for _ in range(h.fields):
                key, vtype = h.string(), h.read("<I")
                if key == "general.alignment" and vtype in _GGUF_INTS:
                    align = int(h.read(_GGUF_INTS[vtype])) or GGUF_DEFAULT_ALIGNMENT
                else:
                    h.skip(vtype)
            end = 0
            for _ in range(h.tensors):
                h.string()
                dims = [h.read("<Q") for _ in range(h.read("<I"))]
                ttype, offset = h.read("<I"), h.read("<Q")
                if ttype not in sizes:
                    continue
                block, nbytes = sizes[ttype]
                n = 1
                for d in dims:
                    n *= d
                end = max(end, offset + n // block * nbytes)
            start = f.tell()
        except EOFError:
            why = "it ends inside its header (the metadata and tensor table)"
        except (ValueError, struct.error, OverflowError):
            return  # not a header this reads: the GGUF reader says what is wrong
        else:
            need = start + (-start % align) + end
            if size >= need and start <= size:
                return
            why = f"its header needs {need}"
    raise error(f"{path} is truncated: {size} bytes, {why}; {fix}")
