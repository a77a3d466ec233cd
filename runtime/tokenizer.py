"""Tokenizers for the frontend and the runtime: a byte-level one for presets (no files
needed) and a wrapper around a Hugging Face ``tokenizer.json``, plus the incremental
detokenizer that turns streamed token ids into text deltas.

Both tokenizers decode invalid or incomplete UTF-8 to U+FFFD; the incremental detokenizer
relies on that to hold back a character whose bytes are split across tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

_REPLACEMENT = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used."""


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int
    # Whether a plain text prompt (not a chat, whose template writes its own) starts with
    # bos: the checkpoint's ``add_bos_token``, as Hugging Face and vLLM encode prompts.
    add_bos: bool

    def encode(self, text: str, add_bos: bool = False) -> np.ndarray: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str: ...


def default_chat_template(messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None) -> str:
    """Plain-text turns; used where a checkpoint brings no template of its own. Tools come
    first, as a system turn of their JSON; an answer's tool calls as JSON after its text."""
    text = f"<|system|>\nTools:\n{json.dumps(tools, ensure_ascii=False)}\n" if tools else ""
    text += "".join(f"<|{m['role']}|>\n{m['content']}"
                    + (json.dumps(m["tool_calls"], ensure_ascii=False) if m.get("tool_calls") else "") + "\n"
                    for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


class ByteTokenizer:
    """ids 0..2 are bos, eos, pad; 3..258 are the bytes 0..255; ids above (up to the
    model's vocab size) are unused and decode to nothing."""

    SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
    OFFSET = len(SPECIALS)

    def __init__(self, vocab_size: int = 512):
        if vocab_size < self.OFFSET + 256:
            raise TokenizerError(f"a byte tokenizer needs a vocab of at least {self.OFFSET + 256}, "
                                 f"got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id, self.eos_token_id, self.pad_token_id = 0, 1, 2
        self.add_bos = False  # the presets' random models were never trained with one

    def encode(self, text: str, add_bos: bool = False) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + self.OFFSET
        return np.concatenate([[self.bos_token_id], ids]).astype(np.int32) if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out, raw = [], bytearray()
        for i in map(int, ids):
            if self.OFFSET <= i < self.OFFSET + 256:
                raw.append(i - self.OFFSET)
            elif i < self.OFFSET and not skip_special_tokens:
                out.append(raw.decode("utf-8", errors="replace") + self.SPECIALS[i])
                raw.clear()
        return "".join(out) + raw.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """(``kwargs``: a template's own variables, which the plain template has none of.)"""
        return default_chat_template(messages, add_generation_prompt, tools)


class HFTokenizer:
    """``tokenizer.json`` through the `tokenizers` library; bos/eos and the chat template
    from ``tokenizer_config.json``, falling back to ``config.json``'s token ids."""

    def __init__(self, model_dir: str | Path):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise TokenizerError("HFTokenizer needs the `tokenizers` package") from None
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path} does not exist: a checkpoint directory needs a "
                                 "Hugging Face tokenizer.json")
        self._tok = _Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        self.bos_token_id = self._special_id(tok_cfg, model_cfg, "bos")
        eos = self._special_id(tok_cfg, model_cfg, "eos")
        if eos is None:
            raise TokenizerError(f"{model_dir}: no eos token in tokenizer_config.json or config.json")
        self.eos_token_id = eos
        self._template = _chat_template(tok_cfg)
        # The checkpoint's add_bos_token, or a post-processor of its own that adds bos (as the
        # `tokenizers` library applies it, and so Hugging Face and vLLM encode prompts).
        self.add_bos = self.bos_token_id is not None and (
            tok_cfg.get("add_bos_token") is True
            or self._tok.encode("a", add_special_tokens=True).ids[:1] == [self.bos_token_id])
        self._token_strings = {k: _token_str(tok_cfg.get(f"{k}_token")) or "" for k in ("bos", "eos")}

    def _special_id(self, tok_cfg: dict, model_cfg: dict, kind: str) -> int | None:
        name = _token_str(tok_cfg.get(f"{kind}_token"))
        if name is not None and self._tok.token_to_id(name) is not None:
            return self._tok.token_to_id(name)
        value = model_cfg.get(f"{kind}_token_id")
        return value[0] if isinstance(value, list) and value else value

    @property
    def backend(self):
        """The `tokenizers` library's Tokenizer (structured outputs read its vocabulary)."""
        return self._tok

    def encode(self, text: str, add_bos: bool = False) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """``kwargs``: the template's own variables (vLLM's chat_template_kwargs: DeepSeek-V3.1's
        ``thinking``, say)."""
        if self._template is None:
            return default_chat_template(messages, add_generation_prompt, tools)
        return self._template.render(**kwargs, messages=list(messages), tools=tools,
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=self._token_strings["bos"],
                                     eos_token=self._token_strings["eos"])


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(tok_cfg: dict):
    source = tok_cfg.get("chat_template")
    if isinstance(source, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None  # without jinja2 the plain default template is used

    def raise_exception(message: str):
        raise TokenizerError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def custom_chat_template(tokenizer, source: str):
    """``apply_chat_template`` with a Jinja template of the caller's (vLLM's ``chat_template``
    argument) in place of the tokenizer's own; raises TokenizerError where it does not parse."""
    if not isinstance(source, str) or not source.strip():
        raise TokenizerError(f"chat_template must be a Jinja template (a non-empty string), got {source!r}")
    try:
        import jinja2
    except ImportError:
        raise TokenizerError("chat_template needs jinja2 (pip install jinja2)") from None
    try:
        template = _chat_template({"chat_template": source})
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat_template does not parse: {e}") from None
    strings = getattr(tokenizer, "_token_strings", {"bos": "", "eos": ""})

    def apply(messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        return template.render(**kwargs, messages=list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                               bos_token=strings["bos"], eos_token=strings["eos"])
    return apply


def load_tokenizer(model: str | Path, vocab_size: int | None = None) -> ByteTokenizer | HFTokenizer:
    """A checkpoint directory gives its HF tokenizer; a preset name the byte tokenizer."""
    if Path(model).is_dir():
        return HFTokenizer(model)
    from lockstep.runtime.models.config import preset_names  # torch-free

    if str(model) not in preset_names():
        raise TokenizerError(f"{str(model)!r} is neither a checkpoint directory nor a preset "
                             f"{preset_names()}")
    return ByteTokenizer(vocab_size or 512)


class IncrementalDetokenizer:
    """Feed token ids as they are generated; get back only the new text.

    Decodes a short window (the last emitted tokens as context, then the unread ones) so
    tokenizers whose pieces depend on their neighbours (leading spaces) decode right,
    and holds back text ending in U+FFFD: the rest of that character's bytes may come
    with the next token. ``finish`` flushes whatever is held back.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = [int(i) for i in prompt_ids[-6:]]  # context only; never emitted
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, ids: Iterable[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def finish(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if len(text) <= len(prefix_text) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text):]
