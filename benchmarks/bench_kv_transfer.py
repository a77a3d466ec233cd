"""KV transfer between two processes: tokens/s a decode process pulls from a prefill process.

A spawned prefill process holds a pool (one block = one contiguous span holding all layers)
and keeps polling its transport; this process pulls whole requests' blocks into its own pool.
Rows, all in one run, interleaved repeat by repeat so drifting background load hits all alike:
NIXL with one descriptor per contiguous run (P/D allocates runs, so a request is one run),
NIXL with one descriptor per block (blocks scattered on both sides, nothing merges), the
shared-memory transport, and the memcpy ceiling: numpy copies of the same runs inside this
process. Layouts: 890 B/token (the published compact layout) and DeepSeek-V2-Lite's MLA cache
in bf16 (27 layers x (512 + 64) x 2 B). Requests: prompts of 1K-8K tokens, all in flight.

vs_memcpy is the median over rounds of (memcpy ceiling's time / this row's time) in the same
round. On CPU both transports copy inside pull() (UCX reads by process_vm_readv in the post
call), so a wave's time is pull() + poll() for all its requests back to back.

Host-side costs per request, measured here too: the transport's pull() + poll() for a
one-block request, and the SchedulerCore's work for a remote-KV request (admitted as a KV
load, its completion applied, its last prompt token run, finished) in bursts of 16 and 256
arrivals; "capacity" is the mean prompt over that cost. tokens_per_s_serial_scheduler charges
the burst-of-256 cost on top of the transfer, as if one core did both (pessimistic: the
scheduler runs in its own process, beside the runtime that moves the bytes).

Target (issue 7): NIXL merged at 890 B/token >= 60% of the memcpy ceiling measured in the same
run, and >= 10x the published 440K tokens/s per GPU.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import at_least, emit  # noqa: E402

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs to stdout; keep the table clean

from lockstep.policy.config import SchedulerConfig
from lockstep.policy.core import SchedulerCore
from lockstep.policy.hashing import BlockHasher
from lockstep.policy.request import Request, SamplingParams
from lockstep.policy.step import StepResult
from lockstep.runtime.models.config import preset
from lockstep.transports.kv import nixl_transport, prefill_worker, recv_peer_info
from lockstep.transports.kv.base import block_runs, kv_bytes_per_token
from lockstep.transports.kv.prefill_worker import fill, make_transport, pattern

PUBLISHED = 440_000  # tokens/s per GPU, the published rack-scale figure
BLOCK_SIZES = (16, 64)
PROMPTS = (1024, 8192)
CEILING = "memcpy merged"
SCHED_BURSTS = (16, 256)  # remote-KV requests arriving at once


def layouts() -> list[tuple[str, int]]:
    return [("890 B/token", 890), ("v2-lite bf16", kv_bytes_per_token(preset("v2-lite"), "bfloat16"))]


class Prefill:
    """A spawned prefill process serving a pool, and the socket to it."""

    def __init__(self, kind: str, num_blocks: int, block_bytes: int):
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = mp.get_context("spawn").Process(
            target=prefill_worker.serve, args=(child, kind, num_blocks, block_bytes), daemon=True)
        self.proc.start()
        child.close()
        self.sock.settimeout(300)
        self.info = recv_peer_info(self.sock)

    def stop(self) -> None:
        self.sock.send(b"q")
        self.proc.join(30)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
        self.sock.close()


def requests(rng: np.random.Generator, lens: list[int], bs: int, pool_blocks: int, scattered: bool) -> list[tuple]:
    """(tokens, remote blocks, local blocks) per request: one run at a random place on each
    side, or blocks drawn at random on each side (so nothing merges)."""
    out = []
    for tokens in lens:
        nb = -(-tokens // bs)
        if scattered:
            remote = rng.choice(pool_blocks, nb, replace=False).astype(np.int32)
            local = rng.choice(pool_blocks, nb, replace=False).astype(np.int32)
        else:
            r0, l0 = rng.integers(0, pool_blocks - nb + 1, 2).tolist()
            remote = np.arange(r0, r0 + nb, dtype=np.int32)
            local = np.arange(l0, l0 + nb, dtype=np.int32)
        out.append((tokens, remote, local))
    return out


class Session:
    """Both transports connected to their prefill processes, for one layout and block size."""

    def __init__(self, bytes_per_token: int, bs: int, pool_bytes: int, n_req: int, seed: int):
        self.block_bytes = bytes_per_token * bs
        self.pool_blocks = pool_bytes // self.block_bytes
        if self.pool_blocks < -(-PROMPTS[1] // bs):
            raise SystemExit(f"--pool-mib too small for an {PROMPTS[1]}-token prompt at {self.block_bytes} B/block")
        self.rid = 0
        self.peers, self.locals, self.transports = {}, {}, {}
        kinds = ["shm"] + (["nixl"] if nixl_transport.available() else [])
        self.prefills = {k: Prefill(k, self.pool_blocks, self.block_bytes) for k in kinds}
        for k in kinds:
            t, pool = make_transport(k, f"decode-{k}", self.pool_blocks, self.block_bytes)
            pool[:] = 1  # fault the pages in before anything is timed
            self.transports[k], self.locals[k] = t, pool
            self.peers[k] = t.connect(self.prefills[k].info)
        self.src = np.empty((self.pool_blocks, self.block_bytes), np.uint8)
        fill(self.src)
        rng = np.random.default_rng(seed)
        lens = rng.integers(PROMPTS[0], PROMPTS[1] + 1, n_req).tolist()
        self.reqs = {s: requests(rng, lens, bs, self.pool_blocks, s) for s in (False, True)}
        self.runs = {s: [block_runs(r.tolist(), l.tolist()) for _, r, l in self.reqs[s]] for s in (False, True)}
        self.tokens = sum(lens)

    def modes(self) -> list[str]:
        out = [CEILING, "memcpy per block", "shm merged", "shm per block"]
        if "nixl" in self.transports:
            out += ["nixl merged", "nixl per block"]
        return out

    def wave(self, mode: str) -> float:
        """Seconds to move every request of the wave."""
        kind, how = mode.split(" ", 1)
        scattered = how == "per block"
        if kind == "memcpy":
            src, dst = self.src, self.locals["nixl" if "nixl" in self.locals else "shm"]
            t0 = time.perf_counter()
            for runs in self.runs[scattered]:
                for r0, l0, n in runs:
                    dst[l0 : l0 + n] = src[r0 : r0 + n]
            return time.perf_counter() - t0
        t, peer = self.transports[kind], self.peers[kind]
        reqs = self.reqs[scattered]
        first = self.rid
        self.rid += len(reqs)
        t0 = time.perf_counter()
        for i, (_, remote, local) in enumerate(reqs):
            t.pull(first + i, peer, remote, local)
        left = len(reqs)
        while left:
            done, failed = t.poll()
            if failed:
                raise RuntimeError(f"{mode}: pulls {failed} failed")
            left -= len(done)
        return time.perf_counter() - t0

    def per_request_s(self, kind: str, n: int) -> float:
        """Median seconds of pull() + poll() until done, for a one-block request."""
        t, peer = self.transports[kind], self.peers[kind]
        ts = []
        for i in range(n):
            self.rid += 1
            b = [i % self.pool_blocks]
            t0 = time.perf_counter()
            t.pull(self.rid, peer, b, b)
            while not t.poll()[0]:
                pass
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts[n // 10 :]))

    def verify(self, kind: str) -> None:
        """The pulled bytes are the prefill process's pattern (timed waves overlap, so one more pull)."""
        _, remote, local = self.reqs[True][0]
        self.rid += 1
        self.transports[kind].pull(self.rid, self.peers[kind], remote, local)
        while not self.transports[kind].poll()[0]:
            pass
        got = self.locals[kind][local.astype(np.int64)]
        want = np.concatenate([pattern(1, self.block_bytes, int(b)) for b in remote])
        if not np.array_equal(got, want):
            raise RuntimeError(f"{kind}: pulled bytes differ from the prefill pool")

    def close(self) -> None:
        for k, t in self.transports.items():
            self.locals[k] = None
            t.close()
        for p in self.prefills.values():
            p.stop()


