"""`lockstep sim`: load a workload and a deployment, simulate, report."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import attrs
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lockstep.policy.config import ConfigError, SchedulerConfig
from lockstep.policy.deployment import CostSpec, Deployment, KVTransferSpec
from lockstep.policy.deployment_file import default_deployment, load_deployment

from .report import plot, print_table, write_json
from .simulator import Simulator
from .traces import TraceRequest, agentic_workload, read_trace


LONG_SPAN_S = 30 * 86400  # public traces span an hour to a week
RATE_SCALE = (1e-6, 1e6)  # beyond, a trace of seconds spans millennia or nanoseconds


def load_workload(trace: str | None, fmt: str, *, seed: int, rate_scale: float, limit: int | None,
                  skip_bad_rows: bool, console: Console) -> tuple[list[TraceRequest], str, int]:
    """(requests, the workload's name, bad rows skipped)."""
    if not (math.isfinite(rate_scale) and RATE_SCALE[0] <= rate_scale <= RATE_SCALE[1]):  # NaN arrivals hung the run
        raise ValueError(f"--rate-scale must be a number in [{RATE_SCALE[0]:g}, {RATE_SCALE[1]:g}] (x2: arrivals "
                         f"twice as dense), got {rate_scale}")
    if trace is None:
        reqs, name, skipped = agentic_workload(seed=seed), "synthetic agentic (built-in)", 0
    else:
        load = read_trace(trace, fmt, skip_bad_rows=skip_bad_rows)
        if load.skipped:
            console.print(f"[yellow]skipped {load.skipped} bad {'row' if load.skipped == 1 else 'rows'} of "
                          f"{escape(trace)}[/]")
        if load.out_of_order:  # replayed in time order, which a file out of order may not mean
            n = load.out_of_order
            console.print(f"[yellow]note: {n} {'row' if n == 1 else 'rows'} of {escape(trace)} "
                          f"{'is' if n == 1 else 'are'} stamped earlier than a row above; requests are replayed in "
                          "timestamp order (check the trace's timestamps if that is not what it means)[/]",
                          soft_wrap=True)
        reqs, name, skipped = load.requests, f"{Path(trace).name} ({load.format})", load.skipped
        span = reqs[-1].arrival_s - reqs[0].arrival_s
        if span > LONG_SPAN_S:  # a unit slip or a stray row, more likely than a trace of months
            gap, i = max((b.arrival_s - a.arrival_s, j) for j, (a, b) in enumerate(zip(reqs, reqs[1:])))
            console.print(f"[yellow]note: the arrivals of {escape(trace)} span {span / 86400:,.0f} days; the longest "
                          f"gap, {gap / 86400:,.1f} days, comes before line {reqs[i + 1].line} (check the trace's "
                          "timestamps if that is not what it means)[/]", soft_wrap=True)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        reqs = reqs[:limit]
    if rate_scale != 1.0:  # rate x2 = arrivals twice as dense
        reqs = [attrs.evolve(r, arrival_s=r.arrival_s / rate_scale) for r in reqs]
    return reqs, name, skipped


def with_spec_tokens(deployment: Deployment, k: int) -> Deployment:
    """The deployment with k drafts per decode (``--num-spec-tokens``); 0 drops the draft."""
    spec = deployment.speculative
    if k < 0:
        raise ConfigError(f"--num-spec-tokens must be >= 0 (0: no speculation), got {k}")
    if k == 0:
        return attrs.evolve(deployment, speculative=None)
    if spec is None:
        raise ConfigError(f"--num-spec-tokens {k}: {deployment.source} has no [speculative] table naming "
                          "a draft model (see examples/h200-v2lite-spec.toml)")
    try:
        return attrs.evolve(deployment, speculative=attrs.evolve(spec, num_spec_tokens=k))
    except ConfigError as e:  # (the flag's own way to turn speculation off, not the table's)
        why = str(e).replace("(to turn speculation off, drop the [speculative] table)", "(0: no speculation)")
        raise ConfigError(f"--num-spec-tokens {k}: {deployment.source}: [speculative]: {why}") from None


PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def check_outputs(args) -> None:
    """The flags that only matter at the end, checked before a run that may take minutes."""
    for flag in ("slo_ttft", "slo_tpot"):
        v = getattr(args, flag)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number of seconds > 0, got {v}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None or (flag == "--json" and path == "-"):  # (-: standard output)
            continue
        p = Path(path)
        if not path or p.is_dir():
            raise ValueError(f"{flag}: {path!r} is not a file path")
        parent = p.parent if str(p.parent) else Path(".")
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ValueError(f"{flag} {path}: directory {parent} does not exist or is not writable")
    inputs = [(flag, p) for flag, p in (("--trace", args.trace), ("--deployment", args.deployment),
                                        ("--profile", args.profile)) if p and Path(p).is_file()]
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and path != "-" and Path(path).exists():
            for given, src in inputs:
                if os.path.samefile(path, src):
                    raise ValueError(f"{flag} {path} is the {given} file: writing the report there would "
                                     "overwrite it; name another file")
    if args.plot is not None and Path(args.plot).suffix.lower() not in PLOT_FORMATS:
        raise ValueError(f"--plot {args.plot}: the file name must end in one of {', '.join(PLOT_FORMATS)}")


def unmodeled(deployment: Deployment, no_eplb: bool) -> list[str]:
    """What the deployment (or a flag) says that this run does not model: shown, never
    dropped silently (the engine reads the same file, so none of it is an error)."""
    notes, eplb, cost = [], deployment.eplb, deployment.cost
    if "hardware" in deployment.defaulted:
        notes.append(f"{deployment.source} has no [hardware] table: priced as the {deployment.hardware.name} "
                     "preset (give [hardware] preset = \"h200\" or \"gb300\", or its bandwidths)")
    skewed = cost.expert_skew > 0 and any(p.dep > 1 for p in deployment.pools)
    if not skewed and (eplb is not None or no_eplb):
        what = "[eplb]" if eplb is not None else "--no-eplb"
        notes.append(f"{what} changes nothing here: expert loads drift only with [cost] expert_skew > 0 on a DEP pool "
                     f"(without, the MoE is priced at expert_balancedness {cost.expert_balancedness})")
    if skewed and eplb is not None and (eplb.window_steps != 64 or eplb.token_split != "even"):
        notes.append(f"[eplb] window_steps and token_split are the engine's: the simulator re-plans every [cost] "
                     f"expert_window_s ({cost.expert_window_s} s) and splits tokens evenly")
    if not deployment.scheduler.async_scheduling:
        notes.append("[scheduler] async_scheduling = false: host work is priced serially ([host] overlap off); "
                     "arrivals still join steps as with async scheduling")
    if skewed and cost.expert_balancedness != CostSpec().expert_balancedness:
        notes.append(f"[cost] expert_balancedness ({cost.expert_balancedness}) is not used on the DEP pools: with "
                     "expert_skew > 0 their balancedness comes from the drifting expert loads")
    pd = any(p.role != "colocated" for p in deployment.pools)
    if not pd and deployment.kv_transfer != KVTransferSpec():
        notes.append("[kv_transfer] changes nothing here: it prices the prefill -> decode KV pulls of P/D pools, "
                     "and every pool is colocated")
    sched = deployment.scheduler
    for m in {deployment.model(p.model) for p in deployment.pools}:
        if SchedulerConfig().max_model_len != sched.max_model_len > m.context_length:
            notes.append(f"[scheduler] max_model_len ({sched.max_model_len}) exceeds model {m.name!r}'s "
                         f"context_length ({m.context_length}): its pools take at most {m.context_length} tokens")
    if deployment.hardware.host_kv_bytes > 0 and not sched.enable_prefix_caching:
        notes.append("[hardware] host_kv_bytes changes nothing here: the host tier keeps blocks the prefix cache "
                     "evicts, and enable_prefix_caching is false")
    served = sorted({p.model for p in deployment.pools})
    if len(served) > 1:
        notes.append(f"a trace names no model: its requests go to the pools of every model ({', '.join(served)}), "
                     "the least loaded whose context holds them; the report sums them all")
    spec = deployment.speculative
    if spec is not None and spec.replay and max(spec.replay) > spec.num_spec_tokens:
        notes.append(f"[speculative] file {spec.file}: counts above num_spec_tokens ({spec.num_spec_tokens}) count as "
                     f"{spec.num_spec_tokens} (the file's largest is {max(spec.replay)})")
    return notes


def flag_notes(deployment: Deployment, args) -> list[str]:
    """The same for flags that override a table this deployment does not act on."""
    notes = []
    pd = any(p.role != "colocated" for p in deployment.pools)
    if args.max_kv_loads is not None and not pd and deployment.hardware.host_kv_bytes == 0:
        notes.append("--max-kv-loads changes nothing here: KV loads are P/D pulls and host-tier loads, and this "
                     "deployment has neither")
    if args.trace is None:
        given = [f for f, on in (("--format", args.format != "auto"), ("--skip-bad-rows", args.skip_bad_rows)) if on]
        if given:
            many = len(given) > 1
            notes.append(f"{' and '.join(given)} {'change' if many else 'changes'} nothing here: "
                         f"{'they read' if many else 'it reads'} a --trace file, and the workload is the built-in "
                         "synthetic one")
    if args.num_spec_tokens == 0 and deployment.speculative is None:
        notes.append("--num-spec-tokens 0 changes nothing here: the deployment has no [speculative] table")
    return notes


def run_sim(args) -> int:
    check_outputs(args)
    console = Console(stderr=True)
    deployment: Deployment = load_deployment(args.deployment) if args.deployment else default_deployment()
    notes = flag_notes(deployment, args)
    if args.max_kv_loads is not None:
        if args.max_kv_loads < 0:
            raise ValueError(f"--max-kv-loads must be >= 0 (0: no cap), got {args.max_kv_loads}")
        deployment = attrs.evolve(deployment, scheduler=attrs.evolve(
            deployment.scheduler, max_kv_loads_per_step=args.max_kv_loads))
    if args.num_spec_tokens is not None:
        deployment = with_spec_tokens(deployment, args.num_spec_tokens)
    if args.profile:
        if not Path(args.profile).is_file():
            raise ConfigError(f"--profile {args.profile}: no such file (write it with `lockstep profile`)")
        deployment = attrs.evolve(deployment, cost=attrs.evolve(deployment.cost, profile=args.profile))
    seed = deployment.seed if args.seed is None else args.seed
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    for note in notes + unmodeled(deployment, args.no_eplb):
        console.print(f"[yellow]note: {escape(note)}[/]", soft_wrap=True)  # ([eplb] is not markup)
    workload, name, skipped = load_workload(args.trace, args.format, seed=seed, rate_scale=args.rate_scale,
                                   limit=args.limit, skip_bad_rows=args.skip_bad_rows, console=console)
    sim = Simulator(deployment, workload, seed=seed, slo_ttft=args.slo_ttft,
                    slo_tpot=args.slo_tpot, use_advance=not args.no_advance, eplb=not args.no_eplb,
                    profile_from=f"--profile {args.profile} (with {deployment.source})" if args.profile else None)
    show = len(workload) >= 2000 and sys.stderr.isatty()
    with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not show) as bar:
        task = bar.add_task("sim", total=len(workload))
        report = sim.run(progress=(lambda n: bar.update(task, completed=n)) if show else None)
    report["workload"] = name
    # what was asked for, so that the reports of a sweep tell themselves apart
    report["run"] = {"trace": args.trace, "format": args.format, "deployment": args.deployment,
                     "rate_scale": args.rate_scale, "limit": args.limit, "profile": args.profile,
                     "max_kv_loads": args.max_kv_loads, "num_spec_tokens": args.num_spec_tokens,
                     "no_eplb": args.no_eplb, "skip_bad_rows": args.skip_bad_rows}
    report["trace_rows_skipped"] = skipped  # bad rows --skip-bad-rows left out (never silently)
    # The files first: a reader of the table that stops early (`| head`) must not lose them.
    if args.json and args.json != "-":
        write_json(report, args.json)
    if args.plot:
        plot(sim.metrics.series(), args.plot, title=f"{name} on {deployment.name}")
    print_table(report, console if args.json == "-" else Console())  # (the JSON alone on stdout)
    if args.json == "-":
        write_json(report, args.json)
    for path in (args.json, args.plot):
        if path and path != "-":
            console.print(f"wrote {path}")
    return 0
