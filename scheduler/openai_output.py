"""The OpenAI server's response shapes that are pure data: logprobs (OpenAI's completions
and chat shapes), vLLM's prompt_logprobs, usage."""

from __future__ import annotations

from .openai_protocol import Job


def _token_text(tokenizer):
    """A token's text (its id as text without a tokenizer)."""
    def text(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else str(t)
    return text


def logprobs_json(tokenizer, rows: list, chat: bool, offset: int = 0) -> dict:
    """OpenAI's shapes: chat's ``content`` list, or completions' parallel lists, whose
    ``text_offset`` counts from ``offset`` (a stream's: the tokens' text before this chunk)."""
    text = _token_text(tokenizer)
    rows = [r[:3] for r in rows]  # (token, logprob, top); a prompt row's rank is prompt_logprobs_json's
    if chat:
        return {"content": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode()),
                             "top_logprobs": [{"token": text(u), "logprob": v, "bytes": list(text(u).encode())}
                                              for u, v in top]} for t, lp, top in rows]}
    offsets, pos = [], offset
    for t, _, _ in rows:
        offsets.append(pos)
        pos += len(text(t))
    # As OpenAI's: the sampled token is always among top_logprobs (up to logprobs + 1 entries),
    # with its own logprob where another top token decodes to the same text (a partial UTF-8
    # byte reads as the same replacement character); an echoed prompt's first token has
    # neither (None, as vLLM's).
    tops = [None if lp is None else {**{text(u): v for u, v in top}, text(t): lp} for t, lp, top in rows]
    return {"tokens": [text(t) for t, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(tokenizer, rows: list | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token and the top ones (rank: 1 for the most likely; the token's
    own from the runtime, which counts the ids more likely than it, also outside the top)."""
    if rows is None:
        return None
    text = _token_text(tokenizer)
    out = []
    for t, lp, top, *rank in rows:
        if lp is None:
            out.append(None)
            continue
        ranks = {u: j + 1 for j, (u, _) in enumerate(top)}
        own = rank[0] if rank and rank[0] is not None else ranks.get(t)
        entry = {str(t): {"logprob": lp, "rank": own, "decoded_token": text(t)}}
        for u, v in top:
            entry.setdefault(str(u), {"logprob": v, "rank": ranks[u], "decoded_token": text(u)})
        out.append(entry)
    return out


def usage(finals: list, job: Job) -> dict:
    prompt = sum(f.num_prompt_tokens for f in finals[::job.n])
    completion = 0 if job.echo_only else sum(f.num_output_tokens for f in finals)
    cached = sum(f.num_cached_tokens for f in finals[::job.n])  # OpenAI's: prompt tokens from the cache
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
