"""What a vLLM user's script expects of the Python API and the CLI: scripts without a main
guard, vLLM's output fields and SamplingParams extras, aborting a request before its first
output, a chat template of one's own, and nothing left running after close."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from lockstep import LLM, ConfigError, RequestError
from lockstep.api import open_engine
from lockstep.cli import main
from lockstep.engine.config import EngineConfig
from lockstep.policy.request import SamplingParams
from test_engine import config

SCRIPT = textwrap.dedent("""
    import multiprocessing, os
    from lockstep import LLM, SamplingParams
    llm = LLM("tiny")
    print("OUT", llm.generate("hi", SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids.tolist())
    llm.close()
    from multiprocessing import forkserver, resource_tracker
    print("LEFT", len(multiprocessing.active_children()), forkserver._forkserver._forkserver_pid,
          resource_tracker._resource_tracker._pid)
""")


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_a_script_without_a_main_guard_runs_and_leaves_nothing(tmp_path, how):
    """multiprocessing would import the script again in the forkserver and in each runtime
    (a second engine there; from standard input, a file that does not exist)."""
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    cmd = [sys.executable, str(path)] if how == "file" else [sys.executable, "-"]
    p = subprocess.run(cmd, input=None if how == "file" else SCRIPT, capture_output=True, text=True, timeout=240,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    out = dict(line.split(" ", 1) for line in p.stdout.splitlines() if line.startswith(("OUT", "LEFT")))
    assert len(eval(out["OUT"])) == 4
    assert out["LEFT"] == "0 None None"  # (close stopped the forkserver and the resource tracker)


async def test_an_abort_before_the_first_output_ends_the_request():
    async with open_engine(config()) as engine:
        gen = engine.generate("hi", SamplingParams(max_tokens=300, ignore_eos=True), request_id=77)
        engine.abort(77)
        outs = [o async for o in gen]
        assert (outs[-1].finish_reason, sum(len(o.token_ids) for o in outs), outs[-1].request_id) == ("abort", 0, 77)
        held = engine.generate("hi", SamplingParams(max_tokens=2), request_id=78)
        with pytest.raises(RequestError, match="request_id 78 is in use") as e:
            engine.generate("hi", SamplingParams(max_tokens=2), request_id=78)
        assert e.value.field == "request_id"
        assert [o async for o in held][-1].finish_reason == "length"
        assert engine.statistics().running == engine.statistics().waiting == 0


async def test_vllm_output_fields_and_sampling_extras():
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    async with open_engine(config()) as engine:
        whole = await engine.complete("hello there", SamplingParams(**greedy, logprobs=0))
        assert (whole.prompt, whole.finished, whole.index) == ("hello there", True, 0)
        assert whole.prompt_token_ids.tolist() == engine.tokenizer.encode("hello there").tolist()
        assert whole.cumulative_logprob == pytest.approx(sum(row[1] for row in whole.logprobs))
        assert (await engine.complete("hello there", SamplingParams(**greedy))).cumulative_logprob is None
        stop = whole.text[4:6]  # (a stop string inside the greedy text: kept in it with include_stop_str_in_output)
        cut = await engine.complete("hello there", SamplingParams(**greedy, stop=[stop]))
        kept = await engine.complete("hello there", SamplingParams(**greedy, stop=[stop],
                                                                    include_stop_str_in_output=True))
        assert kept.text == cut.text + stop and kept.stop_reason == stop
        ids = np.arange(3, 60, dtype=np.int32)
        short = await engine.complete(ids, SamplingParams(**greedy, truncate_prompt_tokens=7))
        assert short.num_prompt_tokens == 7 and short.prompt is None and short.prompt_token_ids.tolist() == \
            ids[-7:].tolist()
        assert short.token_ids.tolist() == (await engine.complete(ids[-7:], SamplingParams(**greedy))).token_ids.tolist()
        silent = await engine.complete("abc", SamplingParams(max_tokens=4, n=3, seed=1, detokenize=False))
        assert [o.text for o in silent.outputs] == ["", "", ""] and [o.index for o in silent.outputs] == [0, 1, 2]
        with pytest.raises(RequestError, match="stop strings are matched on the output's text"):
            engine.generate("a", SamplingParams(stop=["x"], detokenize=False))
    p = SamplingParams(max_tokens=3, best_of=1)
    assert p.clone() == p
    with pytest.raises(TypeError, match="positional"):
        SamplingParams(0.5)  # (vLLM's first positional is n: keywords only here)
    for bad, field in (({"best_of": 3}, "best_of"), ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                       ({"include_stop_str_in_output": 1}, "include_stop_str_in_output")):
        with pytest.raises(RequestError) as e:
            SamplingParams(**bad)
        assert e.value.field == field
    assert issubclass(ConfigError, ValueError)


def test_llm_tokenizer_chat_template_and_vllm_keywords():
    with LLM("tiny", max_model_len=512) as llm:
        tok = llm.get_tokenizer()
        assert tok.decode(tok.encode("abc")) == "abc"
        out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2),
                       chat_template="{% for m in messages %}<{{ m.content }}>{% endfor %}", use_tqdm=False)
        assert out[0].prompt_token_ids.tolist() == tok.encode("<hi>").tolist()
        with pytest.raises(RequestError, match="chat_template does not parse") as e:
            llm.chat([{"role": "user", "content": "hi"}], chat_template="{% for %}")
        assert e.value.field == "chat_template"
        # one that parses and fails on the messages is the caller's template too, not a crash
        for bad in ("{{ raise_exception('no') }}", "{{ messages[5].content }}", "{{ 1 + 'a' }}"):
            with pytest.raises(RequestError, match="chat_template failed on these messages") as e:
                llm.chat([{"role": "user", "content": "a"}], SamplingParams(max_tokens=2), chat_template=bad)
            assert e.value.field == "chat_template"
        # a stop id that is the last token max_tokens allows ends it by length, as vLLM checks
        # the length first (no stop_reason, its text written); one token earlier, a stop
        greedy = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
        stop = int(greedy.token_ids[-1])
        at, before = (llm.generate("hello", SamplingParams(max_tokens=m, temperature=0, stop_token_ids=[stop]),
                                   use_tqdm=False)[0] for m in (3, 4))
        assert (at.finish_reason, at.stop_reason, at.text) == ("length", None, greedy.text)
        assert (before.finish_reason, before.stop_reason) == ("stop", stop) and before.text != greedy.text
        # n samples are numbered, as vLLM's CompletionOutput.index
        (out,) = llm.generate("hi", SamplingParams(max_tokens=3, n=3, seed=1), use_tqdm=False)
        assert [o.index for o in out.outputs] == [0, 1, 2]


def test_cli_flags_are_never_abbreviations(capsys):
    with pytest.raises(SystemExit):  # (argparse took --n for --num-spec-tokens)
        main(["generate", "--n", "2", "hi"])
    assert "unrecognized arguments: --n" in capsys.readouterr().err
    assert main(["generate", "--stop-token-ids", "5,6", "--ignore-eos", "--max-tokens", "3", "hi"]) == 0
    assert "3 tokens, finish: length" in capsys.readouterr().err


async def test_a_finished_requests_id_may_be_used_again():
    """vLLM takes a finished request's id; the last prompt the frontend handled held on to it."""
    async with open_engine(EngineConfig(model="tiny", runtime="timing")) as eng:
        for _ in range(2):
            outs = [o async for o in eng.generate([5, 6, 7], SamplingParams(max_tokens=2), request_id=1001)]
            assert outs[-1].finished
