"""Converted weights cached on disk, so a checkpoint is converted once (the first minute).

Loading the default GGUF means opening the reader (~2–3 s: ~150k small metadata fields),
dequantizing every tensor, undoing llama.cpp's Q/K permutation, fusing, and for ``int8`` /
``bfloat16`` quantizing or rounding. :func:`specjax.io.loading.load_model` keeps the result:
the final parameter arrays of one weight format in
``<cache dir>/converted/<source hash>-<format>-<key>.safetensors`` (numpy safetensors; bfloat16
stored as its uint16 bits and named in the metadata), with the model's config in the metadata;
for a GGUF also the tokenizer (``tokenizers``' JSON plus the fields
:class:`~specjax.io.tokenizer.Tokenizer` needs) in ``<source hash>-tokenizer-<key>.json``. A
later load of the same source in the same format reads these files and never opens the GGUF.
Sizes for the default model: float32 538 MB, bfloat16 269 MB, int8 135 MB, tokenizer 2 MB.

* The cache directory is the measurement cache's base (:func:`cache_dir`: ``$SPECJAX_CACHE_DIR``,
  else ``$XDG_CACHE_HOME/specjax``, else ``~/.cache/specjax``); ``SPECJAX_NO_CACHE=1`` turns
  it off (nothing read or written).
* The key is a SHA-256 of: the source's content hash (SHA-256 of the file, or of a model
  directory's weight, config and tokenizer files; computed once per file and remembered by
  path, size and modification time in ``converted/sources.json``: the 98 MB default GGUF
  hashes in ~0.13 s; a file modified in the last 3 s is hashed at every load, as its time stamp
  may not show a change made within it), the weight format, :data:`CONVERTER_VERSION`, the specjax, jax and gguf
  versions, and a hash of the converter's own source files (:data:`CONVERTER_SOURCES`), so an
  edited converter in a source checkout never reads an old conversion.
* One entry per source and format: writing one deletes that source's entries of the same kind
  made by another converter or version (a source checkout under edit does not pile up copies).
* Entries are written atomically (a temporary file in the same directory, ``fsync``,
  ``os.replace``): concurrent runs see a whole entry or none. An entry that cannot be read, or
  whose tensors or config do not match, is deleted and converted again with one
  ``specjax: note:`` line. A write that fails is one note line, and the load goes on.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import time
import warnings
from typing import Callable

import numpy as np

from specjax.core import env, notes
from specjax.core.paths import cache_dir, usable_cache_dir  # noqa: F401  (the rule lives in core: every layer uses it)

# Bump when the conversion's result changes in a way the hashed sources below do not show
# (they are hashed too, so an edit of them alone needs no bump).
CONVERTER_VERSION = 2  # 2: int8 as 8-bit block codes with scales and offsets (issue 26)
# The modules whose code decides the converted arrays and the tokenizer (relative to specjax/).
CONVERTER_SOURCES = ("io/convcache.py", "io/loading.py", "io/assemble.py", "io/hf.py", "io/gguf.py",
                     "io/tokenizer.py", "models/config.py", "models/weights.py", "models/llama.py", "models/q8.py")
MAX_ENTRY_BYTES = 8 << 30  # larger conversions are not cached (a copy of a 7B float32 model is 28 GB)
SOURCES_FILE = "sources.json"
_SOURCES_KEPT = 256  # remembered file hashes (the least recently stored are dropped)
# a directory's files that make the model: weights, config, tokenizer, chat template
_DIR_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt", ".model")
_RACY_NS = 3_000_000_000  # a file changed this recently is hashed every time (coarse file-system clocks)
_DIGESTS: dict = {}  # real path -> {"size", "mtime_ns", "sha256"}, this process's memo


def enabled() -> bool:
    """Whether the cache is on: ``SPECJAX_NO_CACHE`` unset, empty or off (``0``), and :func:`cache_dir` usable
    (:func:`specjax.core.paths.usable_cache_dir`: else one note says why it is off)."""
    return not env.get("SPECJAX_NO_CACHE") and usable_cache_dir() is not None


def _oneline(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]


@functools.lru_cache(maxsize=1)
def converter_fingerprint() -> dict:
    """What else decides a conversion: :data:`CONVERTER_VERSION`, the specjax, jax and gguf
    versions, and a SHA-256 of the :data:`CONVERTER_SOURCES` files."""
    import importlib.metadata as md

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "unknown"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for rel in CONVERTER_SOURCES:
        try:
            with open(os.path.join(root, rel), "rb") as f:
                h.update(rel.encode() + b"\0" + f.read() + b"\0")
        except OSError:
            h.update(rel.encode() + b"\0missing\0")
    return {"converter": CONVERTER_VERSION, "specjax": version("specjax"), "jax": version("jax"),
            "gguf": version("gguf"), "sources": h.hexdigest()}


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` writes the whole file at ``tmp`` (a new name in ``path``'s directory); then
    it is flushed to disk and renamed over ``path``. Raises OSError (the temporary is removed)."""
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def forget_digests() -> None:
    """Forget the file hashes this process remembers (as a new process would: only the cache's
    ``sources.json`` remembers them then)."""
    _DIGESTS.clear()


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    """SHA-256 (hex) of the file's content, read ``chunk`` bytes at a time; every source hash
    of the cache is computed here."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


class ConversionCache:
    """The converted-weights cache of one source (a GGUF file or a model directory).

    Args:
      source: the real path of the checkpoint file or directory.
      root: the cache's base directory (default :func:`cache_dir`); entries go to ``root/converted``.
      note: called with a one-line message (default: a ``specjax: note: …`` line on stderr).
    """

    def __init__(self, source: str, root: str | None = None, note: Callable[[str], None] | None = None):
        self.source = os.path.realpath(source)
        self.dir = os.path.join(root or cache_dir(), "converted")
        self.note = note or notes.note
        self._digest: str | None = None

    # ---------------------------------------------------------------- keys
    @staticmethod
    def _file_digest(path: str, memo: dict, changed: list) -> str:
        st = os.stat(path)
        if time.time_ns() - st.st_mtime_ns < _RACY_NS:  # may change again within its time stamp: no memo
            return sha256_file(path)
        want = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}

        def current(rec):
            return isinstance(rec, dict) and all(rec.get(k) == v for k, v in want.items()) \
                and isinstance(rec.get("sha256"), str)
        if current(memo.get(path)):  # the cache's memo
            _DIGESTS[path] = memo[path]
            return memo[path]["sha256"]
        rec = _DIGESTS.get(path)  # this process's (another cache directory's) memo
        if not current(rec):
            rec = dict(want, sha256=sha256_file(path))
        memo.pop(path, None)  # re-inserted last: the most recent entries are kept
        memo[path] = _DIGESTS[path] = rec
        changed.append(path)
        return rec["sha256"]

    def source_digest(self) -> str:
        """SHA-256 of the source's content (a directory: of its model files' names and hashes),
        remembered per file by path, size and modification time in ``sources.json``."""
        if self._digest is not None:
            return self._digest
        memo_path = os.path.join(self.dir, SOURCES_FILE)
        try:
            with open(memo_path, encoding="utf-8") as f:
                memo = json.load(f)
            if not isinstance(memo, dict):
                memo = {}
        except (OSError, ValueError):  # none yet, or unreadable: it is only a memo
            memo = {}
        changed: list = []
        if os.path.isdir(self.source):
            h = hashlib.sha256(b"specjax model directory\0")
            for name in sorted(os.listdir(self.source)):
                f = os.path.join(self.source, name)
                if name.endswith(_DIR_SUFFIXES) and os.path.isfile(f):
                    h.update(f"{name}\0{self._file_digest(os.path.realpath(f), memo, changed)}\0".encode())
            digest = h.hexdigest()
        else:
            digest = self._file_digest(self.source, memo, changed)
        if changed:
            keep = dict(list(memo.items())[-_SOURCES_KEPT:])
            try:
                _atomic_write(memo_path, lambda tmp: _write_text(tmp, json.dumps(keep, indent=1)))
            except OSError:
                pass  # the next run hashes again
        self._digest = digest
        return digest

    def key(self, kind: str, fmt: str | None = None) -> str:
        """The entry name of ``kind`` (``"params"`` in format ``fmt``, or ``"tokenizer"``)."""
        parts = {"kind": kind, "source": self.source_digest(), "format": fmt, **converter_fingerprint()}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]

    def _stem(self, what: str) -> str:
        """``<source hash>-<what>-``: the start of every entry name of this source and kind."""
        return f"{self.source_digest()[:20]}-{what}-"

    def params_path(self, fmt: str) -> str:
        return os.path.join(self.dir, f"{self._stem(fmt)}{self.key('params', fmt)[:20]}.safetensors")

    def tokenizer_path(self) -> str:
        return os.path.join(self.dir, f"{self._stem('tokenizer')}{self.key('tokenizer')[:20]}.json")

    def _prune(self, path: str) -> None:
        """Delete this source's other entries of the same kind (older converters or versions), so
        the cache holds one conversion per source and format."""
        name = os.path.basename(path)
        stem = name[: name.rindex("-") + 1]
        try:
            for other in os.listdir(self.dir):
                if other.startswith(stem) and other != name and not other.startswith("."):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.dir, other))
        except OSError:
            pass

    def _drop(self, path: str, why: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        self.note(f"the cached conversion {path} was unreadable ({why}); converted again")

    # ---------------------------------------------------------------- parameters
    def get_params(self, fmt: str, check: Callable[[dict, dict], None], take: Callable | None = None):
        """``(meta, result)`` of the cached conversion to ``fmt``, or ``None`` (no entry; or an
        unreadable one: deleted, one note line). ``check(meta, headers)`` gets ``{name: header}``
        (``header.shape``, ``header.dtype``; nothing read yet) and raises ``ValueError`` when the
        entry does not fit (a tensor missing or mis-shaped): handled the same way. Then
        ``take(meta, read)`` runs while the file is open, ``read(name)`` giving one tensor as a
        numpy array, so a caller can place the tensors one at a time (the host never holds the
        whole entry); its return value is ``result``. Without ``take``, ``result`` is
        ``{name: numpy array}`` of every tensor."""
        path = self.params_path(fmt)
        if not os.path.exists(path):
            return None
        try:
            from safetensors import safe_open

            try:
                f = safe_open(path, framework="numpy")
            except FileNotFoundError:  # replaced or pruned by another run just now
                return None
            with f:
                meta = json.loads(f.metadata()["specjax"])
                if meta.get("format") != fmt:
                    raise ValueError(f"holds format {meta.get('format')!r}, not {fmt!r}")
                bf16 = {n for n, d in meta["dtypes"].items() if d == "bfloat16"}
                check(meta, {n: _Header(f.get_slice(n), n in bf16) for n in f.keys()})

                def read(name):
                    a = f.get_tensor(name)
                    return a.view(_bfloat16()) if name in bf16 else a
                result = take(meta, read) if take is not None else {n: read(n) for n in f.keys()}
        except Exception as e:  # SafetensorError, OSError, ValueError, KeyError, …: convert again
            self._drop(path, _oneline(e))
            return None
        return meta, result

    def put_params(self, fmt: str, arrays: dict, meta: dict) -> str | None:
        """Store ``{name: array}`` (numpy-convertible) and ``meta`` (JSON) as the conversion to
        ``fmt``. Returns the path, or ``None`` when not stored (too large, or a write error:
        one note line)."""
        import jax.numpy as jnp

        total = sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in arrays.values())
        if total > MAX_ENTRY_BYTES:
            return None
        path = self.params_path(fmt)
        dtypes = {name: "bfloat16" for name, a in arrays.items() if a.dtype == jnp.bfloat16}
        meta = dict(meta, format=fmt, dtypes=dtypes)

        def write(tmp):
            _write_safetensors(tmp, arrays, {"specjax": json.dumps(meta, sort_keys=True)})
        try:
            _atomic_write(path, write)
        except Exception as e:  # OSError (disk full, read-only), SafetensorError
            self.note(f"could not write the converted weights to {path} ({_oneline(e)}); the next load "
                      "converts again")
            return None
        self._prune(path)
        return path

    # ---------------------------------------------------------------- tokenizer
    def get_tokenizer(self):
        """The cached :class:`~specjax.io.tokenizer.Tokenizer` of a GGUF source, or ``None`` (no
        entry; or an unreadable one: deleted, one note line). Warnings the first build gave
        (e.g. a GGUF without ``tokenizer.ggml.pre``) are given again."""
        from specjax.io.tokenizer import Tokenizer

        path = self.tokenizer_path()
        try:
            with open(path, encoding="utf-8") as f:
                rec = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self._drop(path, _oneline(e))
            return None
        try:
            tok = Tokenizer.from_cache_dict(rec["tokenizer"])
            said = [str(w) for w in rec.get("warnings", [])]
        except Exception as e:  # KeyError, TypeError, ValueError, tokenizers' Exception: not an entry
            self._drop(path, _oneline(e))
            return None
        for w in said:
            warnings.warn(w, UserWarning, stacklevel=4)
        return tok

    def put_tokenizer(self, tok, said: list[str] = ()) -> str | None:
        """Store ``tok`` (and the warnings its build gave). Returns the path, or ``None``."""
        path = self.tokenizer_path()
        rec = {"tokenizer": tok.to_cache_dict(), "warnings": list(said)}
        try:
            _atomic_write(path, lambda tmp: _write_text(tmp, json.dumps(rec)))
        except (OSError, TypeError, ValueError):  # silent: the weights' entry says what failed
            return None
        self._prune(path)
        return path


_ST_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "int8": "I8", "uint8": "U8", "int16": "I16",
              "uint16": "U16", "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64", "bool": "BOOL"}


_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class _Header:
    """A stored tensor's ``shape`` and ``dtype`` (numpy; bfloat16 for a bfloat16 tensor) from its
    safetensors header, without reading it."""

    def __init__(self, sl, bf16: bool):
        self.shape = tuple(int(d) for d in sl.get_shape())
        self.dtype = _bfloat16() if bf16 else np.dtype(_ST_NAMES[sl.get_dtype()])


def _bfloat16():
    import jax.numpy as jnp

    return np.dtype(jnp.bfloat16)


def _write_safetensors(path: str, arrays: dict, metadata: dict) -> None:
    """``arrays`` (numpy or device arrays) as a safetensors file, one tensor at a time (no
    second copy of the whole model on the host, unlike ``safetensors.numpy.save_file``);
    bfloat16 as its uint16 bits. Readable by ``safetensors.safe_open``."""
    import jax.numpy as jnp

    header: dict = {"__metadata__": metadata}
    offset, order = 0, []
    for name, a in arrays.items():
        dt = np.dtype(np.uint16) if a.dtype == jnp.bfloat16 else np.dtype(a.dtype)
        n = int(np.prod(a.shape)) * dt.itemsize
        header[name] = {"dtype": _ST_DTYPES[dt.name], "shape": [int(d) for d in a.shape],
                        "data_offsets": [offset, offset + n]}
        order.append(name)
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in order:
            a = np.ascontiguousarray(np.asarray(arrays[name])).reshape(-1)
            f.write(a.view(np.uint8))  # its bytes (bfloat16: the same bits as uint16)


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def for_source(path: str) -> ConversionCache | None:
    """The cache of the checkpoint at ``path`` (a file or directory), or ``None`` when the
    cache is off (``SPECJAX_NO_CACHE``)."""
    return ConversionCache(path) if enabled() else None
