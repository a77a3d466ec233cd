"""Leak counting for the process-level tests: open fds and child processes of this process,
read from /proc (tests count resources; they never time them)."""

import os


def open_fds() -> set:
    """Open fds with what they point at."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except FileNotFoundError:  # the listing's own fd, closed by now
            pass
    return out


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def child_pids() -> set[int]:
    """Live children of this process (zombies included until reaped)."""
    me, out = os.getpid(), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                    out.add(int(pid))
        except OSError:
            pass
    return out


def descendant_pids() -> set[int]:
    """Live processes below this one at any depth (runtime processes are children of the
    forkserver, itself a child of this process)."""
    parent: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            pass
    out, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out
