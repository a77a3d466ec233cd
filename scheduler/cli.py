"""The `lockstep` command: `sim` (replay a trace in virtual time), `generate` (stream one
answer from a model), `serve` (the OpenAI-compatible server), `bench serve` (load any
OpenAI-compatible endpoint) and `profile` (measure step times for the simulator)."""

from __future__ import annotations

import argparse
import errno
import sys


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported as one `error:` line, as every other bad input is
    (not the usage block first); ``--help`` still shows it all. Subcommands' parsers are of
    this class too (argparse makes them of their parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lockstep", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sim", help="replay a trace against a deployment in virtual time")
    s.add_argument("--trace", help="trace file (Mooncake JSONL or Azure CSV); default: synthetic agentic")
    s.add_argument("--format", default="auto", choices=["auto", "mooncake", "azure"],
                   help="trace format; auto: from the file's extension and first row")
    s.add_argument("--deployment", help="deployment TOML; default: the built-in (examples/default.toml)")
    s.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    s.add_argument("--limit", type=int, help="replay only the first N requests")
    s.add_argument("--seed", type=int,
                   help="seed of the synthetic workload, generated tokens and expert-load drift (default: the "
                        "deployment's seed, 0 in the built-in)")
    s.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT, seconds")
    s.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO on TPOT, seconds")
    s.add_argument("--json", metavar="PATH",
                   help="write the report as JSON (-: to standard output, the table then to standard error)")
    s.add_argument("--plot", metavar="PATH", help="write latency CDFs, throughput and KV use as PNG")
    s.add_argument("--skip-bad-rows", action="store_true", help="skip malformed trace rows (counted)")
    s.add_argument("--no-advance", action="store_true", help="step one by one (for checking)")
    s.add_argument("--max-kv-loads", type=int, metavar="N",
                   help="override [scheduler] max_kv_loads_per_step: new KV loads (P/D pulls, "
                        "host-tier loads) a rank starts per step; 0 = no cap")
    s.add_argument("--num-spec-tokens", type=int, metavar="K",
                   help="override [speculative] num_spec_tokens: drafts per decode step; 0 = no "
                        "speculation (the same deployment without its draft model), to ask whether "
                        "speculation pays at this load")
    s.add_argument("--no-eplb", action="store_true",
                   help="keep the naive expert placement even if the deployment has [eplb] "
                        "(with [cost] expert_skew > 0: compare balancedness with the balancer off)")
    s.add_argument("--profile", metavar="FILE",
                   help="override [cost] profile: price steps from this measured profile (lockstep "
                        "profile) instead of the analytic model")
    from lockstep import bench_serve, generate_cli, profile_cli, serve_cli

    generate_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    bench_serve.add_parser(sub)
    profile_cli.add_parser(sub)
    p.allow_abbrev = False
    for parser in _subparsers(p):  # every command's help shows its defaults
        parser.formatter_class = _Defaults
        parser.allow_abbrev = False  # (--n must not be taken for --num-spec-tokens)
    return p


class _Defaults(argparse.HelpFormatter):
    """Help lines end with the default, where there is one to tell (not None, False or [])."""

    def _get_help_string(self, action):
        text, d = action.help or "", action.default
        # identity, not ==: a default of 0 is one to tell (0 == False)
        untold = d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, (str, list)) and not d)
        if "%(default)" not in text and action.option_strings and not untold:
            text += " (default: %(default)s)"
        return text


def _subparsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser below ``p`` (``bench serve`` is two levels down)."""
    out = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                out += [child, *_subparsers(child)]
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse; an unknown flag is reported by the command it was given to, with the closest
    flags it has (argparse reports it from the top level, with the top-level usage)."""
    import difflib

    p = _parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        cmd = p
        for name in (args.command, getattr(args, "bench", None)):
            subs = [a for a in cmd._actions if isinstance(a, argparse._SubParsersAction)]
            if name is None or not subs or name not in subs[0].choices:
                break
            cmd = subs[0].choices[name]
        flags = [o for a in cmd._actions for o in a.option_strings]
        hints = [m for x in extra if x.startswith("-") for m in difflib.get_close_matches(x.split("=")[0], flags, 1)]
        cmd.error(f"unrecognized arguments: {' '.join(extra)}"
                  + (f" (did you mean {', '.join(dict.fromkeys(hints))}?)" if hints else ""))
    args.given = _given(argv)
    return args


