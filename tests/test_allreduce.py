"""The recursive-doubling all-reduce: the pure schedule, the shared-memory link between real
processes, the TCP link over loopback, rank death, and leaks."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.policy.allreduce import (OPS, CollectiveError, CollectiveTimeout, LocalCollective, RankFailed,
                                       check_values, num_rounds, schedule, simulate)
from lockstep.transports.collective_shm import ShmCollective, ShmGroup, send_group
from lockstep.transports import shm_rendezvous
from lockstep.transports.collective_tcp import TcpCollective, open_listener
from leaks import open_fds

I64 = st.integers(-(2**63), 2**63 - 1)
GUARD_S = 30  # a hang guard, not a timing assertion


@st.composite
def groups(draw, n=None):
    """(inputs per rank, op) for a group of ``n`` (or 1..9) ranks."""
    n = draw(st.integers(1, 9)) if n is None else n
    m = draw(st.integers(1, 16))
    inputs = [np.array(draw(st.lists(I64, min_size=m, max_size=m)), np.int64) for _ in range(n)]
    return inputs, draw(st.sampled_from(OPS))


@st.composite
def call_lists(draw):
    """Up to three successive calls of one group."""
    n = draw(st.integers(1, 9))
    return draw(st.lists(groups(n), min_size=1, max_size=3))


def reference(inputs, op):
    stack = np.stack(inputs)
    return stack.sum(axis=0) if op == "sum" else stack.max(axis=0)  # sums wrap like ours


# -- the pure schedule ----------------------------------------------------------------------------
@given(groups())
def test_every_rank_ends_with_the_exact_result(case):
    inputs, op = case
    for out in simulate(inputs, op):
        assert out.dtype == np.int64 and (out == reference(inputs, op)).all()


@pytest.mark.parametrize("n", range(1, 10))
def test_schedule_shape(n):
    p = 1 << (n.bit_length() - 1)
    for r in range(n):
        plan = schedule(r, n)
        rounds = [s.round for s in plan]
        assert rounds == sorted(set(rounds))  # one partner per round, in order
        for s in plan:  # my partner has the mirror step in the same round
            mirror = [t for t in schedule(s.peer, n) if t.round == s.round and t.peer == r]
            assert len(mirror) == 1 and (mirror[0].send, mirror[0].recv) == (s.recv, s.send)
        assert len(plan) == (2 if r >= p else (p.bit_length() - 1) + 2 * (r + p < n))
    assert num_rounds(n) == max((s.round for r in range(n) for s in schedule(r, n)), default=0) + (n != p)


def test_bad_input_is_refused_at_the_boundary():
    with pytest.raises(ValueError, match="1-D int64"):
        check_values(np.zeros(2, np.int32), "sum")
    with pytest.raises(ValueError, match="max of the negation"):
        check_values(np.zeros(2, np.int64), "min")
    with pytest.raises(ValueError, match="larger max_values"):
        check_values(np.zeros(17, np.int64), "max", 16)
    with pytest.raises(ValueError, match="not in a group"):
        schedule(3, 3)


def test_local_collective_is_the_identity():
    v = np.array([3, -1], np.int64)
    out = LocalCollective().allreduce(v, "max")
    assert (out == v).all() and out is not v
    assert (trio.run(LocalCollective().allreduce_async, v, "sum") == v).all()


# -- shared memory between real processes ---------------------------------------------------------
RANK_MAIN = """
import json, os, socket, sys, time
import numpy as np, trio
from lockstep.policy.allreduce import CollectiveError, RankFailed
from lockstep.transports.collective_shm import ShmCollective, recv_group

fd, rank, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
sock = socket.socket(fileno=fd)
fds_before = set(os.listdir("/proc/self/fd"))
coll = ShmCollective(recv_group(sock), rank)
calls = json.loads(sys.stdin.readline())
out = {"results": []}
try:
    for i, (op, per_rank, late) in enumerate(calls):
        if late == rank:
            time.sleep(0.2)  # long enough that the others stop spinning and sleep
        v = np.array(per_rank[rank], np.int64)
        if mode == "async":
            r = trio.run(coll.allreduce_async, v, op)
        else:
            r = coll.allreduce(v, op)
        out["results"].append(r.tolist())
        if mode == "stall" and i == 0:
            print("ready", flush=True)
            sys.stdin.readline()  # the victim waits here to be killed; the others go on
except RankFailed as e:
    out["failed"] = e.rank
