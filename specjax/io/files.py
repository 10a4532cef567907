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
            def read(fmt):
                size = struct.calcsize(fmt)
                data = f.read(size)
                if len(data) != size:
                    raise EOFError
                return struct.unpack(fmt, data)[0]

            def string():
                n = read("<Q")
                if n > 1 << 20:
                    raise EOFError
                return f.read(n).decode("utf-8", "replace")

            if f.read(4) != b"GGUF":
                return None
            version = read("<I")
            count = "<I" if version == 1 else "<Q"
            read(count)  # tensors
            for _ in range(read(count)):
                key, vtype = string(), read("<I")
                if vtype == 9:  # array: item type, count, items
                    itype, n = read("<I"), read("<Q")
                    if tokens and key == "tokenizer.ggml.tokens":
                        return int(n)
                    if itype in _GGUF_SIZES:
                        f.seek(n * _GGUF_SIZES[itype], 1)
                    elif itype == 8 and (n <= 4096 or not tokens):  # strings (general.languages, the vocabulary)
                        for _ in range(n):
                            f.seek(read("<Q"), 1)
                    else:
                        return None
                elif vtype == 8:
                    string()
                elif vtype in _GGUF_SIZES:
                    if key.endswith(suffix) and vtype in _GGUF_INTS:
                        return int(read(_GGUF_INTS[vtype]))
                    f.seek(_GGUF_SIZES[vtype], 1)
                else:
                    return None
    except (OSError, EOFError, struct.error, OverflowError, ValueError):
        return None
    return None