def _given(argv: list[str] | None) -> frozenset[str]:
    """The flags given on the command line (their dests), whatever their values: a flag given
    at its default value is still given (serve --deployment refuses what the file decides)."""
    p, unset = _parser(), object()
    for parser in [p, *_subparsers(p)]:
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and action.option_strings:
                # (append actions start from None: argparse copies a list default before appending)
                action.default = None if isinstance(action, argparse._AppendAction) else unset
    parsed, _ = p.parse_known_args(argv)
    return frozenset(k for k, v in vars(parsed).items() if v is not unset and v is not None)


def main(argv: list[str] | None = None) -> int:
    """The command's exit status; Ctrl-C ends it with 130 and no traceback (its resources are
    released on the way out, as on any exit)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BaseExceptionGroup as eg:  # trio's tasks' interrupts arrive grouped, with what they
        # caused elsewhere (a request failed by the engine's shutdown): the interrupt decides
        if eg.split(KeyboardInterrupt)[0] is not None:
            print(file=sys.stderr)
            return 130
        raise
    finally:  # nothing of the command outlives it (its runtimes are gone by now)
        if "lockstep.engine.runtime_client" in sys.modules:
            sys.modules["lockstep.engine.runtime_client"].stop_forkserver()


def _main(argv: list[str] | None) -> int:
    args = _parse(argv)
    if args.command == "sim":
        from lockstep.policy.config import ConfigError
        from lockstep.sim.run import run_sim
        from lockstep.sim.traces import TraceFormatError

        try:
            return run_sim(args)
        except (ConfigError, TraceFormatError, ValueError, NotImplementedError) as e:
            print(f"lockstep sim: error: {e}", file=sys.stderr)
            return 2
        except BrokenPipeError:  # the table's reader stopped early (`| head`): the files are written
            return 1
        except OSError as e:  # a missing or unreadable file
            print(f"lockstep sim: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
            return 2
    module, fn, label = _COMMANDS[args.command]
    return _run(module, fn, label, args)


_COMMANDS = {  # command -> (module, function, name in error messages)
    "generate": ("lockstep.generate_cli", "run_generate", "generate"),
    "serve": ("lockstep.serve_cli", "run_serve", "serve"),
    "bench": ("lockstep.bench_serve", "run_bench", "bench serve"),
    "profile": ("lockstep.profile_cli", "run_profile", "profile"),
}


_AS_FLAG = {"engine.eplb": "redundant_experts", "eplb.redundant_experts": "redundant_experts"}


def _in_flags(message: str, label: str, args) -> str:
    """An engine error in the words the command line used: ``engine.dep`` as ``--dep`` (the
    fields the flags set), for serve and generate without --deployment (whose errors name
    the file's fields, as they should)."""
    import re

    if label not in ("serve", "generate") or getattr(args, "deployment", None):
        return message
    given = vars(args)

    def flag(m: re.Match) -> str:
        dest = _AS_FLAG.get(m[0], m[2])
        return "--" + dest.replace("_", "-") if dest in given else m[0]

    return re.sub(r"\b(engine|scheduler|eplb)\.(\w+)", flag, message)


def _run(module: str, fn: str, label: str, args) -> int:
    """Bad input ends the command with one line naming it and exit status 2."""
    from importlib import import_module

    from lockstep.engine.runtime_client import RuntimeDied
    from lockstep.policy.config import ConfigError
    from lockstep.policy.request import RequestError
    from lockstep.sim.traces import TraceFormatError

    handled = (ConfigError, RequestError, TraceFormatError, ValueError, OSError)
    try:
        return getattr(import_module(module), fn)(args)
    except handled as e:
        print(f"lockstep {label}: error: {_in_flags(str(e), label, args)}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as eg:  # trio wraps what a task raised: one bad input is still one line
        from lockstep.engine.node_group import InstanceLost

        lost, rest = eg.split(InstanceLost)
        if lost is not None and rest is None:  # every local rank of a node says so: once
            first = lost
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            print(f"lockstep {label}: error: {first}", file=sys.stderr)
            return 1
        leaf = eg
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        # Only input errors, and a port or address that cannot be bound: anything else raised
        # inside the engine (a runtime's broken pipe, a bug's ValueError) keeps its traceback.
        bind = isinstance(leaf, OSError) and leaf.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)
        # A runtime that could not start (its model failed to load, or took too long) is said
        # in its own words: its message carries the runtime's traceback where it has one.
        start = isinstance(leaf, RuntimeDied) and label in ("serve", "generate")
        if not (isinstance(leaf, (ConfigError, RequestError, TraceFormatError)) or bind or start):
            raise
        message = str(leaf)
        from lockstep.engine import runtime_client
        if start and runtime_client._STDERR_SINK is not None and "Traceback" in message:
            message = message.splitlines()[0].rstrip(":") + " (its traceback is in the log)"  # an event there
        print(f"lockstep {label}: error: {_in_flags(message, label, args)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
