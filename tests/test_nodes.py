"""One DEP instance over two `lockstep serve` processes (nodes) on loopback: ranks in separate
processes keep in lockstep through the recursive-doubling all-reduce, over either link
(shared memory, which "auto" picks on one host, or TCP), the experts shard over both nodes'
runtimes (Gloo), an idle node is woken by the other's first message, and a node that dies
takes the instance down with an error naming it, never a hang. The same at the level of
``NodeGroup`` in this process, where fds and processes are counted."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio
from leaks import open_fds
from servers import wait_healthy

from lockstep.engine.config import EngineConfig
from lockstep.engine.node_group import InstanceLost, NodeGroup, choose_link
from lockstep.policy.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
GUARD_S = 60  # a hang guard, not a timing assertion
LINKS = ("tcp", "shm")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def session_pids(sid: int) -> set[int]:
    """Live processes of session ``sid`` (a node started with start_new_session and its runtimes)."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.add(int(pid))
    return out


def node_commands(link: str, *extra: str) -> tuple[list[list[str]], list[str]]:
    """The `lockstep serve` command of each of two nodes of one DEP2 instance, and their URLs."""
    http0, http1, link0, link1, dist = free_ports(5)
    common = ["--model", "tiny", "--dtype", "float64", "--dep", "2", "--nodes", "2",
              "--node-addresses", f"127.0.0.1:{link0},127.0.0.1:{link1}", "--dist-init", f"tcp://127.0.0.1:{dist}",
              "--node-link", link, "--num-blocks", "256", "--log-format", "json", *extra]
    cmds = [[sys.executable, "-m", "lockstep.cli", "serve", *common, "--node-rank", str(i), "--port", str(port)]
            for i, port in enumerate((http0, http1))]
    return cmds, [f"http://127.0.0.1:{p}" for p in (http0, http1)]


