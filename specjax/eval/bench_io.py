"""``specjax bench``'s inputs and outputs (part of :mod:`specjax.eval.bench`, which re-exports
them): prompt selection (``--categories``, ``--limit``, ``--split`` files), batches that never mix
categories, ``--out`` checks before the work, atomic JSON, and the machine the run was on."""

from __future__ import annotations

import json
import os
import platform
from typing import Any, Sequence


def split_categories(values: Sequence[str] | str | None) -> list[str] | None:
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    out = [c.strip() for v in values for c in v.split(",") if c.strip()]
    return out or None


def select_prompts(prompts: list[dict], categories: Sequence[str] | str | None, limit: int | None) -> list[dict]:
    """Keep ``categories`` and at most ``limit`` prompts per category, in file order.

    Raises:
      UsageError: ``limit < 1``, an unknown category (lists the known ones), nothing left.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    want = split_categories(categories)
    if want:
        have = sorted({p["category"] for p in prompts})
        unknown = [c for c in want if c not in have]
        if unknown:
            raise ValueError(f"--categories: unknown {unknown}; the prompts file has {have}")
        prompts = [p for p in prompts if p["category"] in want]
    if limit is not None:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            n = seen.get(p["category"], 0)
            if n < limit:
                kept.append(p)
                seen[p["category"]] = n + 1
        prompts = kept
    if not prompts:
        raise ValueError("no prompts left after --categories/--limit")
    return prompts


def filter_split(prompts: list[dict], spec: str | None) -> list[dict]:
    """Keep the prompts whose ``question_id`` is listed under PART of the split file
    ``spec = "FILE[:PART]"`` (PART defaults to ``eval``). A bare name (``spec_bench_split.json``)
    is also looked up among the configs shipped with specjax.

    Raises:
      UsageError: unreadable file, unknown PART, prompts without ``question_id``, nothing kept.
    """
    if not spec:
        return prompts
    path, _, part = spec.partition(":")
    part = part or "eval"
    if not os.path.exists(path):
        from importlib import resources

        shipped = resources.files("specjax.shipped_configs") / os.path.basename(path)
        if not shipped.is_file():
            raise ValueError(f"--split: no such file: {path}")
        path = str(shipped)
    try:
        with open(path, encoding="utf-8-sig") as f:
            split = json.load(f)
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())
        raise ValueError(f"--split: cannot read {path} as JSON ({why})") from None
    if not isinstance(split, dict) or not isinstance(split.get(part), list):
        parts = sorted(k for k, v in split.items() if isinstance(v, list)) if isinstance(split, dict) else []
        if not parts:
            raise ValueError(f"--split: {path} is not a split file; expected a JSON object of question-id lists, "
                         "e.g. {\"train\": [1, 2], \"eval\": [3]}")
        raise ValueError(f"--split: {path} has no list {part!r}; it has {parts} (use FILE:PART, e.g. {path}:{parts[0]})")
    ids = {i for i in split[part] if isinstance(i, (int, str))}
    kept = [p for p in prompts if p["question_id"] in ids]
    if not kept:
        raise ValueError(f"--split: none of the prompts has a question_id in {path}:{part}")
    return kept


def make_batches(prompts: Sequence[dict], batch_size: int) -> list[list[int]]:
    """Indices of ``prompts`` in batches of at most ``batch_size``; a batch never mixes
    categories (so per-category times are exact); categories in order of first appearance."""
    by_cat: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_cat.setdefault(p["category"], []).append(i)
    out = []
    for idx in by_cat.values():
        out.extend(idx[s:s + batch_size] for s in range(0, len(idx), batch_size))
    return out


def check_out_path(path: str | None, force: bool) -> None:
    if path and os.path.isdir(path):  # before the --force hint: --force cannot help here
        raise ValueError(f"--out {path} is a directory; give a file name (e.g. {os.path.join(path, 'results.json')})")
    if path and os.path.exists(path) and not force:
        raise ValueError(f"--out {path} exists; choose another file or pass --force to overwrite it")


def check_writable(path: str | None, flag: str = "--out", create: bool = True) -> None:
    """Fail now, not after the work, when ``path`` cannot be written: create its parent
    directory (``create``; else a missing one is refused), open and remove a temporary file
    there (directories it created for a failed check are removed again).

    Raises:
      UsageError: naming the path and why (a file in the way, a missing directory, permission denied, …).
    """
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    created = []
    probe = os.path.join(d, f".specjax-write-check-{os.getpid()}")
    try:
        cur = d
        while not os.path.exists(cur):
            created.append(cur)
            cur = os.path.dirname(cur)
        if not os.path.isdir(cur):
            raise ValueError(f"{flag} {path}: {cur} is a file, not a directory; choose another path")
        if created and not create:
            raise ValueError(f"{flag} {path}: the directory {d} does not exist; create it first (mkdir -p {d}) or "
                             "give a path in an existing directory")
        os.makedirs(d, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        for c in created:
            try:
                os.rmdir(c)
            except OSError:
                pass
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror or e}); choose a writable path") from None


def write_json(path: str, obj: Any, force: bool) -> None:
    """Write ``obj`` to ``path`` atomically; refuses an existing file unless ``force``."""
    check_out_path(path, force)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=json_default)
        f.write("\n")
    if not force and os.path.exists(path):  # appeared meanwhile: keep what the user wrote
        os.remove(tmp)
        raise ValueError(f"--out {path} appeared while the benchmark ran; results not written (pass --force)")
    os.replace(tmp, path)


def json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def peak_rss_bytes() -> int:
    """This process's peak resident set since it started its program, in bytes (``VmHWM`` of
    ``/proc/self/status``); 0 where there is no ``/proc``.

    Not ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux carries that across ``fork`` + ``execve``, so
    a subprocess started by a large process (a pytest worker holding several models) reports its
    parent's peak — both memory gates once read a 9.0 GiB pytest worker instead of their own
    2 GiB. ``VmHWM`` belongs to the address space, which ``execve`` replaces.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = round(int(f.readline().split()[1]) / 1e6, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import jax

        info["jax"] = jax.__version__
        info["devices"] = [str(d) for d in jax.devices()]
        info["backend"] = jax.default_backend()
    except Exception as e:  # pragma: no cover - reported, not fatal
        info["jax_error"] = str(e)
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except ImportError:  # pragma: no cover
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        info["specjax"] = version("specjax")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        info["specjax"] = "unknown"
    return info
