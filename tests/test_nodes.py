"""One DEP instance over two `lockstep serve` processes (nodes) on loopback: ranks in separate
processes keep in lockstep through the recursive-doubling all-reduce over TCP, the experts
shard over both nodes' runtimes (Gloo), an idle node is woken by the other's first frame, and
a node that dies takes the instance down with an error naming it, never a hang."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from servers import wait_healthy

ROOT = Path(__file__).resolve().parent.parent


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def two_nodes():
    http0, http1, link0, link1, dist = free_ports(5)
    common = ["--model", "tiny", "--dtype", "float64", "--dep", "2", "--nodes", "2",
              "--node-addresses", f"127.0.0.1:{link0},127.0.0.1:{link1}", "--dist-init", f"tcp://127.0.0.1:{dist}",
              "--num-blocks", "256", "--log-format", "json"]
    procs = [subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", *common, "--node-rank", str(i),
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                              start_new_session=True)
             for i, port in enumerate((http0, http1))]
    urls = [f"http://127.0.0.1:{p}" for p in (http0, http1)]
    try:
        for proc, url in zip(procs, urls):
            wait_healthy(proc, url, timeout=120)
        yield procs, urls
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def complete(url: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_node_dep_matches_one_rank_and_wakes_the_idle_node(two_nodes):
    from test_engine import reference_greedy  # the float64 tiny model, one sequence alone
    from lockstep.runtime.tokenizer import load_tokenizer

    _, urls = two_nodes
    tok = load_tokenizer("tiny")
    prompts = [[5, 6, 7, 8, 9], list(range(40, 77))]
    for url, p in zip(urls, prompts):  # one request at a time: the other node is idle each time
        text = complete(url, p, 10)
        assert text == tok.decode(reference_greedy(np.array(p), 10))


def test_a_dead_node_takes_the_instance_down_with_a_clear_error(two_nodes):
    procs, urls = two_nodes
    import threading

    result = {}

    def long_request():
        try:
            r = httpx.post(f"{urls[0]}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True})
            result["status"] = r.status_code
        except httpx.HTTPError as e:
            result["error"] = repr(e)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(2.0)
    os.killpg(procs[1].pid, signal.SIGKILL)
    procs[1].wait()
    t.join(30)
    assert not t.is_alive()  # no hang
    assert result.get("status") != 200
    assert procs[0].wait(30) != 0  # node 0 stops: the instance cannot go on without node 1
    log = procs[0].stdout.read().decode()
    assert "node(s) [1] gone" in log