def scheduler_us(n: int, seed: int) -> tuple[float, float]:
    """(start, whole life) SchedulerCore microseconds per remote-KV request, median of 5.

    start: schedule() + update() of the steps that admit the loads (4 per step, the default
    cap), before any completes. Whole life: a load reported done one step after it starts,
    then the last prompt token runs and samples (max_tokens=1), and the request finishes.
    """
    rng = np.random.default_rng(seed)
    lens = rng.integers(PROMPTS[0], PROMPTS[1] + 1, n)
    hasher = BlockHasher(b"bench", 16)
    prompts = [rng.integers(0, 32000, k, dtype=np.int32) for k in lens]
    hashed = [hasher.hash_prompt(p) for p in prompts]  # the frontend's work, not timed
    cfg = SchedulerConfig(num_blocks=int(sum(-(-k // 16) for k in lens)) * 2, max_num_seqs=n,
                          max_num_batched_tokens=8192, max_model_len=1 << 16)

    def core_with_requests() -> SchedulerCore:
        core = SchedulerCore(cfg, hasher)
        for i, (p, (h, acc)) in enumerate(zip(prompts, hashed)):
            core.add_request(Request(id=i, prompt=p, params=SamplingParams(max_tokens=1, ignore_eos=True),
                                     block_hashes=h, hash_acc=acc, remote_kv_tokens=len(p)))
        return core

    starts = [_drive(core_with_requests(), n, lag=None) / n for _ in range(5)]
    lives = [_drive(core_with_requests(), n, lag=1) / n for _ in range(5)]
    return float(np.median(starts)) * 1e6, float(np.median(lives)) * 1e6


def _drive(core: SchedulerCore, n: int, lag: int | None) -> float:
    """Seconds in schedule() + update() until all ``n`` loads started (``lag`` None: none
    completes), or until all ``n`` requests finished (each load done ``lag`` steps later)."""
    spent, started, finished, loading = 0.0, 0, 0, []
    while (started if lag is None else finished) < n:
        t0 = time.perf_counter()
        plan = core.schedule(0.0)
        spent += time.perf_counter() - t0
        done = loading.pop(0) if lag is not None and len(loading) >= lag else []
        ns = plan.samples.astype(np.int32)
        res = StepResult(plan.step_id, ns, np.zeros(int(ns.sum()), np.int32), kv_loads_done=np.asarray(done, np.int64))
        t0 = time.perf_counter()
        out = core.update(plan, res, 0.0)
        spent += time.perf_counter() - t0
        started += len(plan.kv_load_req_ids)
        finished += len(out.finished)
        loading.append(plan.kv_load_req_ids)
    return spent


def row(**kw) -> dict:
    out = {"layout": "-", "bytes_per_token": "-", "block_tokens": "-", "requests": "-", "mode": "-",
           "tokens_per_s": "-", "GB_per_s": "-", "vs_memcpy": "-", "x_published": "-", "us_per_request": "-",
           "tokens_per_s_serial_scheduler": "-"}
    out.update(kw)
    return out


def transfer_rows(lname: str, bpt: int, bs: int, args, sched_us: float, overhead: dict) -> list[dict]:
    """One row per mode for one layout and block size; fills ``overhead`` for the first config."""
    avg = (PROMPTS[0] + PROMPTS[1]) / 2 * bpt
    n_req = int(max(4, min(256, (args.wave_mib << 20) // avg)))
    s = Session(bpt, bs, args.pool_mib << 20, n_req, args.seed)
    try:
        modes = s.modes()
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(args.repeat + 1):  # round 0 warms up; the order rotates
            for m in modes[i % len(modes):] + modes[: i % len(modes)]:
                times[m].append(s.wave(m))
        for k in s.transports:
            s.verify(k)
            if not overhead.get(k):
                overhead[k] = s.per_request_s(k, 2000) * 1e6
    finally:
        s.close()
    ceiling = np.array(times[CEILING][1:])
    out = []
    for m in modes:
        t = np.array(times[m][1:])
        med = float(np.median(t))
        out.append(row(
            layout=lname, bytes_per_token=bpt, block_tokens=bs, requests=n_req, mode=m,
            tokens_per_s=s.tokens / med, GB_per_s=s.tokens * bpt / med / 1e9,
            vs_memcpy=float(np.median(ceiling / t)),  # paired by round: drifting load cancels out
            x_published=s.tokens / med / PUBLISHED, us_per_request=med / n_req * 1e6,
            tokens_per_s_serial_scheduler=s.tokens / (med + n_req * sched_us * 1e-6)))
    return out


def host_rows(overhead: dict, sched: dict) -> list[dict]:
    rows = [row(bytes_per_token=890, block_tokens=BLOCK_SIZES[0], requests=1, us_per_request=us,
                mode=f"{k}: pull() + poll() of a one-block request") for k, us in overhead.items()]
    for n, (start_us, whole_us) in sched.items():
        rows.append(row(block_tokens=16, requests=n, us_per_request=start_us,
                        mode=f"SchedulerCore, burst of {n}: start (schedule + update admitting the loads)"))
        rows.append(row(block_tokens=16, requests=n, us_per_request=whole_us,
                        tokens_per_s=sum(PROMPTS) / 2 / whole_us * 1e6,
                        mode=f"SchedulerCore, burst of {n}: whole life (start, complete, last token, finish)"))
    return rows


def print_kv_sizes() -> None:
    sizes = [f"{name} {dt} {kv_bytes_per_token(preset(name), dt, scale_bytes=sb)}"
             for name in ("tiny", "v2-lite") for dt, sb in (("float32", 0), ("bfloat16", 0), ("float8_e4m3fn", 4))]
    print("KV bytes per token, compact MLA layout [blocks, layers, block_size, kv_lora_rank + rope] "
          "(fp8 with a 4-byte scale per token and layer): " + "; ".join(sizes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=at_least(1), default=15, help="timed rounds (one wave per mode each)")
    ap.add_argument("--pool-mib", type=int, default=512, help="each pool (prefill and decode side)")
    ap.add_argument("--wave-mib", type=int, default=256, help="bytes moved per wave, roughly")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sched = {n: scheduler_us(n, args.seed) for n in SCHED_BURSTS}
    rows: list[dict] = []
    overhead: dict[str, float] = {}
    for lname, bpt in layouts():
        for bs in BLOCK_SIZES:
            rows += transfer_rows(lname, bpt, bs, args, sched[max(SCHED_BURSTS)][1], overhead)
    rows += host_rows(overhead, sched)
    print_kv_sizes()
    mode = "nixl merged" if nixl_transport.available() else "shm merged"
    head_rows = [r for r in rows if r["bytes_per_token"] == 890 and r["mode"] == mode]
    worst = min(head_rows, key=lambda r: r["tokens_per_s"])
    value = worst["tokens_per_s"]
    emit("bench_kv_transfer", rows, {
        "metric": f"KV pulled between two processes, {mode}, 890 B/token, the slower block size "
                  f"({worst['block_tokens']} tokens)", "unit": "tokens/s",
        "value": value, "baseline": {"name": "published rack-scale figure, 440K tokens/s per GPU (reference)",
                                     "value": PUBLISHED},
        "ratio": value / PUBLISHED,
        "target": ">= 60% of the memcpy ceiling measured in the same run and >= 10x 440K (4.4M) tokens/s, "
                  "both block sizes",
        # the target names NIXL: without it (not installed) the shared-memory figures stand in, unjudged
        "meets_target": all(r["vs_memcpy"] >= 0.6 and r["tokens_per_s"] >= 10 * PUBLISHED for r in head_rows)
        if mode == "nixl merged" else None,
    }, args.json)


if __name__ == "__main__":
    main()
