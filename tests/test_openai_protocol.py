"""The OpenAI request parser at the HTTP boundary: every bad body is a BadRequest naming its
field, before anything is queued; nothing asked for is dropped silently."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.openai_protocol import BadRequest, parse_completion
from lockstep.policy.request import SamplingParams


def template(messages, add_generation_prompt=True, tools=None):
    roles = [m["role"] for m in messages]
    if any(a == b for a, b in zip(roles, roles[1:])):
        raise ValueError("roles must alternate")  # what a model's template raises (TokenizerError is one)
    return " ".join(m["content"] for m in messages)


def parse(body, chat=False):
    return parse_completion({"model": "tiny", **body}, chat=chat, default_max_tokens=16, chat_template=template)


@pytest.mark.parametrize("body, field", [
    ({"prompt": [5], "top_k": 10**29}, "top_k"),  # used to pass, then kill the scheduler when encoded
    ({"prompt": [5], "top_k": 2**31}, "top_k"),
    ({"prompt": [5], "temperature": -1e-40}, "temperature"),
    ({"prompt": [5], "temperature": float("inf")}, "temperature"),
    ({"prompt": [10**30]}, "prompt"),  # used to be a 500 (an OverflowError converting it)
    ({"prompt": [5], "bogus": 1}, "bogus"),
    ({"prompt": [5], "logit_bias": {"x5": 10}}, "logit_bias"),
    ({"prompt": [5], "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": [5], "logit_bias": {"5": "1"}}, "logit_bias"),
    ({"prompt": [5], "logit_bias": [5]}, "logit_bias"),
    ({"prompt": [5], "allowed_token_ids": [5, "6"]}, "allowed_token_ids"),
    ({"prompt": [5], "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": [5], "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": [5], "repetition_penalty": "1.1"}, "repetition_penalty"),
    ({"prompt": [5], "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"prompt": [5], "min_p": -0.1}, "min_p"),
    ({"prompt": [5], "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"prompt": [5], "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"prompt": [5], "stream": True, "stream_options": {"include_usage": "no"}}, "include_usage"),
    ({"prompt": [5], "stream": True, "stream_options": {"other": 1}}, "stream_options"),
    ({"prompt": [5], "max_completion_tokens": 3}, "max_completion_tokens"),  # a chat field
    ({"prompt": [5], "max_tokens": 2**40}, "max_tokens"),
])
def test_bad_completion_bodies_name_their_field(body, field):
    with pytest.raises(BadRequest) as e:
        parse(body)
    assert e.value.param == field, (str(e.value), e.value.param)


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "a", "tool_calls": []}]}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "prompt": "x"}, "prompt"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_bad_chat_bodies_name_their_field(body, field):
    with pytest.raises(BadRequest) as e:
        parse(body, chat=True)
    assert e.value.param == field, (str(e.value), e.value.param)


def test_no_op_values_of_unsupported_fields_are_accepted():
    job = parse({"prompt": "hi", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1,
                 "user": "u1", "stream": True, "stream_options": {"include_usage": True}, "bogus": None})
    assert job.include_usage and job.stream
    chat = parse({"messages": [{"role": "user", "content": "a"}], "tools": [], "tool_choice": "none",
                  "response_format": {"type": "text"}, "max_completion_tokens": 5}, chat=True)
    assert chat.params.max_tokens == 5 and chat.prompts == ("a",)


def test_vllm_logits_processing_fields_are_parsed():
    job = parse({"prompt": [5], "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
                 "min_p": 0.05, "min_tokens": 3})
    p = job.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (
        0.5, -1.0, 1.2, 0.05, 3) and p.processes_logits
    assert not parse({"prompt": [5]}).params.processes_logits
    p = parse({"prompt": [5], "logit_bias": {"50": -100, "7": 2.5}, "allowed_token_ids": [7, 50, 9]}).params
    assert p.logit_bias == {50: -100.0, 7: 2.5} and p.allowed_token_ids == (7, 50, 9) and p.processes_logits
    assert not parse({"prompt": [5], "logit_bias": {}}).params.processes_logits
    # no max_tokens given: the default is capped at what the context leaves, but never below
    # min_tokens (the length check then refuses the prompt, as it would the default)
    job = parse({"prompt": [5], "min_tokens": 10})
    assert job.capped(np.zeros(4090, np.int32), 4096).max_tokens == 16
    assert job.capped(np.zeros(4070, np.int32), 4096).max_tokens == 16
    assert job.capped(np.zeros(4085, np.int32), 4096).max_tokens == 11


def test_sampling_params_reject_what_would_fail_later():
    from lockstep.policy.request import RequestError
    for bad in (dict(max_tokens=True), dict(top_k=2.5), dict(top_k=2**40), dict(temperature="0.5"),
                dict(temperature=-1e-9), dict(stop_token_ids=(2**40,)), dict(ignore_eos=1), dict(stop=5)):
        with pytest.raises(RequestError, match=next(iter(bad))):
            SamplingParams(**bad).validate()
    assert SamplingParams(stop="END").stop == ("END",)  # one stop string, not its characters
    SamplingParams(temperature=0, top_k=2**31 - 1).validate()


def test_request_errors_carry_the_field_they_blame():
    """A RequestError says which field is to blame (its HTTP error's ``param``) on the error
    itself, not in its wording; a chat request's prompt is its messages; an error that
    blames no field reports none."""
    import numpy as np

    from lockstep.engine.frontend import check_prompt
    from lockstep.openai_responses import request_param
    from lockstep.policy.request import RequestError
    for tokens, max_tokens in ((np.zeros(0, np.int32), 5), (np.ones(100, np.int32), 5), (np.full(3, 10, np.int32), 5)):
        with pytest.raises(RequestError) as e:
            check_prompt(tokens, SamplingParams(max_tokens=max_tokens), 100, 10)
        assert e.value.field == "prompt" and request_param(e.value, chat=True) == "messages"
        assert request_param(e.value, chat=False) == "prompt"
    with pytest.raises(RequestError) as e:  # the prompt fits: max_tokens is what is too large
        check_prompt(np.ones(98, np.int32), SamplingParams(max_tokens=5), 100, 10)
    assert e.value.field == "max_tokens" and e.value.reason == "context_length"
    with pytest.raises(RequestError, match=r"prompt \(100 tokens\) leaves no room for output in the model's "
                       "context of 100") as e:  # not blaming a max_tokens the client may never have given
        check_prompt(np.ones(100, np.int32), SamplingParams(max_tokens=256), 100, 10)
    with pytest.raises(RequestError, match="prompt must hold at least one token"):
        from lockstep.engine.frontend import as_token_array
        as_token_array([])
    with pytest.raises(RequestError) as e:
        SamplingParams(top_p=0).validate()
    assert e.value.field == "top_p" and request_param(e.value, chat=True) == "top_p"
    assert request_param(RequestError("request 3 is already in this scheduler"), chat=False) is None


@settings(deadline=None, max_examples=300, derandomize=True)
@given(text=st.text("ab\nUs:", max_size=24), stops=st.lists(st.text("ab\nUs:", min_size=1, max_size=4), min_size=1,
                                                           max_size=3), cuts=st.lists(st.integers(0, 24), max_size=6))
def test_stop_strings_cut_the_same_however_the_text_is_split(text, stops, cuts):
    """Streamed in any pieces, the text returned is the one-piece result: cut at the start of
    the stop string that ends first (the longer of two ending together), nothing after."""
    from lockstep.engine.stops import StopStrings

    found = [(i + len(s), i) for s in stops for i in (text.find(s),) if i >= 0]
    want = (text[: min(found)[1]], True) if found else (text, False)
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    cut, out, hit = StopStrings(stops), [], False
    for k, piece in enumerate(pieces):
        got, hit = cut.feed(piece, final=k == len(pieces) - 1)
        out.append(got)
        if hit:
            break
    assert ("".join(out), hit) == want


def test_an_engine_failure_tells_the_client_its_first_line_only():
    """A runtime's traceback (its internal paths included) stays in the server's log."""
    from lockstep.openai_responses import _failed

    exc = RuntimeError("runtime process 'torch' failed:\nTraceback (most recent call last):\n  File \"/x/y.py\"")
    msg = _failed(exc)
    assert msg == "the engine failed this request: runtime process 'torch' failed (the server's log has the details)"
    assert "Traceback" not in msg and _failed(RuntimeError()).endswith("RuntimeError (the server's log has the details)")


def test_the_sampled_token_keeps_its_own_logprob_among_top_logprobs():
    """Two ids that decode to the same text (partial UTF-8 bytes both read as U+FFFD): the
    sampled one's logprob is the one shown (a likelier one's used to overwrite it)."""
    from lockstep.openai_output import logprobs_json

    class Tok:
        def decode(self, ids):
            return "\ufffd" if ids[0] in (7, 9) else f"t{ids[0]}"

    got = logprobs_json(Tok(), [(9, -6.2, [(7, -5.8), (3, -6.0)])], chat=False)
    assert got["tokens"] == ["\ufffd"] and got["token_logprobs"] == [-6.2]
    assert got["top_logprobs"] == [{"\ufffd": -6.2, "t3": -6.0}]


def test_structured_outputs_come_from_response_format_vllm_fields_or_guided_ones():
    from lockstep import StructuredOutputsParams as S

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "json_object"}}, S(json_object=True), ("response_format", "response_format")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}},
         S(json=schema), ("response_format", "response_format.json_schema.schema")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, S(json={"type": "object"}),
         ("response_format", "response_format.json_schema.schema")),
        ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
         S(regex="a+", disable_any_whitespace=True), ("structured_outputs", "structured_outputs.regex")),
        ({"guided_json": schema}, S(json=schema), ("guided_json", "guided_json")),
        ({"guided_regex": "[0-9]+", "guided_decoding_backend": "xgrammar"}, S(regex="[0-9]+"),
         ("guided_regex", "guided_regex")),
        ({"guided_choice": ["a", "b"]}, S(choice=("a", "b")), ("guided_choice", "guided_choice")),
        ({"guided_grammar": 'root ::= "a"'}, S(grammar='root ::= "a"'), ("guided_grammar", "guided_grammar")),
        ({"response_format": {"type": "text"}}, None, None),
    ]
    for body, want, source in cases:
        job = parse({"messages": [{"role": "user", "content": "a"}], **body}, chat=True)
        assert job.params.structured_outputs == want and job.structured_from == source, body
        assert job.params.processes_logits == (want is not None)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens"),
])
def test_bad_structured_outputs_name_the_field_they_came_in(body, field):
    with pytest.raises(BadRequest) as e:
        parse({"prompt": [5], **body})
    assert e.value.param == field, (str(e.value), e.value.param)


WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}


def test_tool_choice_required_or_named_constrains_the_answer_to_tool_calls():
    from lockstep.openai_tools import tool_calls

    seen = []

    def tpl(messages, add_generation_prompt=True, tools=None):
        seen.append(tools)
        return "x"

    chat = {"messages": [{"role": "user", "content": "a"}], "tools": [WEATHER, TIME]}
    named = parse_completion({"model": "m", **chat, "tool_choice": {"type": "function", "function": {"name": "weather"}}},
                             chat=True, default_max_tokens=16, chat_template=tpl)
    assert named.tool_choice == "weather" and named.params.structured_outputs.json == WEATHER["function"]["parameters"]
    assert seen[-1] == [WEATHER, TIME]  # the template sees the tools
    req = parse_completion({"model": "m", **chat, "tool_choice": "required", "parallel_tool_calls": False}, chat=True,
                           default_max_tokens=16, chat_template=tpl)
    schema = req.params.structured_outputs.json
    assert req.tool_choice == "required" and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    none = parse_completion({"model": "m", **chat, "tool_choice": "none"}, chat=True, default_max_tokens=16,
                            chat_template=tpl)
    assert none.tool_choice is None and none.params.structured_outputs is None and seen[-1] == [WEATHER, TIME]
    calls = tool_calls('[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", "parameters": {}}]',
                       "required")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("time", {})]
    assert tool_calls('{"city": "Oslo"}', "weather")[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    # an earlier answer's calls and the tool's result reach the template
    history = parse({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
        {"role": "tool", "content": "noon", "tool_call_id": "c1"}]}, chat=True)
    assert history.prompts == ("a  noon",)


@pytest.mark.parametrize("body, field", [
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto" by default: needs a parser there is not
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "code"}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "a", "tool_calls": []}]}, "messages"),
])
def test_bad_tools_name_their_field(body, field):
    with pytest.raises(BadRequest) as e:
        parse({"messages": [{"role": "user", "content": "a"}], **body}, chat=True)
    assert e.value.param == field, (str(e.value), e.value.param)


def test_chat_template_kwargs_generation_prompt_and_continuing_the_last_message():
    calls = []

    def tpl(messages, add_generation_prompt=True, tools=None, **kw):
        calls.append((add_generation_prompt, kw))
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + (
            "<assistant>" if add_generation_prompt else "")

    def chat(**body):
        msgs = body.pop("messages", [{"role": "user", "content": "q"}])
        return parse_completion({"model": "m", "messages": msgs, **body}, chat=True, default_max_tokens=8,
                                chat_template=tpl).prompts[0]

    assert chat(chat_template_kwargs={"thinking": True}) == "<user>q</user><assistant>"
    assert calls[-1] == (True, {"thinking": True})
    assert chat(add_generation_prompt=False) == "<user>q</user>" and calls[-1] == (False, {})
    prefix = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    assert chat(messages=prefix, continue_final_message=True) == "<user>q</user><assistant>The answer is"
    for body, field in ((dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
                        (dict(chat_template_kwargs=[1]), "chat_template_kwargs"),
                        (dict(continue_final_message=True), "continue_final_message"),  # the last is the user's
                        (dict(messages=prefix, continue_final_message=True, add_generation_prompt=True),
                         "continue_final_message"),
                        (dict(add_generation_prompt="yes"), "add_generation_prompt")):
        with pytest.raises(BadRequest) as e:
            chat(**body)
        assert e.value.param == field, body


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", "b c", "\n", "</th"]),
                max_size=12), st.lists(st.integers(0, 60), max_size=6))
def test_thinking_splits_the_same_however_the_text_is_streamed(pieces, cuts):
    from lockstep.openai_reasoning import ThinkSplitter, split_reasoning

    text = "".join(pieces)
    reasoning, content = split_reasoning(text)
    s, got_r, got_c = ThinkSplitter(), [], []
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in zip(bounds, bounds[1:] + [len(text)]):
        r, c = s.feed(text[a:b], final=b == len(text) and a == bounds[-1])
        got_r.append(r)
        got_c.append(c)
    r, c = s.feed("", final=True)
    assert ("".join(got_r) + r or None, "".join(got_c) + c or None) == (reasoning, content)
    # vLLM's deepseek_r1 rule: a leading <think> dropped, up to the first </think> is thinking
    body = text[len("<think>"):] if text.startswith("<think>") else text
    think, sep, answer = body.partition("</think>")
    assert (reasoning, content) == (think or None, answer or None)


V3_CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n{\"city\": \"Oslo\"}\n```"
           "<｜tool▁call▁end｜>")
V31_CALL = "<｜tool▁call▁begin｜>time<｜tool▁sep｜>{}<｜tool▁call▁end｜>"


def test_deepseek_tool_calls_are_read_from_the_answer():
    from lockstep.openai_tool_parser import parse_tool_calls

    content, calls = parse_tool_calls("Let me look.<｜tool▁calls▁begin｜>" + V3_CALL + V31_CALL + "<｜tool▁calls▁end｜>")
    assert content == "Let me look."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("weather", '{"city": "Oslo"}'), ("time", "{}")]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert parse_tool_calls("<｜tool▁calls▁begin｜>" + V31_CALL)[0] is None  # no text before: content null
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    assert parse_tool_calls("<｜tool▁calls▁begin｜>garbage") == ("<｜tool▁calls▁begin｜>garbage", [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 200), max_size=8))
def test_deepseek_tool_calls_stream_the_same_however_the_text_is_split(cuts):
    from lockstep.openai_tool_parser import AutoToolStream, parse_tool_calls

    text = "Sure: <｜tool▁call" + "<｜tool▁calls▁begin｜>" + V3_CALL + "\n" + V31_CALL + "<｜tool▁calls▁end｜>"
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    s, content, calls = AutoToolStream(), "", []
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    for k, piece in enumerate(pieces):
        d = s.delta(piece, finished=k == len(pieces) - 1) or {}
        content += d.get("content", "")
        calls += d.get("tool_calls", [])
    want_content, want = parse_tool_calls(text)
    assert content == want_content and [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in want]


def test_a_prompt_that_closes_the_thinking_is_seen():
    from lockstep.openai_reasoning import ThinkSplitter, thinking_closed
    from lockstep.runtime.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    for text, closed in (("q<think>a</think>", True), ("q</think>", True), ("q</think> more<think>", False),
                         ("q<think>", False), ("plain", False)):
        assert thinking_closed(tok, tok.encode(text)) == closed, text
    assert ThinkSplitter(closed=True).feed("a</think>b", final=True) == ("", "a</think>b")


def test_an_earlier_answer_sent_back_as_it_came_is_taken():
    """The openai client sends an assistant message back with its null fields (refusal,
    audio, ...) and lockstep's reasoning_content: taken; a field with a value it does not
    know is still refused."""
    seen = []

    def tpl(messages, add_generation_prompt=True, tools=None, **kw):
        seen.append(messages)
        return "x"

    back = {"role": "assistant", "content": "hi", "refusal": None, "audio": None, "function_call": None,
            "annotations": None, "tool_calls": None, "reasoning_content": "thought"}
    parse_completion({"model": "m", "messages": [{"role": "user", "content": "a"}, back]}, chat=True,
                     default_max_tokens=8, chat_template=tpl)
    assert seen[-1][1] == {"role": "assistant", "content": "hi", "reasoning_content": "thought"}
    with pytest.raises(BadRequest, match="audio not supported"):
        parse({"messages": [{"role": "user", "content": "a"}, dict(back, audio={"id": "x"})]}, chat=True)


def test_a_named_functions_text_is_its_call_even_cut_short():
    from lockstep.openai_reasoning import split_reasoning
    from lockstep.openai_tools import tool_calls

    assert tool_calls('{"city": "Os', "weather")[0]["function"]["arguments"] == '{"city": "Os'
    assert tool_calls('[{"name": "f", "parameters": {"s": "a\x01"}}]', "required")[0]["function"]["name"] == "f"
    assert split_reasoning("abc</think>") == ("abc", None)  # (vLLM's: nothing after it is null)


def test_vllm_stop_string_and_truncation_fields_pass_through():
    job = parse({"prompt": [5, 6, 7], "stop": ["x"], "include_stop_str_in_output": True, "truncate_prompt_tokens": 2})
    assert job.params.include_stop_str_in_output is True and job.params.truncate_prompt_tokens == 2
    with pytest.raises(BadRequest) as e:
        parse({"prompt": [5], "truncate_prompt_tokens": 0})
    assert e.value.param == "truncate_prompt_tokens"
