"""``specjax serve`` as a process (issue 31): the command line starts (start-up times on stderr),
serves, and on SIGTERM during load stops accepting, lets the requests in flight finish or cancels
them within ``--shutdown-timeout``, and exits 0 without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import jax
import pytest

import serve_helpers as H

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SHUTDOWN_S = 1.5
EXIT_BOUND_S = SHUTDOWN_S + 20.0  # the graceful window, the engine thread's stop and the interpreter's exit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from specjax.io.loading import save_model

    return save_model(H.tiny_target(), str(tmp_path_factory.mktemp("serve") / "tiny-serve"))


def _start(model_dir, port, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               SPECJAX_NO_PROGRESS="1",
               SPECJAX_CACHE=jax.config.jax_compilation_cache_dir)  # the test session's compilation cache (conftest)
    env.pop("SPECJAX_DEBUG", None)
    cmd = [sys.executable, "-m", "specjax.cli", "serve", "--model", model_dir, "--draft", "ngram", "--gamma", "3",
           "--port", str(port), "--max-batch", "2", "--max-context", "512", "--max-new-tokens", "16",
           "--shutdown-timeout", str(SHUTDOWN_S), "--spec-max-running", "1", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _wait_healthy(proc, url, limit=180):
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}): {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not become healthy")


def test_sigterm_during_load_exits_0_without_traceback(model_dir):
    port = H.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(model_dir, port)
    try:
        _wait_healthy(proc, url)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-serve", "prompt": "w5 w6 w7", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # 20 sampled streams of 480 tokens on 2 slots (few drafts accepted): far more work than the graceful window
        # (≈ 10 s here; SIGTERM comes as soon as both slots stream)
        first_chunks = threading.Semaphore(0)
        outcomes = []

        def stream_one(i):
            body = {"model": "tiny-serve", "prompt": f"w{5 + i} w6 w7", "max_tokens": 480, "stream": True,
                    "ignore_eos": True, "temperature": 1.5, "seed": i}
            finish, done, first = None, False, True
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            if first:
                                first = False
                                first_chunks.release()
                            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
                        done = done or line == "data: [DONE]"
                outcomes.append(finish if done else "no [DONE]")
            except httpx.TransportError:  # connected while the listening socket closed: never served
                outcomes.append("refused")

        threads = [threading.Thread(target=stream_one, args=(i,), daemon=True) for i in range(20)]
        for t in threads:
            t.start()
        for _ in range(2):  # both slots are streaming
            assert first_chunks.acquire(timeout=60)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"no exit within {EXIT_BOUND_S} s of SIGTERM")
        took = time.time() - t0
        err = proc.stderr.read()
        assert proc.returncode == 0, err
        assert "Traceback" not in err, err
        assert took < EXIT_BOUND_S
        assert "model load" in err and "warm-up (compiles)" in err and "stopped" in err, err
        for t in threads:
            t.join(30)
        assert len(outcomes) == 20  # every client got an end, none hangs
        # whole streams ("length") or streams ended by the shutdown ("cancelled"), never a broken stream; the
        # shutdown did cut requests in flight (this was not an idle server)
        assert set(outcomes) <= {"length", "cancelled", "refused"}, outcomes
        assert "cancelled" in outcomes, outcomes
        assert took >= SHUTDOWN_S - 0.5  # ... after the graceful window, not before
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