coll.close()
out["fds_leaked"] = sorted(set(os.listdir("/proc/self/fd")) - fds_before)
print(json.dumps(out), flush=True)
"""




def start_ranks(n: int, mode: str) -> list[subprocess.Popen]:
    """n rank processes, each handed the group over its own Unix socket."""
    group = ShmGroup.create(n)
    procs = []
    try:
        for rank in range(n):
            mine, theirs = socket.socketpair()
            with mine, theirs:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", RANK_MAIN, str(theirs.fileno()), str(rank), mode],
                    pass_fds=[theirs.fileno()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
                group.register(rank, procs[-1].pid)
                send_group(mine, group)
    finally:
        group.close()  # the ranks hold their own copies
    return procs


def random_calls(n: int, seed: int, count: int = 40) -> list:
    rng = np.random.default_rng(seed)
    calls = []
    for i in range(count):
        m = int(rng.integers(1, 17))
        bound = 2**62 if i % 2 else 1000
        per_rank = rng.integers(-bound, bound, size=(n, m)).tolist()
        calls.append([OPS[i % 2], per_rank, (i // 2) % n if i in (5, 20) else -1])
    return calls


def give_calls(procs, calls) -> None:
    for p in procs:  # to all before reading any: each waits on the others
        p.stdin.write(json.dumps(calls) + "\n")
        p.stdin.flush()


def finish(procs) -> list[dict]:
    try:
        outs = [json.loads(p.communicate(timeout=GUARD_S)[0].strip().splitlines()[-1]) for p in procs]
        assert [p.returncode for p in procs] == [0] * len(procs)
        return outs
    finally:
        reap(procs)


def reap(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(GUARD_S)
        for f in (p.stdin, p.stdout):
            if not f.closed:
                f.close()


@pytest.mark.parametrize("n, mode", [(1, "sync"), (2, "sync"), (3, "async"), (5, "sync")])
def test_shm_between_processes_gives_every_rank_the_exact_result(n, mode):
    fds_before = open_fds()
    calls = random_calls(n, seed=n)
    procs = start_ranks(n, mode)
    give_calls(procs, calls)
    outs = finish(procs)
    for op, per_rank, _ in calls:
        expected = reference([np.array(v, np.int64) for v in per_rank], op).tolist()
        for out in outs:
            assert out["results"].pop(0) == expected
    assert all(out["fds_leaked"] == [] for out in outs)
    assert open_fds() == fds_before


@pytest.mark.parametrize("n, victim", [(4, 3), (5, 4), (3, 0)])
def test_a_killed_rank_is_named_by_every_survivor(n, victim):
    procs = start_ranks(n, "stall")
    try:
        give_calls(procs, random_calls(n, seed=7, count=3))
        for p in procs:
            assert p.stdout.readline().strip() == "ready"  # every rank made the first call
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(GUARD_S)
        survivors = procs[:victim] + procs[victim + 1:]
        for p in survivors:
            p.stdin.write("go on\n")
            p.stdin.flush()
        for out in finish(survivors):
            assert out["failed"] == victim and out["fds_leaked"] == []
    finally:
        reap(procs)


def test_shm_ranks_that_disagree_fail_clearly():
    """Two ranks of one process (threads): each sees the other's call does not match."""
    group = ShmGroup.create(2)
    first = ShmCollective(group, 0)
    second = ShmCollective(ShmGroup(os.dup(group.mem_fd), [os.dup(fd) for fd in group.event_fds], 2, 16), 1)
    errors = []

    def call(coll, values):
        try:
            coll.allreduce(values, "sum")
        except ValueError as e:
            errors.append(str(e))

    thread = threading.Thread(target=call, args=(second, np.zeros(1, np.int64)))
    thread.start()
    call(first, np.zeros(2, np.int64))
    thread.join(GUARD_S)
    assert len(errors) == 2 and all("same calls" in e for e in errors)
    with pytest.raises(CollectiveError, match="half done"):
        first.allreduce(np.zeros(2, np.int64), "sum")
    first.close()
    second.close()


def test_shm_refuses_mismatched_calls_and_a_closed_link():
    group = ShmGroup.create(1)
    coll = ShmCollective(group, 0)
    with pytest.raises(ValueError, match="larger max_values"):
        coll.allreduce(np.zeros(17, np.int64), "sum")
    assert (coll.allreduce(np.array([4], np.int64), "max") == [4]).all()
    coll.close()
    with pytest.raises(RuntimeError, match="closed"):
        coll.allreduce(np.array([4], np.int64), "max")


# -- TCP over loopback ------------------------------------------------------------------------------
async def tcp_group(n: int) -> list[TcpCollective]:
    listeners = [await open_listener() for _ in range(n)]
    addresses = [addr for _, addr in listeners]
    colls = [None] * n

    async def join(rank):
        colls[rank] = await TcpCollective.connect(rank, n, addresses, listeners[rank][0])

    async with trio.open_nursery() as nursery:
        for rank in range(n):
            nursery.start_soon(join, rank)
    for listener, _ in listeners:
        await listener.aclose()
    return colls


