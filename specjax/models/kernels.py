"""Building and loading specjax's CPU kernels (XLA FFI custom calls, C++ sources shipped in this
package): the block int8 matmul (:mod:`specjax.models.q8`, ``q8block.cc``) and the attention over the
KV cache (:mod:`specjax.models.cpu_attention`, ``attention.cc``); both include ``cpu_pool.h``. The one
load path is :class:`Kernel` (build, ``ctypes`` load, FFI target registration, the note when it
fails, the background build); the kernel modules declare theirs and call it.

A kernel is compiled on first use with the system C++ compiler (``$CXX``, ``g++`` or ``c++``) into
``<cache dir>/kernels/<sha256 of its sources, the flags, the compiler and the jax version>/<lib>``
(not turned off by ``SPECJAX_NO_CACHE``: a build keyed by its source is not a measurement), atomically
(a temporary name, then ``os.replace``), so concurrent processes never load half a library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Callable

import jax

from specjax.core import env, notes
from specjax.core.paths import cache_dir

HERE = os.path.dirname(os.path.abspath(__file__))
HEADERS = ("cpu_pool.h",)  # included by every kernel source: part of each build's key
CXX_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off", "-Wno-attributes",
             "-Wno-ignored-attributes")


def compiler() -> str | None:
    """The C++ compiler to use (``$CXX``, ``g++``, ``c++``: the first found), or None."""
    for name in (env.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _compiler_id(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx


def _sources(source: str) -> bytes:
    parts = []
    for path in (source, *(os.path.join(HERE, h) for h in HEADERS)):
        with open(path, "rb") as f:
            parts.append(f.read())
    return b"\0".join(parts)


def _key(cxx: str, sources: bytes) -> str:
    h = hashlib.sha256()
    for part in (sources, " ".join(CXX_FLAGS).encode(), _compiler_id(cxx).encode(), jax.__version__.encode()):
        h.update(part + b"\0")
    return h.hexdigest()


def _compile(cxx: str, source: str, lib_name: str, out_dir: str) -> str:
    """Compile ``source`` into ``out_dir``/``lib_name`` atomically; returns the path. Raises
    RuntimeError (the compiler's error lines) / OSError."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, lib_name)
    fd, tmp = tempfile.mkstemp(prefix="." + lib_name + ".", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cxx, *CXX_FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{HERE}", source, "-o", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            err = " ".join(line for line in r.stderr.splitlines() if "error" in line)[:300]
            raise RuntimeError(f"{os.path.basename(cxx)} failed ({r.returncode}): {err or r.stderr[-300:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def buildable(source: str) -> bool:
    """Whether :func:`build` would compile ``source`` here (x86-64 Linux, a C++ compiler, the
    sources present), without building."""
    return (platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")
            and compiler() is not None and os.path.exists(source)
            and all(os.path.exists(os.path.join(HERE, h)) for h in HEADERS))


def build(source: str, lib_name: str) -> str:
    """The path of the compiled kernel ``lib_name`` from ``source``: reused from the cache
    directory, else compiled there (or, when it is not writable, into a temporary directory of this
    process). Raises RuntimeError with the reason when it cannot be built."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the kernel is for x86-64 Linux (this is {platform.system()} {platform.machine()})")
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ / c++ / $CXX) found")
    try:
        sources = _sources(source)
    except OSError as e:
        raise RuntimeError(f"kernel source missing: {e}") from None
    d = os.path.join(cache_dir(), "kernels", _key(cxx, sources))
    path = os.path.join(d, lib_name)
    if os.path.exists(path):
        return path
    try:
        return _compile(cxx, source, lib_name, d)
    except OSError:  # the cache is not writable: build for this process only
        return _compile(cxx, source, lib_name, tempfile.mkdtemp(prefix="specjax-kernels-"))


class BackgroundBuild:
    """A kernel's build and load on one daemon thread per process, so a cold start overlaps the
    compiler (seconds) with other work (loading the weights); the kernel module's ``load`` waits for
    it through its own lock. ``name``: the thread's name; ``load``: the module's build-and-load call."""

    def __init__(self, name: str, load: Callable[[], object]):
        self._name, self._load, self._thread = name, load, None

    def start(self, wanted: Callable[[], bool]) -> bool:
        """Start the thread unless one was started (then: whether it still runs) or ``wanted()`` is
        false (nothing to build here: loaded already, another backend, no compiler, switched off).
        Returns whether a thread was started (or one is running)."""
        if self._thread is not None:
            return self._thread.is_alive()
        if not wanted():
            return False
        self._thread = threading.Thread(target=self._load, daemon=True, name=self._name)
        self._thread.start()
        return True

    def is_alive(self) -> bool:
        """Whether the build thread is still running."""
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> None:
        """Wait for the build thread, if one was started (before the interpreter shuts down)."""
        if self._thread is not None:
            self._thread.join()


class Kernel:
    """One CPU kernel library: built by :func:`build` and loaded with :mod:`ctypes` once per process
    (thread-safe: a background build and the caller may ask at once: one build, one registration),
    its FFI handlers registered with XLA as CPU custom-call targets. When any step fails, one
    ``specjax: note:`` says why and what is used instead, and :meth:`load` is None for the process.

    source: the ``.cc`` file; lib_name: the library's file name; targets: ``{XLA target name:
    exported handler symbol}``; what: the kernel in words (the note's subject); fallback: what the
    caller uses instead (the note's end); thread: the background build thread's name."""

    def __init__(self, source: str, lib_name: str, targets: dict[str, str], what: str, fallback: str,
                 thread: str):
        self.source, self.lib_name, self.targets = source, lib_name, dict(targets)
        self.what, self.fallback = what, fallback
        self._lock = threading.Lock()
        self._result: tuple | None = None  # (library, None) or (None, reason), once tried
        self.builder = BackgroundBuild(thread, self.load)

    def _try_load(self) -> tuple:
        try:
            lib = ctypes.cdll.LoadLibrary(build(self.source, self.lib_name))
            for target, symbol in self.targets.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            return lib, None
        except Exception as e:  # noqa: BLE001  (any failure: the caller's fallback is used)
            reason = f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]
            notes.note(f"{self.what} is not available ({reason}); using {self.fallback}")
            return None, reason

    def _loaded(self) -> tuple:
        with self._lock:
            if self._result is None:
                self._result = self._try_load()
            return self._result

    def load(self):
        """The kernel's ctypes library (built, loaded and registered on the first call), or None."""
        return self._loaded()[0]

    def unavailable_reason(self) -> str | None:
        """Why the kernel cannot be used (None when it can)."""
        return self._loaded()[1]

    def tried(self) -> bool:
        """Whether :meth:`load` has run to its end in this process (loaded, or failed)."""
        return self._result is not None

    def buildable(self) -> bool:
        """:func:`buildable` for this kernel's source."""
        return buildable(self.source)

    def start_build(self, wanted: Callable[[], bool]) -> bool:
        """Build and load on a background thread (:class:`BackgroundBuild`) unless tried already,
        ``wanted()`` is false (the caller's conditions: the backend, a switch) or it is not
        :meth:`buildable` here. Returns whether a thread was started (or one is running)."""
        return self.builder.start(lambda: not self.tried() and wanted() and self.buildable())

    def join_build(self) -> None:
        """Wait for a :meth:`start_build` thread (before the interpreter shuts down)."""
        self.builder.join()
