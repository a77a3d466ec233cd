"""`lockstep generate`: stream one answer from a model, for trying a model or a checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trio


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="stream one completion from a model")
    g.add_argument("prompt", help="prompt text")
    add_engine_flags(g)
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1: off")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1: off")
    g.add_argument("--seed", type=int, help="sampling seed (a fixed seed repeats the same answer)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=_ids, default=(), metavar="ID,ID,...", help="token ids that end the output")
    g.add_argument("--ignore-eos", action="store_true", help="go on past the end of sequence (up to --max-tokens)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="in [0.0001, 10000]: a prompt or output token's positive logit divided by it, a negative "
                        "one multiplied; 1: off")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted from a token's logit per time it was generated")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted from the logit of any token generated already")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="in [0, 1]: drop tokens less likely than this times the most likely one")
    g.add_argument("--min-tokens", type=int, default=0, help="no end of sequence or stop before this many tokens")
    g.add_argument("--logit-bias", action="append", default=[], type=_bias, metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit (repeatable; -100 bans it)")
    g.add_argument("--allowed-token-ids", type=_ids, metavar="ID,ID,...",
                   help="draw only these token ids (every other is masked)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    so = g.add_mutually_exclusive_group()  # structured outputs: at most one
    so.add_argument("--json-schema", metavar="SCHEMA", help="the output is JSON matching this schema (JSON text, or "
                    "@FILE to read it from a file)")
    so.add_argument("--regex", help="the output matches this regular expression")
    so.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    so.add_argument("--grammar", metavar="EBNF", help="the output follows this EBNF grammar (or @FILE)")


def _structured(args):
    """StructuredOutputsParams from --json-schema, --regex, --choice or --grammar (None: none)."""
    from lockstep.policy.request import StructuredOutputsParams

    for flag, kind in _STRUCTURED_FLAGS.items():
        v = getattr(args, flag)
        if v is None:
            continue
        if kind in ("json", "grammar") and v.startswith("@"):
            try:
                v = Path(v[1:]).read_text()
            except OSError as e:
                raise ValueError(f"--{flag.replace('_', '-')} {v}: cannot read the file: {e.strerror}") from None
        return StructuredOutputsParams(**{kind: v})
    return None


_STRUCTURED_FLAGS = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _flag_named(e):
    """A structured-outputs RequestError as the flag it came in (``--regex: ...``)."""
    from lockstep.policy.request import RequestError

    flag = next((f for f, k in _STRUCTURED_FLAGS.items() if e.field == f"structured_outputs.{k}"), None)
    if flag is None:
        return e
    return RequestError(str(e).replace(e.field, "--" + flag.replace("_", "-"), 1), field=e.field)


def _bias(text: str) -> tuple[int, float]:
    tid, sep, bias = text.partition("=")
    try:
        return int(tid), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (an integer token id, a number), got {text!r}") from None


def _ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integer token ids, got {text!r}") from None


def add_engine_flags(p) -> None:
    """What model to run and how: the flags `generate` and `serve` share."""
    p.add_argument("--model", default="tiny", help="preset name (tiny, v2-lite) or checkpoint directory")
    p.add_argument("--runtime", default="torch", help="runtime name (lockstep.runtimes entry point)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or float64 (weights and activations)")
    p.add_argument("--dep", type=int, default=1, help="data-parallel ranks (one scheduler and runtime each)")
    p.add_argument("--redundant-experts", type=int, default=0,
                   help="expert load balancing: spare expert slots over the ranks (a multiple of --dep)")
    p.add_argument("--eplb-window", type=int,
                   help="steps of expert loads per rebalance (with --redundant-experts; default 64)")
    p.add_argument("--instances", type=int, default=1,
                   help="instances of --dep ranks (with --prefill-instances: the decode pool's)")
    p.add_argument("--prefill-instances", type=int, default=0,
                   help="prefill/decode disaggregation: this many prefill instances (0: colocated)")
    p.add_argument("--prefill-dep", type=int, help="ranks per prefill instance (with --prefill-instances; default 1)")
    p.add_argument("--kv-transport", choices=["nixl", "shm"],
                   help="how decode runtimes pull KV from prefill runtimes (with --prefill-instances; default nixl)")
    p.add_argument("--draft-model", default="",
                   help="speculative decoding: a draft preset (tiny-draft), checkpoint directory, or layers:N "
                        "(the target's first N layers)")
    p.add_argument("--num-spec-tokens", type=int, help="draft tokens per decode step (with --draft-model; default 3)")
    p.add_argument("--spec-adaptive", action="store_true", help="propose fewer drafts while acceptance is low")


def eplb_config(args):
    """Expert load balancing from --redundant-experts / --eplb-window (None when off)."""
    if not args.redundant_experts:
        if args.eplb_window not in (None, 64):
            raise ValueError("--eplb-window needs --redundant-experts (expert load balancing; without spare "
                             "slots nothing is rebalanced)")
        return None
    from lockstep.policy.rebalance import EplbConfig
    return EplbConfig(redundant_experts=args.redundant_experts,
                      window_steps=64 if args.eplb_window is None else args.eplb_window)


def pd_options(args) -> dict:
    """Instances, prefill/decode disaggregation and speculative decoding from the command line
    (the speculation flags need a draft: alone they would do nothing)."""
    if not args.draft_model and (args.num_spec_tokens is not None or args.spec_adaptive):
        flag = "--num-spec-tokens" if args.num_spec_tokens is not None else "--spec-adaptive"
        raise ValueError(f"{flag} needs --draft-model (the model that proposes the drafts)")
    # (their defaults given explicitly, as a templated launch may, change nothing: accepted)
    if not args.prefill_instances and (args.prefill_dep not in (None, 1) or args.kv_transport not in (None, "nixl")):
        flag = "--prefill-dep" if args.prefill_dep not in (None, 1) else "--kv-transport"
        raise ValueError(f"{flag} needs --prefill-instances (prefill/decode disaggregation; without it nothing "
                         "is prefilled apart or moved)")
    return dict(instances=args.instances, prefill_instances=args.prefill_instances,
                prefill_dep=1 if args.prefill_dep is None else args.prefill_dep,
                kv_transport=args.kv_transport or "nixl", draft_model=args.draft_model,
                num_spec_tokens=3 if args.num_spec_tokens is None else args.num_spec_tokens,
                spec_adaptive=args.spec_adaptive)


def run_generate(args: argparse.Namespace) -> int:
    from lockstep.api import open_engine
    from lockstep.engine.config import EngineConfig
    from lockstep.policy.request import SamplingParams

    from lockstep.policy.request import RequestError

    try:
        so = _structured(args)
    except RequestError as e:
        raise _flag_named(e) from None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                            stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
                            repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                            presence_penalty=args.presence_penalty, min_p=args.min_p, min_tokens=args.min_tokens,
                            logit_bias=dict(args.logit_bias) or None, allowed_token_ids=args.allowed_token_ids,
                            structured_outputs=so)
    params.validate()
    config = EngineConfig(model=args.model, runtime=args.runtime, device=args.device, dtype=args.dtype,
                          dep=args.dep, eplb=eplb_config(args), **pd_options(args))

    async def main() -> None:
        async with open_engine(config) as engine:
            prompt = args.prompt
            if args.chat:
                text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                prompt = engine.tokenizer.encode(text)  # the template writes its own bos
            last = None
            async for out in engine.generate(prompt, params):
                sys.stdout.write(out.text)
                sys.stdout.flush()
                last = out
            sys.stdout.write("\n")
            timed = last.num_output_tokens > 1 and last.e2e_s is not None and last.ttft_s is not None
            rate = last.num_output_tokens / max(last.e2e_s - last.ttft_s, 1e-9) if timed else 0.0
            ttft = "-" if last.ttft_s is None else f"{last.ttft_s * 1e3:.1f} ms"
            print(f"[{last.num_output_tokens} tokens, finish: {last.finish_reason}, TTFT {ttft}, {rate:.1f} tokens/s]",
                  file=sys.stderr)
            if config.draft_model:
                sp = engine.spec_statistics()
                print(f"[speculative: {sp['drafts']} drafts, acceptance {sp['acceptance_rate']:.0%}, "
                      f"mean accepted length {sp['mean_accepted_length']:.2f}]", file=sys.stderr)

    from lockstep.policy.request import RequestError

    try:
        trio.run(main)
    except RequestError as e:
        raise _flag_named(e) from None
    return 0