async def all_ranks(colls, fn) -> list:
    outs = [None] * len(colls)

    async def one(rank):
        try:
            outs[rank] = await fn(colls[rank], rank)
        except CollectiveError as e:
            outs[rank] = e

    async with trio.open_nursery() as nursery:
        for rank in range(len(colls)):
            nursery.start_soon(one, rank)
    return outs


async def test_tcp_round_whose_link_closes_under_it_fails_naming_the_node_it_left_for():
    """Another task (the node's sentry, a peer's failure notice) may make this rank leave the
    link while one of its rounds waits between a send and a receive: the round then fails
    with RankFailed naming the rank the link was left for (once a TypeError: a CI race)."""
    with trio.fail_after(GUARD_S):
        colls = await tcp_group(2)
        coll, inner = colls[0], colls[0]._send

        async def send_then_leave(peer, frame):
            await inner(peer, frame)
            coll.leave(dead=7)  # what the other task does at this checkpoint
        coll._send = send_then_leave
        with pytest.raises(RankFailed) as got:
            await coll.allreduce_async(np.array([1], np.int64), "sum")
        assert got.value.rank == 7
        for c in colls:
            c.close()


@settings(max_examples=12)
@given(call_lists())
def test_tcp_gives_every_rank_the_exact_result(cases):
    async def main():
        fds_before = open_fds()
        with trio.fail_after(GUARD_S):
            colls = await tcp_group(len(cases[0][0]))

            async def run(coll, rank):
                return [await coll.allreduce_async(inputs[rank], op) for inputs, op in cases]

            outs = await all_ranks(colls, run)
        for rank_out in outs:
            for got, (inputs, op) in zip(rank_out, cases):
                assert (got == reference(inputs, op)).all()
        for c in colls:
            c.close()
        assert open_fds() == fds_before

    trio.run(main)


async def test_tcp_a_rank_that_leaves_is_named():
    with trio.fail_after(GUARD_S):
        colls = await tcp_group(4)
        colls[2].close()

        async def run(coll, rank):
            if rank != 2:
                return await coll.allreduce_async(np.array([rank], np.int64), "sum")

        outs = await all_ranks(colls, run)
    for rank in (0, 1, 3):
        assert isinstance(outs[rank], RankFailed) and outs[rank].rank == 2
    for c in colls:
        c.close()


async def test_tcp_ranks_that_disagree_fail_clearly():
    with trio.fail_after(GUARD_S):
        colls = await tcp_group(2)

        async def run(coll, rank):
            try:
                await coll.allreduce_async(np.zeros(rank + 1, np.int64), "max")
            except ValueError as e:
                return e

        outs = await all_ranks(colls, run)
    assert all(isinstance(o, ValueError) and "same calls" in str(o) for o in outs)
    for c in colls:
        c.close()


TCP_RANK_MAIN = """
import json, sys
import numpy as np, trio
from lockstep.transports.collective_tcp import TcpCollective

rank, n, addresses = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])

async def main():
    coll = await TcpCollective.connect(rank, n, [tuple(a) for a in addresses])
    await coll.allreduce_async(np.array([rank], np.int64), "sum")
    print("ready", flush=True)
    await trio.sleep_forever()  # killed here

trio.run(main)
"""


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_tcp_a_killed_process_is_named(n):
    """The highest rank runs in its own process (it only dials, so needs no listener)."""
    victim = n - 1
    listeners = [await open_listener() for _ in range(victim)]
    addresses = [addr for _, addr in listeners] + [("127.0.0.1", 0)]
    proc = subprocess.Popen([sys.executable, "-c", TCP_RANK_MAIN, str(victim), str(n), json.dumps(addresses)],
                            stdout=subprocess.PIPE, text=True)
    try:
        with trio.fail_after(GUARD_S):
            colls = [None] * victim

            async def join(rank):
                colls[rank] = await TcpCollective.connect(rank, n, addresses, listeners[rank][0])

            async with trio.open_nursery() as nursery:
                for rank in range(victim):
                    nursery.start_soon(join, rank)

            async def run(coll, rank):
                await coll.allreduce_async(np.array([rank], np.int64), "sum")
                if rank == 0:
                    await trio.to_thread.run_sync(proc.stdout.readline)
                    proc.kill()
                return await coll.allreduce_async(np.array([rank], np.int64), "sum")

            outs = await all_ranks(colls, run)
        assert all(isinstance(o, RankFailed) and o.rank == victim for o in outs)
        for c in colls:
            c.close()
    finally:
        proc.kill()
        proc.wait(GUARD_S)
        proc.stdout.close()
        for listener, _ in listeners:
            await listener.aclose()


