"""`lockstep serve`: start the runtime, wait until it is ready, then serve the OpenAI API.

On SIGTERM (or SIGINT) the server stops accepting connections (a request that still
arrives on an open one gets a 503), lets in-flight requests finish for up to
``--drain-timeout`` seconds, then stops the engine: the runtime process exits and its shared
memory goes with it. A second signal stops at once; one while the engines load stops that.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import signal
import sys

import attrs
import structlog
import trio

log = structlog.get_logger("lockstep.serve")


def add_parser(sub) -> None:
    from lockstep.generate_cli import add_engine_flags

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    s.add_argument("--deployment", help="deployment TOML (the simulator's schema, with an [engine] table): "
                   "its pools are served, an engine per model; every engine flag typed (--model, --runtime, "
                   "--device, --dtype, --dep, the scheduler flags, ...) is refused with it, even at its default "
                   "(the file says what to run); the server's own flags (--host, --port, --served-model-name, "
                   "...) still apply")
    s.add_argument("--served-model-name", help="the model id clients use (default: --model)")
    add_engine_flags(s)
    s.add_argument("--nodes", type=int, default=1,
                   help="spread the --dep ranks over this many serve processes (hosts), dep/nodes each")
    s.add_argument("--node-rank", type=int, default=0, help="which node this process is")
    s.add_argument("--node-addresses", default="",
                   help="HOST:PORT,... one per node: where the nodes' per-step all-reduce links listen")
    s.add_argument("--dist-init", default="",
                   help="tcp://HOST:PORT shared by every node: the runtimes' torch.distributed rendezvous")
    s.add_argument("--node-link", choices=["auto", "tcp", "shm", "mixed"], default="auto",
                   help="how the nodes all-reduce: shared memory (every node on this host), TCP, mixed "
                        "(shared memory within each host, TCP between hosts), or auto (shm when the node "
                        "addresses all name one host: all loopback, or all the same; mixed when some host "
                        "has several nodes; else tcp)")
    s.add_argument("--node-rejoin-timeout", type=float, default=60.0,
                   help="seconds the nodes of a failed instance wait for every node to rejoin (a lost one "
                        "restarted by its supervisor) before stopping; 0: stop at once")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--num-blocks", type=int, default=4096, help="KV-cache blocks on this rank")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    s.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once per rank")
    s.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens per step (prefill chunks plus decodes) per rank")
    s.add_argument("--max-model-len", type=int,
                   help="prompt + max_tokens at most, per request (default: the model's context, or 4096 where "
                        "it cannot be read, at most what --num-blocks hold for one request)")
    s.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: first come, first served; priority: a request's priority field first (lower first, "
                        "then arrival), as vLLM's")
    s.add_argument("--max-tokens-default", type=int, default=256, help="max_tokens when a request omits it")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default with tools): the model\'s own calls read by --tool-call-parser')
    s.add_argument("--tool-call-parser", choices=["deepseek_v3"],
                   help="the model's tool-call format (deepseek_v3: DeepSeek-V3's, R1's and V3.1's)")
    s.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) in place of the tokenizer's (vLLM's)")
    s.add_argument("--reasoning-parser", choices=["deepseek_r1"],
                   help="chat answers' thinking (up to </think>) as reasoning_content, apart from content (vLLM's)")
    s.add_argument("--runtime-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to the runtime (e.g. sleep=false for the timing runtime)")
    s.add_argument("--backlog", type=int, default=4096, help="listen backlog (pending connections)")
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests")
    s.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds a runtime may take to load its model and report ready")
    s.add_argument("--access-log", action="store_true", help="log one line per HTTP request to stdout")
    s.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between throughput log lines while requests run (0: none)")
    s.add_argument("--log-format", choices=["console", "json"], default="console",
                   help="server logs as readable lines or one JSON object per line")


def _stderr_logger(*args) -> structlog.PrintLogger:
    """A logger on whatever sys.stderr is when it logs (not the stream of the moment the
    logging was configured: an embedding program, or a test harness, may swap it since)."""
    return structlog.PrintLogger(sys.stderr)


def configure_logging(fmt: str) -> None:
    render = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(processors=[structlog.processors.add_log_level,
                                    structlog.processors.TimeStamper(fmt="iso"), render],
                        logger_factory=_stderr_logger)
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    from lockstep.engine.runtime_client import capture_runtime_stderr

    # JSON logs stay JSON: what runtimes write to stderr (a traceback, Gloo's or NCCL's lines)
    # comes through as events, one a line; the console format passes it through as it is.
    log_runtime = structlog.get_logger("lockstep.runtime")
    capture_runtime_stderr((lambda pid, line: log_runtime.warning("runtime stderr", pid=pid, line=line))
                           if fmt == "json" else None)


def engine_configs(args) -> list[tuple[str, object]]:
    """(served name, EngineConfig) per model: one from the flags, or each model a deployment's
    pools serve."""
    if not args.deployment:
        return [(args.served_model_name or args.model, attrs.evolve(engine_config(args),
                                                                    start_timeout_s=args.start_timeout))]
    from lockstep.engine.config import EngineConfig
    from lockstep.policy.deployment_file import load_deployment

    _no_engine_flags(args)
    dep = load_deployment(args.deployment)
    served = sorted({p.model for p in dep.pools}, key=[p.model for p in dep.pools].index)
    if args.served_model_name and len(served) > 1:
        raise ValueError(f"--served-model-name names one model, but {args.deployment} serves {served}")
    return [(args.served_model_name or m, attrs.evolve(EngineConfig.from_deployment(dep, model=m),
                                                       start_timeout_s=args.start_timeout)) for m in served]


# Flags a deployment file's tables replace: given with --deployment, they would be ignored.
_DEPLOYMENT_SETS = ("model", "runtime", "device", "dtype", "num_blocks", "block_size", "max_num_seqs",
                    "max_num_batched_tokens", "max_model_len", "dep", "redundant_experts", "instances",
                    "prefill_instances", "prefill_dep", "kv_transport", "draft_model", "num_spec_tokens",
                    "spec_adaptive", "eplb_window", "runtime_option", "nodes", "scheduling_policy")


def _no_engine_flags(args) -> None:
    """With --deployment the file says what to run: a flag that would say otherwise is an
    error naming it, not silently ignored."""
    from lockstep.cli import _parser

    if hasattr(args, "given"):  # from the command line: what was typed, at any value
        given = [f"--{k.replace('_', '-')}" for k in _DEPLOYMENT_SETS if k in args.given]
    else:  # (a Namespace made otherwise: what differs from the defaults)
        defaults = vars(_parser().parse_args(["serve"]))
        given = [f"--{k.replace('_', '-')}" for k in _DEPLOYMENT_SETS
                 if hasattr(args, k) and getattr(args, k) != defaults.get(k)]
    if given:
        raise ValueError(f"{', '.join(given)}: not used with --deployment {args.deployment}, whose [[models]], "
                         "[[pools]], [scheduler] and [engine] tables say what to run; drop the flags or edit the file")


def engine_config(args):
    from lockstep.engine.config import EngineConfig
    from lockstep.generate_cli import eplb_config, pd_options
    from lockstep.policy.config import SchedulerConfig

    if args.deployment:
        from lockstep.policy.deployment_file import load_deployment
        return EngineConfig.from_deployment(load_deployment(args.deployment))

    from lockstep.engine.config_checks import model_context

    if args.max_model_len is not None and args.max_model_len < 1:  # (0 read as "not given" before)
        raise ValueError(f"--max-model-len must be an integer >= 1, got {args.max_model_len}")
    sched = SchedulerConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len or 4096, policy=args.scheduling_policy)
    if args.max_model_len is None:  # the model's context, as far as one rank's KV cache holds it
        sched = attrs.evolve(sched, max_model_len=min(model_context(args.model) or 4096, sched.request_tokens))
    return EngineConfig(model=args.model, runtime=args.runtime, device=args.device, dtype=args.dtype,
                        scheduler=sched, runtime_options=_options(args.runtime_option),
                        tokenizer="" if args.runtime == "torch" else _timing_tokenizer(args.model), dep=args.dep,
                        eplb=eplb_config(args), **pd_options(args), **node_options(args))


_NODE_FLAGS = {"node_rank": 0, "node_addresses": "", "dist_init": "", "node_link": "auto", "node_rejoin_timeout": 60.0}


def node_options(args) -> dict:
    if args.nodes == 1:
        given = [f"--{k.replace('_', '-')}" for k, d in _NODE_FLAGS.items() if getattr(args, k) != d]
        if given:  # one node: they would do nothing (a forgotten --nodes would serve a lone instance)
            raise ValueError(f"{', '.join(given)}: only used with --nodes N > 1 (a DEP instance over several "
                             "serve processes); give --nodes or drop them")
        return {}
    return dict(nodes=args.nodes, node_rank=args.node_rank, dist_init=args.dist_init, node_link=args.node_link,
                node_addresses=tuple(a for a in args.node_addresses.split(",") if a),
                node_rejoin_timeout_s=args.node_rejoin_timeout)


def _timing_tokenizer(model: str) -> str | None:
    from lockstep.runtime.models.config import preset_names
    return model if model in preset_names() else None


def _options(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--runtime-option must look like KEY=VALUE, got {item!r}")
        low = value.lower()
        out[key] = True if low == "true" else False if low == "false" else value
    return out


CUT_GRACE_S = 2.0  # after the drain deadline, for the cut-off requests' error responses


class Signals:
    """SIGTERM and SIGINT for the whole life of a server: the first starts the drain
    (``first``), or while the engines are still starting stops that start; a second stops at once (``force`` is cancelled: in-flight requests are cut
    off, the engines still stop and release everything), later ones are only logged. The
    receiver stays open until the server has stopped, so no signal meets Python's default
    handler (a KeyboardInterrupt traceback) halfway through a shutdown."""

    def __init__(self):
        self.first = trio.Event()
        self.force = trio.CancelScope()
        self.serving = False  # until then (engines loading) there is nothing to drain
        self.stopped_start: int | None = None  # the signal that stopped the start, if one did
        self.stopped_serving: int | None = None  # the second signal, which cut a drain short

    async def watch(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for sig in signals:
                name = signal.Signals(sig).name
                if not self.first.is_set() and not self.serving:
                    log.info("signal before serving: stopping the start", signal=name)
                    self.stopped_start = sig
                    self.first.set()
                    self.force.cancel()
                elif not self.first.is_set():
                    log.info("signal", signal=name)
                    self.first.set()
                elif not self.force.cancel_called:
                    log.warning("signal again: stopping now, without waiting for in-flight requests", signal=name)
                    self.stopped_serving = sig
                    self.force.cancel()
                else:
                    log.info("signal", signal=name, note="already stopping")


async def log_stats(servers, interval: float) -> None:
    """Every ``interval`` seconds while a model has requests, or had some since the last line:
    its prompt and generated tokens per second over the interval, requests running and
    waiting, and KV-cache use (as vLLM's periodic line)."""
    last = {s.model_name: (trio.current_time(), s.engine.statistics()) for s in servers}
    while True:
        await trio.sleep(interval)
        for s in servers:
            now, st = trio.current_time(), s.engine.statistics()
            t0, old = last[s.model_name]
            last[s.model_name] = (now, st)
            gen, prompt = st.generated_tokens - old.generated_tokens, st.prefix_queries - old.prefix_queries
            if not (st.running or st.waiting or gen or prompt):
                continue  # idle: no line
            dt = max(now - t0, 1e-9)
            log.info("stats", model=s.model_name, prompt_tokens_per_s=round(prompt / dt, 1),
                     generation_tokens_per_s=round(gen / dt, 1), running=st.running, waiting=st.waiting,
                     kv_cache_usage=round(st.kv_blocks_used / max(st.kv_blocks_total, 1), 3))


async def serve(args, *, shutdown=None, task_status=trio.TASK_STATUS_IGNORED) -> int:
    """Serve until ``shutdown()`` returns, then drain and stop; by default until SIGTERM or
    SIGINT, a second of which stops at once (``Signals``). ``task_status.started`` gets the
    server (its engine, for tests) and the bound URLs. The exit status: 0 after serving (a
    drain is the way a server ends), 128 + the signal's number when one stopped the start or
    a second one cut the drain short (130 for Ctrl-C, as every command)."""
    _check_flags(args)
    configs = engine_configs(args)  # bad flags: an error before anything starts
    if shutdown is not None:
        await _serve(args, configs, shutdown, trio.CancelScope(), lambda: None, task_status)
        return 0
    signals = Signals()

    def serving() -> None:
        signals.serving = True
        # What start-up made (the engines, the tokenizer, the app) lives as long as the server:
        # out of the collector's sight, its full collections stop walking it between steps (30-40
        # ms pauses in the scheduler's loop; vLLM's API server freezes its start-up heap too).
        gc.collect()
        gc.freeze()

    async with trio.open_nursery() as nursery:
        await nursery.start(signals.watch)
        log.info("starting", models=[name for name, _ in configs])
        await _serve(args, configs, signals.first.wait, signals.force, serving, task_status)
        nursery.cancel_scope.cancel()
    stopped = signals.stopped_start or signals.stopped_serving  # (a drain that ran its course: 0)
    return 0 if stopped is None else 128 + stopped


async def _serve(args, configs, shutdown, force: trio.CancelScope, serving, task_status) -> None:
    _check_port(args.host, args.port)  # before minutes of loading, not after
    started = []

    def on_serving() -> None:
        started.append(True)
        serving()

    with force:
        await _run_servers(args, configs, shutdown, on_serving, task_status)
    if force.cancelled_caught:
        log.warning("stopped without draining" if started else "stopped before serving")
        return
    log.info("stopped")


def _check_flags(args) -> None:
    """The server's own numbers, named now (a negative --drain-timeout used to crash the drain;
    --max-tokens-default 0 to fail every request that left max_tokens out, naming max_tokens)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0: any free port), got {args.port}")
    for flag, v, least in (("--drain-timeout", args.drain_timeout, 0), ("--start-timeout", args.start_timeout, 1e-9),
                           ("--log-stats-interval", args.log_stats_interval, 0)):
        if not (math.isfinite(v) and v >= least):
            raise ValueError(f"{flag} must be a finite number of seconds {'>= 0' if least == 0 else '> 0'}, got {v}")
    if args.max_tokens_default < 1:
        raise ValueError(f"--max-tokens-default must be at least 1, got {args.max_tokens_default}")
    if args.backlog < 1:
        raise ValueError(f"--backlog must be at least 1, got {args.backlog}")
    if args.chat_template is not None:
        from pathlib import Path

        from lockstep.runtime.tokenizer import TokenizerError, custom_chat_template

        path = Path(args.chat_template)
        try:
            if not any(c in args.chat_template for c in "{}\n"):  # no Jinja in it: a file (vLLM's rule)
                if not path.is_file():
                    raise ValueError(f"--chat-template {str(path)[:200]}: no such file (a template given inline "
                                     "holds Jinja: {{ ... }} or {% ... %})")
                args.chat_template = path.read_text()
            custom_chat_template(None, args.chat_template)  # (it parses: checked before any engine starts)
        except (OSError, UnicodeDecodeError, TokenizerError) as e:
            raise ValueError(f"--chat-template {str(path)[:80]}: {e}") from None
    if args.enable_auto_tool_choice and not args.tool_call_parser:  # (vLLM's rule)
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format: "
                         "deepseek_v3)")


def _check_port(host: str, port: int) -> None:
    """An address in use (or not ours to bind) fails now, naming it."""
    import errno
    import socket

    if not port:
        return
    name = host.strip("[]")  # as hypercorn binds it: IPv6 where the host has a colon, else IPv4
    with socket.socket(socket.AF_INET6 if ":" in name else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((name, port))
        except OSError as e:  # (socket.gaierror too: a host name that does not resolve)
            raise OSError(e.errno or errno.EADDRNOTAVAIL, f"cannot listen on {host}:{port}: {e.strerror or e}") from None


async def _run_servers(args, configs, shutdown, serving, task_status) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    from lockstep.api import open_engine
    from lockstep.access_log import AccessLog
    from lockstep.http import Server, make_app

    async with contextlib.AsyncExitStack() as stack:
        servers = []
        for name, config in configs:  # a deployment that lists several models: an engine each
            engine = await stack.enter_async_context(open_engine(config))
            servers.append(Server(engine, name, default_max_tokens=args.max_tokens_default,
                                  reasoning_parser=args.reasoning_parser, chat_template=args.chat_template,
                                  tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None))
        server = servers[0]
        hc = Config()
        hc.bind = [f"{args.host}:{args.port}"]
        # At the drain deadline the requests still running are aborted (``Server.cut_off``):
        # their clients get a 503 or an error event; hypercorn closes what is left after.
        hc.graceful_timeout = args.drain_timeout + CUT_GRACE_S
        hc.accesslog = None  # hypercorn's may log a request twice (its stream-closed race): our own
        hc.loglevel = "WARNING"  # its "Running on" line is ours ("serving", with the URLs), in our format
        hc.keep_alive_timeout = 75
        hc.backlog = args.backlog  # bursts of thousands of connects must not be reset

        aborted_at_drain = []

        async def shutdown_trigger() -> None:
            await shutdown()
            log.info("draining", deadline_s=args.drain_timeout, running=sum(s.engine.statistics().running
                                                                             for s in servers))
            aborted_at_drain.append(sum(s.metrics.finished.get("abort", 0) for s in servers))
            for s in servers:
                s.draining = True
            drain_started.set()

        drain_started = trio.Event()
        cut_scope = trio.CancelScope()

        async def cut_at_deadline() -> None:
            with cut_scope:
                await drain_started.wait()
                await trio.sleep(args.drain_timeout)
                for s in servers:
                    s.cut_off()

        stats_scope = trio.CancelScope()  # the stats lines end when the HTTP server does

        async def http(task_status=trio.TASK_STATUS_IGNORED) -> None:
            try:
                app = make_app(servers)
                if args.access_log:
                    app = AccessLog(app, json_lines=args.log_format == "json")
                await hypercorn_serve(app, hc, shutdown_trigger=shutdown_trigger,
                                      task_status=task_status)
                if aborted_at_drain:  # requests the deadline cut off (or whose clients left meanwhile)
                    cut = sum(s.metrics.finished.get("abort", 0) for s in servers) - aborted_at_drain[0]
                    if cut:
                        log.warning("drain ended with sequences cut off (or their clients gone)", sequences=cut,
                                    deadline_s=args.drain_timeout)
            finally:
                stats_scope.cancel()
                cut_scope.cancel()

        async def stats() -> None:
            with stats_scope:
                await log_stats(servers, args.log_stats_interval)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cut_at_deadline)
            binds = await nursery.start(http)
            serving()
            for s in servers:  # what runs, per model: an operator's first question
                c = s.engine.config
                extra = {}
                if c.prefill_instances:  # P/D: how the pools are made and how KV moves
                    extra.update(prefill_dep=c.prefill_dep, kv_transport=c.kv_transport)
                if c.draft_model:
                    extra.update(draft_model=c.draft_model, num_spec_tokens=c.num_spec_tokens,
                                 spec_adaptive=c.spec_adaptive)
                if c.kv_cache_dtype != "auto":
                    extra.update(kv_cache_dtype=c.kv_cache_dtype)
                log.info("model", model=s.model_name, checkpoint=c.model, runtime=c.runtime, device=c.device,
                         dtype=c.dtype, dep=c.dep, instances=c.instances, prefill_instances=c.prefill_instances,
                         **extra, num_blocks=c.scheduler.num_blocks, block_size=c.scheduler.block_size,
                         max_model_len=c.scheduler.max_model_len, max_num_seqs=c.scheduler.max_num_seqs,
                         runtime_pids=[sch.client.ready.pid for sch in s.engine.schedulers])
            log.info("serving", models=[s.model_name for s in servers], urls=binds,
                     runtime_pid=server.engine.scheduler.client.ready.pid)
            if args.log_stats_interval > 0:
                nursery.start_soon(stats)
            task_status.started((server, binds))


def run_serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    return trio.run(serve, args)