def start_node(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


@contextlib.contextmanager
def nodes_running(link: str, *extra: str):
    """Two nodes serving; yields (processes, URLs, commands); every process is killed after."""
    cmds, urls = node_commands(link, *extra)
    procs = [start_node(c) for c in cmds]
    try:
        for proc, url in zip(procs, urls):
            wait_healthy(proc, url, timeout=120)
        yield procs, urls, cmds
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(params=LINKS)
def two_nodes(request):
    with nodes_running(request.param) as (procs, urls, _):
        yield procs, urls, request.param


def complete(url: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_node_dep_matches_one_rank_and_wakes_the_idle_node(two_nodes):
    from test_engine import reference_greedy  # the float64 tiny model, one sequence alone
    from lockstep.runtime.tokenizer import load_tokenizer

    _, urls, _ = two_nodes
    tok = load_tokenizer("tiny")
    prompts = [[5, 6, 7, 8, 9], list(range(40, 77))]
    for url, p in zip(urls, prompts):  # one request at a time: the other node is idle each time
        text = complete(url, p, 10)
        assert text == tok.decode(reference_greedy(np.array(p), 10))


@pytest.mark.parametrize("link", LINKS)
def test_a_lost_node_that_never_returns_stops_the_instance_with_a_clear_error(link):
    """With a short rejoin timeout: node 1 is killed and not restarted, so node 0 fails the
    request in flight, waits for node 1 to rejoin, and stops naming it."""
    with nodes_running(link, "--node-rejoin-timeout", "2") as (procs, urls, _):
        lost_node_stops_node_0(procs, urls, link)


def lost_node_stops_node_0(procs, urls, link):
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
    assert "node(s) [1] gone" in log and "did not all rejoin within 2 s" in log
    assert joined_link(log) == link
    for _ in range(GUARD_S * 10):  # node 0's runtimes go with it (a bounded wait, not a timing check)
        if not session_pids(procs[0].pid):
            break
        time.sleep(0.1)
    assert not session_pids(procs[0].pid)


@pytest.mark.parametrize("link", LINKS)
def test_a_lost_node_restarted_by_its_supervisor_rejoins_and_the_instance_serves_again(link):
    """Node 1 is killed with a request in flight and started again (as its supervisor
    would): node 0 fails that request, keeps running, and once node 1 is back the instance
    gives the reference greedy tokens on both nodes again."""
    from test_engine import reference_greedy
    from lockstep.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    with nodes_running(link) as (procs, urls, cmds):
        with httpx.Client(timeout=120) as client:
            pending = threading.Thread(target=lambda: client.post(f"{urls[0]}/v1/completions", json={
                "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True}))
            pending.start()
            time.sleep(1.0)
            os.killpg(procs[1].pid, signal.SIGKILL)
            procs[1].wait()
            pending.join(60)
            assert not pending.is_alive()
            procs[1] = start_node(cmds[1])
            wait_healthy(procs[1], urls[1], timeout=120)
            for url, prompt in zip(urls, ([5, 6, 7, 8, 9], list(range(40, 77)))):
                assert complete(url, prompt, 10) == tok.decode(reference_greedy(np.array(prompt), 10))
        assert procs[0].poll() is None  # node 0 never stopped
        log = kill_and_read_log(procs[0])
    assert "node(s) [1] gone" in log and "waiting for every node to rejoin" in log
    assert sum('"DEP nodes joined"' in line for line in log.splitlines()) == 2


def test_a_runtime_death_restarts_every_node_of_the_instance():
    """A runtime process of node 1 dies (its node lives): both nodes fail their requests,
    restart their runtimes, join a fresh link, and serve the reference tokens again."""
    from test_engine import reference_greedy
    from lockstep.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    with nodes_running("tcp") as (procs, urls, _):
        node1 = procs[1].pid
        runtimes = [p for p in session_pids(node1) if p != node1 and parent(p) != node1]
        assert runtimes, "no runtime process found under node 1"
        os.kill(runtimes[0], signal.SIGKILL)
        prompt = [5, 6, 7, 8, 9]
        want = tok.decode(reference_greedy(np.array(prompt), 10))
        for _ in range(GUARD_S * 2):  # requests fail while the instance restarts (a bounded wait)
            r = httpx.post(f"{urls[0]}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
            if r.status_code == 200:
                break
            time.sleep(0.5)
        assert complete(urls[0], prompt, 10) == want and complete(urls[1], prompt, 10) == want
        assert all(p.poll() is None for p in procs)
        log = kill_and_read_log(procs[0])
    assert "waiting for every node to rejoin" in log
    assert sum('"DEP nodes joined"' in line for line in log.splitlines()) == 2


def test_four_nodes_on_two_hosts_over_both_links_match_one_rank():
    """`lockstep serve` DEP4 as four node processes, two on each of two "hosts" (127.0.0.1
    and 127.0.0.2), joined by the mixed link: every node gives the reference greedy tokens."""
    from test_engine import reference_greedy
    from lockstep.runtime.tokenizer import load_tokenizer

    ports = free_ports(9)
    http, links, dist = ports[:4], ports[4:8], ports[8]
    addresses = ",".join(f"127.0.0.{1 if i < 2 else 2}:{p}" for i, p in enumerate(links))
    common = ["--model", "tiny", "--dtype", "float64", "--dep", "4", "--nodes", "4", "--node-addresses", addresses,
              "--dist-init", f"tcp://127.0.0.1:{dist}", "--node-link", "mixed", "--num-blocks", "256",
              "--log-format", "json"]
    procs = [start_node([sys.executable, "-m", "lockstep.cli", "serve", *common, "--node-rank", str(i),
                         "--port", str(port)]) for i, port in enumerate(http)]
    tok = load_tokenizer("tiny")
    try:
        urls = [f"http://127.0.0.1:{port}" for port in http]
        for proc, url in zip(procs, urls):
            wait_healthy(proc, url, timeout=120)
        for i, url in enumerate(urls):
            prompt = [5 + i, 6, 7, 8, 9]
            assert complete(url, prompt, 10) == tok.decode(reference_greedy(np.array(prompt), 10))
    finally:
        logs = [kill_and_read_log(p) for p in procs]
    assert [joined_link(log) for log in logs] == ["mixed"] * 4


def kill_and_read_log(proc: subprocess.Popen) -> str:
    """Kill a node (and its runtimes) and return everything it logged."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return proc.stdout.read().decode()


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def joined_link(log: str) -> str:
    """The link a node says it joined with."""
    for line in log.splitlines():
        if line.startswith("{") and '"DEP nodes joined"' in line:
            return json.loads(line)["link"]
    raise AssertionError(f"the node never said which link it joined with:\n{log}")


# -- NodeGroup in this process: the link rule, both links, wake, death, leaks ----------------------
def test_auto_takes_shared_memory_only_when_every_node_is_on_one_host():
    assert choose_link("auto", [("127.0.0.1", 1), ("localhost", 2), ("::1", 3), ("127.0.0.2", 4)]) == "shm"
    assert choose_link("auto", [("10.0.0.5", 1), ("10.0.0.5", 2)]) == "shm"
    assert choose_link("auto", [("node-a", 1), ("node-a", 2)]) == "shm"
    assert choose_link("auto", [("10.0.0.5", 1), ("10.0.0.6", 2)]) == "tcp"
    assert choose_link("auto", [("127.0.0.1", 1), ("10.0.0.6", 2)]) == "tcp"
    assert choose_link("auto", [("node-a", 1), ("node-a", 2), ("node-b", 3)]) == "mixed"
    assert choose_link("tcp", [("127.0.0.1", 1), ("127.0.0.1", 2)]) == "tcp"
    assert choose_link("shm", [("a", 1), ("b", 2)]) == "shm"  # the operator knows best
    with pytest.raises(ConfigError, match="engine.node_link must be 'auto', 'tcp', 'shm' or 'mixed'.*'udp'"):
        EngineConfig(node_link="udp")


async def start_groups(nursery, groups) -> None:
    async with trio.open_nursery() as starting:  # together: each waits for the other to join
        for g in groups:
            starting.start_soon(nursery.start, g.run)


@pytest.mark.parametrize("link", LINKS)
async def test_node_groups_agree_wake_each_other_and_release_everything(link):
    fds_before = open_fds()
    addresses = [("127.0.0.1", p) for p in free_ports(2)]
    groups = [NodeGroup(1, i, addresses, "tcp://127.0.0.1:1", link=link) for i in range(2)]
    assert [g.link_kind for g in groups] == [link, link]
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await start_groups(nursery, groups)
            outs = [None, None]

            async def late(i):  # node 1 comes late: a slow peer is waited for, not failed
                if i:
                    await trio.sleep(0.3)
                outs[i] = await groups[i].allreduce(0, np.array([i, -i], np.int64))

            async def idle_then_join(i):  # node 1 idles: node 0's round alone must wake it
                if i:
                    await groups[i].wait_woken(seen)
                outs[i] = await groups[i].allreduce(0, np.array([5 * i, 3 - i], np.int64))

            for rnd, expected in ((late, [1, 0]), (idle_then_join, [5, 3])):
                seen = groups[1].wake_gen
                async with trio.open_nursery() as both:
                    for i in range(2):
                        both.start_soon(rnd, i)
                assert [o.tolist() for o in outs] == [expected, expected]
            assert groups[1].wake_gen > seen
            nursery.cancel_scope.cancel()
    assert open_fds() == fds_before


NODE_MAIN = """
import json, sys
import numpy as np, trio
from lockstep.engine.node_group import NodeGroup

addresses, link = json.loads(sys.argv[1]), sys.argv[2]
node = int(sys.argv[3]) if len(sys.argv) > 3 else 1

async def main():
    group = NodeGroup(1, node, [tuple(a) for a in addresses], "tcp://127.0.0.1:1", link=link)
    async with trio.open_nursery() as nursery:
        await nursery.start(group.run)
        await group.allreduce(0, np.array([1], np.int64))
        print("ready", flush=True)
        await trio.sleep_forever()  # killed here

trio.run(main)
"""


@pytest.mark.parametrize("idle", [False, True], ids=["in-round", "idle"])
@pytest.mark.parametrize("link", LINKS)
async def test_a_killed_node_fails_the_group_naming_it(link, idle):
    """Node 1 runs in its own process and is SIGKILLed. Node 0 fails with ``InstanceLost``
    naming node 1, whether it was in a round or idle (the death wakes it), and releases
    every fd; no process is left."""
    fds_before = open_fds()
    addresses = [("127.0.0.1", p) for p in free_ports(2)]
    proc = subprocess.Popen([sys.executable, "-c", NODE_MAIN, json.dumps(addresses), link], stdout=subprocess.PIPE,
                            text=True)
    group = NodeGroup(1, 0, addresses, "tcp://127.0.0.1:1", link=link)
    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(group.run)
                assert (await group.allreduce(0, np.array([0], np.int64))).tolist() == [1]
                line = ""
                while line != "ready\n":  # after its log lines
                    line = await trio.to_thread.run_sync(proc.stdout.readline)
                    assert line, "node 1 exited before its first round"
                seen = group.wake_gen
                proc.kill()
                proc.wait()
                if idle:
                    await group.wait_woken(seen)
                async with trio.open_nursery() as ranks:
                    ranks.start_soon(group.cancel_on_failure, ranks.cancel_scope)
                    await group.allreduce(0, np.array([0], np.int64))
                    raise AssertionError("a round with a dead node completed")
                nursery.cancel_scope.cancel()
        assert isinstance(group.failure, InstanceLost) and "node(s) [1] gone" in str(group.failure)
    finally:
        proc.kill()
        proc.wait(GUARD_S)
        proc.stdout.close()
    assert open_fds() == fds_before


@pytest.mark.parametrize("link", LINKS)
async def test_a_local_failure_names_the_peer_node_whose_death_caused_it(link):
    """Node 0's runtime fails first (its all-to-all lost node 1's runtime); node 1's engine
    process dies a moment later. The failure waits for that death to show and names node 1."""
    fds_before = open_fds()
    addresses = [("127.0.0.1", p) for p in free_ports(2)]
    proc = subprocess.Popen([sys.executable, "-c", NODE_MAIN, json.dumps(addresses), link], stdout=subprocess.PIPE,
                            text=True)
    group = NodeGroup(1, 0, addresses, "tcp://127.0.0.1:1", link=link)
    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(group.run)
                await group.allreduce(0, np.array([0], np.int64))
                group.fail(RuntimeError("runtime of rank 0 died: its all-to-all lost a peer"))
                assert group.failure is None  # held: a peer may be dying
                proc.kill()
                proc.wait()  # blocks the loop: by the time the grace is judged, the death shows
                await group.cancel_on_failure(nursery.cancel_scope)
        assert isinstance(group.failure, InstanceLost)
        assert "node(s) [1] gone" in str(group.failure) and "all-to-all lost a peer" in str(group.failure)
    finally:
        proc.kill()
        proc.wait(GUARD_S)
        proc.stdout.close()
    assert open_fds() == fds_before


@pytest.mark.parametrize("link", LINKS)
async def test_a_purely_local_failure_stops_the_peers_too(link):
    """With every peer alive, a local failure is committed after the grace, as itself, and
    the node leaves the link: the peer's next round fails naming it."""
    fds_before = open_fds()
    addresses = [("127.0.0.1", p) for p in free_ports(2)]
    groups = [NodeGroup(1, i, addresses, "tcp://127.0.0.1:1", link=link) for i in range(2)]
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await start_groups(nursery, groups)
            groups[0].fail(RuntimeError("runtime of rank 0 died"))
            async with trio.open_nursery() as ranks:
                ranks.start_soon(groups[1].cancel_on_failure, ranks.cancel_scope)
                await groups[1].allreduce(0, np.array([1], np.int64))
            await groups[0].cancel_on_failure(nursery.cancel_scope)
    assert str(groups[0].failure) == "runtime of rank 0 died"
    assert isinstance(groups[1].failure, InstanceLost) and "node(s) [0] gone" in str(groups[1].failure)
    assert open_fds() == fds_before


# -- both links in one instance: shared memory within each host, TCP between hosts ------------------
# Two "hosts" on this machine: 127.0.0.1 and 127.0.0.2 (Linux routes all of 127/8 to loopback).
def two_hosts(ports: list[int]) -> list[tuple[str, int]]:
    return [("127.0.0.1" if i < len(ports) // 2 else "127.0.0.2", p) for i, p in enumerate(ports)]


async def test_mixed_link_agrees_wakes_and_releases_everything():
    """Four nodes, two per host: every round's result is the max over all four, whichever
    node starts it; a node idling on another host is woken by the round (over TCP to its
    host's first node, then shared memory); everything is released after."""
    fds_before = open_fds()
    addresses = two_hosts(free_ports(4))
    groups = [NodeGroup(1, i, addresses, "tcp://127.0.0.1:1", link="mixed") for i in range(4)]
    assert choose_link("auto", addresses) == "shm"  # all loopback: one machine
    rng = np.random.default_rng(3)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await start_groups(nursery, groups)
            # Nodes that idle until a round wakes them; (2, 3): the whole second host, which
            # only the TCP message to its first node can reach.
            for idle in ((), (3,), (1,), (2,), (2, 3)):
                values = rng.integers(-1000, 1000, (4, 3))
                outs = [None] * 4
                seen = [g.wake_gen for g in groups]

                async def one(i):
                    if i in idle:
                        await groups[i].wait_woken(seen[i])
                    outs[i] = await groups[i].allreduce(0, values[i].astype(np.int64))

                async with trio.open_nursery() as nodes:
                    for i in range(4):
                        nodes.start_soon(one, i)
                assert all(o.tolist() == values.max(0).tolist() for o in outs)
            assert all(g.link.inter is not None for g in (groups[0], groups[2]))
            assert groups[1].link.inter is None and groups[3].link.inter is None
            nursery.cancel_scope.cancel()
    assert open_fds() == fds_before




@pytest.mark.parametrize("idle", [False, True], ids=["in-round", "idle"])
@pytest.mark.parametrize("dead", [3, 2], ids=["second-node-of-a-host", "first-node-of-a-host"])
async def test_mixed_link_names_a_dead_node_on_another_host(dead, idle):
    """Node ``dead`` (on the second host) runs in its own process and is SIGKILLed. Every
    other node, on both hosts, fails with ``InstanceLost`` naming it: a death seen on one
    link is passed on over the other, not reported as the messenger's. Idle, the nodes learn
    it outside any round (the node that sees it leaves both links naming the dead one)."""
    fds_before = open_fds()
    addresses = two_hosts(free_ports(4))
    proc = subprocess.Popen([sys.executable, "-c", NODE_MAIN, json.dumps(addresses), "mixed", str(dead)],
                            stdout=subprocess.PIPE, text=True)
    alive = [i for i in range(4) if i != dead]
    groups = {i: NodeGroup(1, i, addresses, "tcp://127.0.0.1:1", link="mixed") for i in alive}
    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                async with trio.open_nursery() as starting:
                    for g in groups.values():
                        starting.start_soon(nursery.start, g.run)
                async with trio.open_nursery() as first:
                    for g in groups.values():
                        first.start_soon(g.allreduce, 0, np.array([0], np.int64))
                line = ""
                while line != "ready\n":
                    line = await trio.to_thread.run_sync(proc.stdout.readline)
                    assert line, "the node process exited before its first round"
                seen = {i: g.wake_gen for i, g in groups.items()}
                proc.kill()
                proc.wait()

                async def doomed(g):
                    async with trio.open_nursery() as ranks:
                        ranks.start_soon(g.cancel_on_failure, ranks.cancel_scope)
                        if idle:
                            await g.wait_woken(seen[g.node])
                        await g.allreduce(0, np.array([0], np.int64))
                        raise AssertionError("a round with a dead node completed")

                async with trio.open_nursery() as rounds:
                    for g in groups.values():
                        rounds.start_soon(doomed, g)
                nursery.cancel_scope.cancel()
        for i, g in groups.items():
            assert isinstance(g.failure, InstanceLost), (i, g.failure)
            assert f"node(s) [{dead}] gone" in str(g.failure), (i, str(g.failure))
    finally:
        proc.kill()
        proc.wait(GUARD_S)
        proc.stdout.close()
    assert open_fds() == fds_before


@pytest.mark.parametrize("link", LINKS)
async def test_a_node_that_never_joins_ends_the_start_naming_the_missing_ones(link):
    """Within the start timeout (--start-timeout), not a fixed 60 s, and as InstanceLost naming
    the addresses that never came (it read as a peer stuck outside an all-reduce)."""
    fds_before = open_fds()
    addresses = [("127.0.0.1", p) for p in free_ports(2)]
    group = NodeGroup(1, 0, addresses, "tcp://127.0.0.1:1", link=link, join_timeout_s=0.5)
    with trio.fail_after(GUARD_S):
        with pytest.RaisesGroup(pytest.RaisesExc(InstanceLost, match=rf"127.0.0.1:{addresses[1][1]}\) did not all "
                                                                     r"join within 0.5 s \(--start-timeout\)")):
            async with trio.open_nursery() as nursery:
                await nursery.start(group.run)
    assert open_fds() == fds_before


@pytest.mark.parametrize("link", LINKS)
async def test_nodes_started_with_different_settings_are_refused_when_they_join(link):
    """A node started with another dtype (say) used to join, then crash its runtimes on
    every step; the join compares a digest of the settings (EngineConfig.settings_digest)."""
    base = EngineConfig(dep=2, nodes=2, node_rank=0, node_addresses=("127.0.0.1:7011", "127.0.0.1:7012"),
                        dist_init="tcp://127.0.0.1:7110")
    same = attrs_evolve(base, node_rank=1)
    assert base.settings_digest() == same.settings_digest()
    assert base.settings_digest() != attrs_evolve(same, dtype="float64").settings_digest()
    addresses = [("127.0.0.1", p) for p in free_ports(2)]
    digests = [base.settings_digest(), attrs_evolve(same, dtype="float64").settings_digest()]
    groups = [NodeGroup(1, i, addresses, "tcp://127.0.0.1:1", link=link, digest=digests[i]) for i in range(2)]
    with trio.fail_after(GUARD_S):
        with pytest.raises(BaseExceptionGroup) as e:  # one node's or both (the first cancels the other)
            async with trio.open_nursery() as nursery:
                await start_groups(nursery, groups)
    leaves = _leaves(e.value)
    assert leaves and all(isinstance(x, InstanceLost) and "started with different settings" in str(x)
                          for x in leaves), leaves


def _leaves(eg):
    return [y for x in eg.exceptions for y in (_leaves(x) if isinstance(x, BaseExceptionGroup) else [x])]


def attrs_evolve(config, **kw):
    import attrs
    return attrs.evolve(config, **kw)


async def test_a_node_that_goes_again_during_the_settings_round_is_waited_for():
    """A rejoin whose settings round fails (the restarted node crashed again) is retried
    while the rejoin timeout lasts, as a failed connect is (it used to end the engine)."""
    from lockstep.policy.allreduce import RankFailed

    class Link:
        def __init__(self, fail: bool):
            self.fail, self.closed = fail, False

        async def allreduce_async(self, values, op):
            if self.fail:
                raise RankFailed(1, "rank 1 broke its connection")
            return values

        def close(self):
            self.closed = True

    links = [Link(True), Link(False)]
    group = NodeGroup(1, 0, [("127.0.0.1", 1), ("127.0.0.1", 2)], "tcp://127.0.0.1:1", link="tcp",
                      rejoin_timeout_s=30)

    async def connect(timeout_s=60.0):
        return links.pop(0)
    group._connect = connect
    with trio.fail_after(GUARD_S):
        await group._relink()
    assert group.link is not None and not group.link.fail and group._lost is None and not links
