"""`specjax serve` start-up time, cold and warm (issue 31): seconds from the command to "listening"
(split as the server prints it: model load, warm-up compiles), then the first chat completion's
seconds, for a fresh cache directory (cold: no converted weights, no compiled programs) and the
same directory again (warm), side by side in one run.

    python benchmarks/serve_startup.py [--config smollm2-default] [--max-batch 8] [--runs 2] [-- EXTRA SERVE FLAGS]

Each run is a fresh process with ``SPECJAX_CACHE`` (compiled programs) and ``SPECJAX_CACHE_DIR``
(converted weights, measurements) under one temporary directory; the first run of the directory is
cold, the later ones warm. Prints one JSON line per run and the host's CPU flags.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from specjax.eval.hostcache import host_fingerprint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cache: str, args, extra: list[str]) -> dict:
    port = _free_port()
    env = dict(os.environ, SPECJAX_CACHE=os.path.join(cache, "jax"), SPECJAX_CACHE_DIR=os.path.join(cache, "specjax"))
    cmd = [sys.executable, "-m", "specjax.cli", "serve", "--config", args.config, "--port", str(port),
           "--max-batch", str(args.max_batch), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines, ready = [], threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(1800):
        proc.kill()
        raise SystemExit("server did not start:\n" + "".join(lines[-20:]))
    listening = time.perf_counter() - t0
    line = next(x for x in lines if "listening on" in x)
    load = re.search(r"model load ([\d.]+) s", line)
    warm = re.search(r"warm-up \(compiles\) ([\d.]+) s", line)
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
                       "messages": [{"role": "user", "content": "Write a haiku about the sea."}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    while True:  # "listening" is printed just before uvicorn binds the port
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
            break
        except OSError:
            time.sleep(0.05)
    listening = time.perf_counter() - t0
    t1 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        json.load(r)
    first = time.perf_counter() - t1
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(120)
    return dict(to_listening_s=round(listening, 1), model_load_s=float(load.group(1)) if load else None,
                warmup_s=float(warm.group(1)) if warm else None, first_completion_s=round(first, 2), exit=code)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="smollm2-default")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2)
    args, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    print(json.dumps({"host": host_fingerprint()}))
    with tempfile.TemporaryDirectory() as cache:
        for i in range(args.runs):
            res = _run(cache, args, extra)
            print(json.dumps(dict(run="cold" if i == 0 else "warm", config=args.config, max_batch=args.max_batch,
                                  extra=extra, **res)), flush=True)


if __name__ == "__main__":
    main()
