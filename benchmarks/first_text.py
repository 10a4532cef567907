"""Seconds from the command's start to the first byte of text: the README's quick start (issue 26).

Runs the quick-start command (read from README.md, so the benchmark follows the README) as a user's
shell would, in a child process, and times the first byte of generated text on its standard output;
the progress lines on standard error are timestamped as they arrive, so each phase's share is printed
too. ``--cold N`` runs N more times with empty caches (fresh ``SPECJAX_CACHE_DIR`` and
``SPECJAX_CACHE``: the GGUF conversion, the int8 kernel's build and XLA's compilation all happen), the
warm runs share one cache directory that a first (unreported) run fills.

    python benchmarks/first_text.py --warm 3 --cold 2

Measure on an idle machine: the figure is mostly single-threaded start-up work (imports, reading the
cached programs) that any other load stretches. The CPU flags and the load average are printed with it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx2", "fma")


def quick_start_command() -> list[str]:
    """The ``specjax generate ...`` part of the README's first command, as argv."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"&& (specjax generate [^\n]*)\n", text)
    if m is None:
        raise SystemExit("README.md has no `... && specjax generate ...` quick-start line")
    return shlex.split(m.group(1))


def cpu_flags() -> str:
    try:
        have = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    except (OSError, AttributeError):
        return "unknown"
    return " ".join(f for f in FLAGS if f in have)


def run_once(argv: list[str], env: dict) -> dict:
    """One run: ``first_text_s``, ``total_s`` and the progress lines as ``(seconds, text)``."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tempfile.gettempdir())
    lines: list[tuple[float, str]] = []

    def read_err():
        for raw in p.stderr:
            lines.append((time.perf_counter() - t0, raw.decode(errors="replace").rstrip()))

    th = threading.Thread(target=read_err, daemon=True)
    th.start()
    first = p.stdout.read(1)
    t_first = time.perf_counter() - t0
    rest = p.stdout.read()
    rc = p.wait()
    th.join()
    if rc != 0 or not first:
        raise SystemExit(f"the command failed (exit {rc}):\n" + "\n".join(x for _, x in lines[-10:]))
    return {"first_text_s": t_first, "total_s": time.perf_counter() - t0, "lines": lines,
            "text": (first + rest).decode(errors="replace")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", type=int, default=3, help="warm runs reported (after one unreported run)")
    ap.add_argument("--cold", type=int, default=0, help="runs with empty caches")
    ap.add_argument("--show-phases", action="store_true", help="print each run's progress lines with their times")
    a = ap.parse_args(argv)
    cmd = quick_start_command()
    print(f"command: {shlex.join(cmd)}")
    print(f"cpu flags: {cpu_flags()}; {os.cpu_count()} cores; load average before: {os.getloadavg()[0]:.2f}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="first-text-") as tmp:
        warm_env = dict(os.environ, SPECJAX_CACHE_DIR=f"{tmp}/warm", SPECJAX_CACHE=f"{tmp}/warm/jax")
        if a.warm:
            run_once(cmd, warm_env)  # fills the warm caches
        for i in range(a.warm):
            rows.append(("warm", run_once(cmd, warm_env)))
        for i in range(a.cold):
            env = dict(os.environ, SPECJAX_CACHE_DIR=f"{tmp}/cold{i}", SPECJAX_CACHE=f"{tmp}/cold{i}/jax")
            rows.append(("cold", run_once(cmd, env)))
    for kind, r in rows:
        print(f"{kind}: first text {r['first_text_s']:.2f} s, whole command {r['total_s']:.2f} s")
        if a.show_phases:
            for t, line in r["lines"]:
                print(f"    {t:6.2f}  {line[:150]}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
