"""A chat request's messages through the model's chat template: the roles and content parts
OpenAI's API allows, checked at the boundary (``BadRequest`` naming the message and field),
and vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs."""

from __future__ import annotations

from .openai_protocol import BadRequest

class TemplateRefused(BadRequest):
    """The chat template raised while rendering the messages (the template's fault, or the
    messages'; the server names messages, the Python API a chat_template it was given)."""

    cause = ""  # what the template raised


_RESERVED = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


def chat_prompt(body: dict, chat_template, tools: list[dict] | None = None) -> str:
    """The conversation's text through the model's template: vLLM's add_generation_prompt
    (default true), continue_final_message (the last message, an assistant's, left open for
    the answer to continue) and chat_template_kwargs (the template's own variables)."""
    msgs = _messages(body)
    gen = body.get("add_generation_prompt", True)
    cont = body.get("continue_final_message", False)
    kw = body.get("chat_template_kwargs") or {}
    for name, v in (("add_generation_prompt", gen), ("continue_final_message", cont)):
        if not isinstance(v, bool):
            raise BadRequest(f"{name} must be true or false, got {v!r}", name)
    if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw) or _RESERVED & set(kw):
        raise BadRequest(f"chat_template_kwargs must be an object of the template's own variables (not "
                         f"{', '.join(sorted(_RESERVED))}), got {str(kw)[:120]}", "chat_template_kwargs")
    if cont:
        if gen and "add_generation_prompt" in body:
            raise BadRequest("continue_final_message and add_generation_prompt cannot both be true",
                             "continue_final_message")
        if msgs[-1]["role"] != "assistant" or not msgs[-1]["content"]:
            raise BadRequest("continue_final_message needs the last message to be an assistant's, with content",
                             "continue_final_message")
        gen = False
    opts = dict(kw)
    if tools:
        opts["tools"] = tools
    try:
        text = chat_template(msgs, add_generation_prompt=gen, **opts) if (opts or not gen) else chat_template(msgs)
    except BadRequest:
        raise
    except Exception as e:  # noqa: BLE001 - the template refused the conversation (roles must
        # alternate, say: a ValueError, or jinja2's TemplateError from raise_exception), or failed
        refused = TemplateRefused(f"messages: the model's chat template refused them: {e}", "messages")
        refused.cause = str(e)
        raise refused from None
    if cont:  # cut after the last message's text, as Hugging Face's continue_final_message does
        at = text.rfind(msgs[-1]["content"])
        if at < 0:
            raise BadRequest("continue_final_message: the chat template did not write the last message's content "
                             "as given", "continue_final_message")
        text = text[:at + len(msgs[-1]["content"])]
    return text


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise BadRequest(f"messages[{i}].role must be system, user, assistant, tool or developer", "messages")
        if "content" not in m and m.get("role") != "assistant":
            raise BadRequest(f"messages[{i}] has no content", "messages")
        content = m.get("content")
        if content is None and m.get("role") == "assistant":  # an assistant turn may be content-less
            content = ""
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
                raise BadRequest(f"messages[{i}].content parts must be text parts", "messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
        # (a client sends an earlier answer back as it came: fields at null ask for nothing)
        extra = {k for k, v in m.items() if v is not None} - {"role", "content", "name", "tool_call_id", "tool_calls",
                                                               "reasoning_content"}
        if extra:
            raise BadRequest(f"messages[{i}]: {', '.join(sorted(extra))} not supported (role, content, name, "
                             "tool_call_id, tool_calls and reasoning_content are)", "messages")
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("reasoning_content"), str):  # an earlier answer's thinking, for the template
            msg["reasoning_content"] = m["reasoning_content"]
        calls = m.get("tool_calls")
        if calls is not None:  # an earlier answer's calls, for the template
            if m["role"] != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) and isinstance(c["function"].get("arguments"), str)
                    for c in calls):
                raise BadRequest(f"messages[{i}].tool_calls must be an assistant's list of "
                                 '{"id", "type": "function", "function": {"name", "arguments" (a string)}}', "messages")
            msg["tool_calls"] = calls
        for key in ("name", "tool_call_id"):  # handed to the chat template, which may use them
            if key in m:
                if not isinstance(m[key], str):
                    raise BadRequest(f"messages[{i}].{key} must be a string", "messages")
                msg[key] = m[key]
        out.append(msg)
    return out