# -- joining by rendezvous, and idle ranks woken by a round a peer began ----------------------------

def unique_name(tag: str) -> bytes:
    return shm_rendezvous.abstract_name(f"test-{tag}-{os.getpid()}-{os.urandom(4).hex()}")


async def shm_group(n: int) -> list[ShmCollective]:
    name, colls = unique_name("join"), [None] * n

    async def join(rank):
        colls[rank] = await shm_rendezvous.join(rank, n, name, timeout_s=GUARD_S)

    async with trio.open_nursery() as nursery:
        for rank in reversed(range(n)):  # the dialers come first: they retry until rank 0 listens
            nursery.start_soon(join, rank)
    return colls


LINKS = {"shm": shm_group, "tcp": tcp_group}


@pytest.mark.parametrize("link", LINKS)
@pytest.mark.parametrize("n", [2, 3, 5, 6])
async def test_a_round_any_rank_begins_wakes_every_idle_rank(link, n):
    """Every rank but one idles in ``wait_posted``; the one begins a round alone. Whoever
    begins, the round's messages (and, for an extra rank of a non-power-of-two group, its
    partner's nudge) reach every idle rank, and all of them get the exact result."""
    fds_before = open_fds()
    with trio.fail_after(GUARD_S):
        colls = await LINKS[link](n)
        for first in range(n):
            async def run(coll, rank):
                if rank != first:
                    await coll.wait_posted()
                return await coll.allreduce_async(np.array([rank, first * rank], np.int64), "sum")

            outs = await all_ranks(colls, run)
            assert all(o.tolist() == [n * (n - 1) // 2, first * n * (n - 1) // 2] for o in outs)
        for c in colls:
            c.close()
    assert open_fds() == fds_before


async def test_shm_rendezvous_ignores_strays_and_refuses_a_second_host():
    fds_before = open_fds()
    name = unique_name("stray")
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            colls = [None, None]

            async def host():
                colls[0] = await shm_rendezvous.join(0, 2, name, timeout_s=GUARD_S)
            nursery.start_soon(host)
            strays = []  # one says nothing we know, one belongs to a group of another size
            for hello in (b"junk", shm_rendezvous._HELLO.pack(shm_rendezvous._MAGIC, 1, 3, os.getpid())):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                while s.connect_ex(name) != 0:
                    await trio.sleep(0.01)
                s.send(hello)
                strays.append(s)
            with pytest.raises(OSError, match="already hosts"):
                await shm_rendezvous.join(0, 2, name, timeout_s=GUARD_S)
            colls[1] = await shm_rendezvous.join(1, 2, name, timeout_s=GUARD_S)
        for s in strays:  # hung up on: nothing was handed to them
            assert s.recv(64) == b""
            s.close()
        outs = await all_ranks(colls, lambda c, r: c.allreduce_async(np.array([r + 1], np.int64), "max"))
        assert [o.tolist() for o in outs] == [[2], [2]]
        for c in colls:
            c.close()
    assert open_fds() == fds_before


async def test_shm_rendezvous_refuses_a_rank_in_another_pid_namespace():
    """A dialler whose own pid is not the one the kernel reports (another PID namespace, as in
    two containers sharing loopback) is refused, on both sides, with a message that says why."""
    fds_before = open_fds()
    name = unique_name("pidns")
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            async def host():
                with pytest.raises(CollectiveError, match="PID namespace.*'tcp'"):
                    await shm_rendezvous.join(0, 2, name, timeout_s=GUARD_S)
            nursery.start_soon(host)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            while s.connect_ex(name) != 0:
                await trio.sleep(0.01)
            s.send(shm_rendezvous._HELLO.pack(shm_rendezvous._MAGIC, 1, 2, os.getpid() + 1))
            await trio.lowlevel.wait_readable(s)
            assert s.recv(1024).startswith(b"refused: rank 1 is pid")
            s.close()
    assert open_fds() == fds_before


async def test_shm_rendezvous_names_a_host_that_hangs_up_or_never_comes():
    fds_before = open_fds()
    name = unique_name("hangup")
    with trio.fail_after(GUARD_S):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(name)
        listener.listen(1)
        async with trio.open_nursery() as nursery:
            async def hang_up():
                await trio.lowlevel.wait_readable(listener)
                conn, _ = listener.accept()
                conn.recv(64)
                conn.close()  # a host that dies before handing over the group
            nursery.start_soon(hang_up)
            with pytest.raises(RankFailed) as info:
                await shm_rendezvous.join(1, 2, name, timeout_s=GUARD_S)
            assert info.value.rank == 0
        listener.close()
        with pytest.raises(CollectiveTimeout) as late:  # nobody dials: the host names who is missing
            await shm_rendezvous.join(0, 3, unique_name("alone"), timeout_s=0.2)
        assert late.value.rank == 1
    assert open_fds() == fds_before


SHM_NODE_MAIN = """
import sys
import numpy as np, trio
from lockstep.transports import shm_rendezvous

rank, n, name = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])

async def main():
    coll = await shm_rendezvous.join(rank, n, name)
    await coll.allreduce_async(np.array([rank], np.int64), "sum")
    print("ready", flush=True)
    await trio.sleep_forever()  # killed here

trio.run(main)
"""


@pytest.mark.parametrize("idle", [False, True])
async def test_shm_rendezvous_a_killed_process_is_named(idle):
    """The last rank runs in its own process, joined by the rendezvous; once it is killed,
    the others fail naming it, whether waiting in a round or idle in ``wait_posted``."""
    fds_before = open_fds()
    n, name = 3, unique_name("kill")
    victim = n - 1
    proc = subprocess.Popen([sys.executable, "-c", SHM_NODE_MAIN, str(victim), str(n), name.hex()],
                            stdout=subprocess.PIPE, text=True)
    try:
        with trio.fail_after(GUARD_S):
            colls = [None] * victim

            async def join(rank):
                colls[rank] = await shm_rendezvous.join(rank, n, name)

            async with trio.open_nursery() as nursery:
                for rank in range(victim):
                    nursery.start_soon(join, rank)

            async def run(coll, rank):
                await coll.allreduce_async(np.array([rank], np.int64), "sum")
                if rank == 0:
                    await trio.to_thread.run_sync(proc.stdout.readline)
                    proc.kill()
                if idle:
                    await coll.wait_posted()  # the death itself wakes the rank that watches it
                return await coll.allreduce_async(np.array([rank], np.int64), "sum")

            outs = await all_ranks(colls, run)
        assert all(isinstance(o, RankFailed) and o.rank == victim for o in outs)
        assert colls[0].dead_peers() == [victim]
        for c in colls:
            c.close()
    finally:
        proc.kill()
        proc.wait(GUARD_S)
        proc.stdout.close()
    assert open_fds() == fds_before


# -- both links in one group: shared memory within each host, TCP between hosts ------------------
def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("layout", [(1, 2), (2, 1), (3, 2), (2, 2, 1)], ids=str)
async def test_mixed_gives_every_node_the_exact_result_and_names_a_leaver(layout):
    """Hosts 127.0.0.1, .2, .3 (all loopback here) with ``layout`` nodes each: sums and maxes
    of random int64s, extremes included, equal the reference on every node; then a node that
    leaves is named by every other node, on its host and on the others."""
    from lockstep.transports.collective_mixed import MixedCollective

    fds_before = open_fds()
    hosts = [f"127.0.0.{h + 1}" for h, count in enumerate(layout) for _ in range(count)]
    addresses = [(h, free_port(h)) for h in hosts]
    n = len(addresses)
    rng = np.random.default_rng(len(hosts))
    with trio.fail_after(GUARD_S):
        colls = [None] * n

        async def join(node):
            colls[node] = await MixedCollective.connect(node, addresses)

        async with trio.open_nursery() as nursery:
            for node in range(n):
                nursery.start_soon(join, node)
        cases = [([rng.integers(-(2**62), 2**62, 5) for _ in range(n)], op) for op in ("sum", "max", "sum")]
        cases.append(([np.array([np.iinfo(np.int64).min, 2**63 - 1], np.int64)] * n, "max"))

        async def run(coll, node):
            return [await coll.allreduce_async(inputs[node].astype(np.int64), op) for inputs, op in cases]

        outs = await all_ranks(colls, run)
        for node_out in outs:
            for got, (inputs, op) in zip(node_out, cases):
                assert (got == reference([i.astype(np.int64) for i in inputs], op)).all()
        gone = n - 1
        colls[gone].leave()

        async def after(coll, node):
            if node != gone:
                return await coll.allreduce_async(np.array([node], np.int64), "sum")

        outs = await all_ranks(colls, after)
    for node in range(n - 1):
        assert isinstance(outs[node], RankFailed) and outs[node].rank == gone, (node, outs[node])
    for c in colls:
        c.close()
    assert open_fds() == fds_before
