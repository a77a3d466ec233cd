"""The `lockstep` command's own behaviour: help that shows defaults, unknown flags reported
by their command with a suggestion, and bad input as one line (exit 2), not a traceback."""

from pathlib import Path

import pytest

from lockstep.cli import _parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_an_unknown_flag_is_named_by_its_command_with_the_closest_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["sim", "--trce", "x.jsonl"])
    err = capsys.readouterr().err
    # one line, as every other bad input (the usage is for --help)
    assert e.value.code == 2 and err.strip().splitlines() == [
        "lockstep sim: error: unrecognized arguments: --trce x.jsonl (did you mean --trace?) (see lockstep sim --help)"]
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--num-promts", "3"])
    err = capsys.readouterr().err
    assert "lockstep bench serve: error:" in err and "--num-prompts" in err


def test_every_command_help_shows_defaults(capsys):
    for argv in (["sim", "--help"], ["serve", "--help"], ["generate", "--help"], ["bench", "serve", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "(default: " in out, argv
    p = _parser()
    assert "(default: 8000)" in p._subparsers._group_actions[0].choices["serve"].format_help()


def test_bad_input_raised_inside_the_engine_is_one_line(capsys):
    """max_tokens past the context is found inside trio's task groups: still one error line."""
    assert main(["generate", "--max-tokens", "100000", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lockstep generate: error: max_tokens") and "context" in err and "Traceback" not in err


def test_generate_takes_logit_bias_and_allowed_ids_and_names_bad_ones(capsys):
    assert main(["generate", "--max-tokens", "3", "--logit-bias", "7=100", "--allowed-token-ids", "7,8", "hi"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):  # argparse's own error: the flag and the form it takes
        main(["generate", "--logit-bias", "7", "hi"])
    assert "--logit-bias: expected ID=BIAS" in capsys.readouterr().err
    assert main(["generate", "--logit-bias", "999999=1", "hi"]) == 2
    assert "logit_bias holds token ids outside the model's vocabulary" in capsys.readouterr().err


def test_generate_takes_structured_outputs_and_names_bad_ones(capsys, tmp_path):
    assert main(["generate", "--max-tokens", "20", "--temperature", "1", "--seed", "3", "--choice", "yes",
                 "--choice", "no", "hi"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    (tmp_path / "s.json").write_text('{"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}')
    assert main(["generate", "--max-tokens", "40", "--json-schema", f"@{tmp_path / 's.json'}", "hi"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("{")
    assert main(["generate", "--regex", "a[", "hi"]) == 2
    assert "error: --regex: not a regular expression" in capsys.readouterr().err  # (the flag, not the field)
    assert main(["generate", "--json-schema", f"@{tmp_path / 'nope.json'}", "hi"]) == 2
    assert "--json-schema @" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one of them at most
        main(["generate", "--regex", "a", "--choice", "b", "hi"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_serve_takes_the_models_context_and_refuses_more(capsys):
    from lockstep.serve_cli import engine_config

    for model, context in (("tiny", 4096), ("v2-lite", 32768)):  # the default: the model's own context
        cfg = engine_config(_parser().parse_args(["serve", "--model", model]))
        assert cfg.scheduler.max_model_len == context
    assert main(["serve", "--model", "tiny", "--max-model-len", "100000", "--port", "0"]) == 2
    assert "exceeds the context of model 'tiny' (4096 tokens" in capsys.readouterr().err


def test_serve_max_model_len_fits_the_kv_cache(capsys):
    """Defaulted, the context shrinks to what one rank's KV cache holds for one request;
    given larger, the server refuses to start (as vLLM does), naming both knobs."""
    from lockstep.serve_cli import engine_config

    cfg = engine_config(_parser().parse_args(["serve", "--model", "tiny", "--num-blocks", "100"]))
    assert cfg.scheduler.max_model_len == cfg.scheduler.request_tokens == 99 * 16
    assert main(["serve", "--model", "tiny", "--num-blocks", "100", "--max-model-len", "2048", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "max_model_len 2048 exceeds what one rank's KV cache holds for one request (1584 tokens" in err
    assert "raise num_blocks" in err and "Traceback" not in err


def test_serve_with_a_deployment_refuses_flags_it_would_ignore(capsys):
    assert main(["serve", "--deployment", "examples/serve-tiny-cpu.toml", "--max-model-len", "8192",
                 "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "--dtype, --max-model-len: not used with --deployment" in err


def test_speculation_and_pd_flags_that_would_do_nothing_are_refused(capsys):
    assert main(["generate", "--num-spec-tokens", "2", "hi"]) == 2
    assert "--num-spec-tokens needs --draft-model" in capsys.readouterr().err
    assert main(["serve", "--spec-adaptive", "--port", "0"]) == 2
    assert "--spec-adaptive needs --draft-model" in capsys.readouterr().err
    assert main(["serve", "--prefill-dep", "2", "--port", "0"]) == 2  # P/D flags without P/D
    assert "--prefill-dep needs --prefill-instances" in capsys.readouterr().err
    assert main(["generate", "--kv-transport", "shm", "hi"]) == 2
    assert "--kv-transport needs --prefill-instances" in capsys.readouterr().err
    # their defaults given explicitly change nothing (a templated launch): accepted
    assert main(["generate", "--prefill-dep", "1", "--kv-transport", "nixl", "--eplb-window", "64",
                 "--max-tokens", "1", "hi"]) == 0
    assert main(["serve", "--dep", "2", "--eplb-window", "16", "--port", "0"]) == 2
    assert "--eplb-window needs --redundant-experts" in capsys.readouterr().err
    assert main(["serve", "--dep", "2", "--node-rank", "1", "--node-link", "tcp", "--port", "0"]) == 2
    assert "--node-rank, --node-link: only used with --nodes" in capsys.readouterr().err
    assert main(["generate", "--draft-model", "layers:4", "hi"]) == 2  # one line, before anything loads
    err = capsys.readouterr().err
    assert "--draft-model 'layers:4': N must be in [1, 4)" in err and "Traceback" not in err  # (the flag's name)


async def test_serve_logs_throughput_while_requests_run_and_nothing_when_idle(autojump_clock):
    """The periodic line, as vLLM's: tokens per second over the interval, running and waiting
    requests, KV-cache use; no line for a model that stayed idle."""
    from types import SimpleNamespace

    import structlog
    import trio

    from lockstep.engine.scheduler import SchedulerStats
    from lockstep.serve_cli import log_stats

    def stats(gen, prompt, running):
        return SchedulerStats(running=running, waiting=0, kv_blocks_used=25, kv_blocks_total=100,
                              prefix_queries=prompt, prefix_hits=0, preemptions=0, steps=0, generated_tokens=gen,
                              runtime_restarts=0)
    seq = iter([stats(0, 0, 0), stats(0, 0, 0), stats(100, 40, 1), stats(100, 40, 0)])
    server = SimpleNamespace(model_name="tiny", engine=SimpleNamespace(statistics=lambda: next(seq)))
    with structlog.testing.capture_logs() as logs:
        with trio.move_on_after(35):
            await log_stats([server], 10.0)
    lines = [e for e in logs if e["event"] == "stats"]
    assert len(lines) == 1  # idle at 10 s and at 30 s: no line
    assert lines[0]["generation_tokens_per_s"] == 10.0 and lines[0]["prompt_tokens_per_s"] == 4.0
    assert lines[0]["running"] == 1 and lines[0]["kv_cache_usage"] == 0.25


def test_serve_names_an_address_in_use_before_loading_anything(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--model", "tiny", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err and "Traceback" not in err


def test_ctrl_c_ends_a_command_with_130_and_no_traceback():
    import os
    import signal
    import subprocess
    import sys
    import time

    p = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "generate", "--max-tokens", "3000", "hello"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        os.set_blocking(p.stdout.fileno(), False)
        deadline = time.monotonic() + 60
        while not p.stdout.read(1) and time.monotonic() < deadline:  # generating
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 130
        assert b"Traceback" not in p.stderr.read()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # its runtime and forkserver go with it
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("processes of the command's group still running")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_command_leaves_no_process_behind_when_it_ends():
    """Its runtimes, their forkserver and multiprocessing's resource tracker are all gone
    when the command has ended (the forkserver used to linger, then stay as a zombie where
    nothing reaps orphans)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "generate", "hello", "--max-tokens", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    out = p.communicate(timeout=120)[0].decode()
    assert p.returncode == 0, out
    left = subprocess.run(["ps", "-o", "pid=,stat=,cmd=", "-s", str(p.pid)], capture_output=True, text=True).stdout
    assert left.strip() == "", left


def test_a_lost_dep_instance_is_one_line_however_many_ranks_report_it(monkeypatch, capsys):
    """Every local rank of a node raises its own InstanceLost when the nodes do not rejoin:
    still one error line and exit status 1, not a traceback of the group."""
    import lockstep.generate_cli
    from lockstep.engine.node_group import InstanceLost

    def lost(args):
        err = InstanceLost("DEP node 0: the nodes did not all rejoin within 5 s after x")
        raise BaseExceptionGroup("ranks", [BaseExceptionGroup("rank 0", [err]), BaseExceptionGroup("rank 1", [err])])
    monkeypatch.setattr(lockstep.generate_cli, "run_generate", lost)
    assert main(["generate", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "lockstep generate: error: DEP node 0: the nodes did not all rejoin within 5 s after x"


@pytest.mark.parametrize("flags, message", [
    (["--port", "99999"], "--port must be in [0, 65535]"),  # was a traceback from bind()
    (["--drain-timeout", "-5"], "--drain-timeout must be a finite number of seconds >= 0"),  # crashed the drain
    (["--max-tokens-default", "0"], "--max-tokens-default must be at least 1"),  # failed every request
    (["--start-timeout", "0"], "--start-timeout must be a finite number of seconds > 0"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--max-model-len", "0"], "--max-model-len must be an integer >= 1"),  # became the default
    # no Jinja in it: a file, which must exist (the path itself was the template)
    (["--chat-template", "/nonexistent/tmpl.jinja"], "--chat-template /nonexistent/tmpl.jinja: no such file"),
])
def test_serve_names_bad_numbers_before_starting(flags, message, capsys):
    assert main(["serve", "--model", "tiny", *flags]) == 2
    assert message in capsys.readouterr().err


def test_serve_with_a_deployment_refuses_flags_given_even_at_their_default(capsys):
    """--model tiny and --num-blocks 4096 are the defaults: typed, they still say what to run,
    which the file says (they were dropped silently)."""
    deployment = str(ROOT / "examples/serve-tiny-cpu.toml")
    assert main(["serve", "--deployment", deployment, "--model", "tiny", "--num-blocks", "4096"]) == 2
    err = capsys.readouterr().err
    assert "--model, --num-blocks: not used with --deployment" in err


def test_engine_errors_name_the_flags_typed(capsys):
    """serve and generate build an EngineConfig from flags: its errors say --dep, not engine.dep
    (with --deployment they name the file's fields, as they should)."""
    assert main(["generate", "--prefill-instances", "1", "--prefill-dep", "3", "hi"]) == 2
    assert capsys.readouterr().err.startswith("lockstep generate: error: --prefill-dep 3 must divide")
    assert main(["generate", "--prefill-instances", "1", "--dep", "2", "--redundant-experts", "2", "hi"]) == 2
    assert "error: --redundant-experts balances one colocated instance" in capsys.readouterr().err
