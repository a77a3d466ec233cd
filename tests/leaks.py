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


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def leaked_shm(before: set[str], prefix: str = "lockstep") -> set[str]:
    """Names under /dev/shm starting with ``prefix`` that appeared since ``before`` and whose
    maker is gone. ``make test`` runs test files in two worker processes at once, so a file
    whose maker still runs (``lockstep-ep-<pid>-...``: the peer exchange's) may be another
    worker's; one whose maker has exited, or that names none, was left behind."""
    out = set()
    for name in shm_names() - before:
        if not name.startswith(prefix):
            continue
        parts = name.split("-")
        pid = int(parts[2]) if len(parts) > 3 and parts[1] == "ep" and parts[2].isdigit() else None
        if pid is not None and os.path.exists(f"/proc/{pid}") and pid not in descendant_pids():
            continue  # (another worker's, alive)
        out.add(name)
    return out
