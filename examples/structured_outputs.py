"""Structured outputs with the synchronous API, as vLLM's: a JSON schema, a regular
expression, a choice, an EBNF grammar; and a chat through the model's template.

    .venv/bin/python examples/structured_outputs.py            # the tiny preset on CPU
    .venv/bin/python examples/structured_outputs.py --model /path/to/checkpoint --device cuda --dtype bfloat16

With the tiny preset's random weights the answers are random, but they match: the grammar
masks every token that would leave it. (Through the server: OpenAI's response_format, or
vLLM's structured_outputs and guided_* fields; see the README.)
"""

import argparse
import json

from lockstep import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    asks = {
        "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
        "choice": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
        "grammar": StructuredOutputsParams(grammar='root ::= ("yes" | "no") "!"'),
    }
    with LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=2048) as llm:
        for kind, so in asks.items():
            out = llm.generate("Answer:", SamplingParams(max_tokens=64, temperature=0.8, seed=1, structured_outputs=so))[0]
            print(f"{kind}: {out.text!r} ({out.finish_reason})")
            if kind == "json" and out.finish_reason == "stop":
                print("  parsed:", json.loads(out.text))
        chat = llm.chat([{"role": "user", "content": "Is the sky blue?"}],
                        SamplingParams(max_tokens=8, structured_outputs=asks["grammar"]))[0]
        print(f"chat: {chat.text!r}")


if __name__ == "__main__":  # runtimes start from a forkserver, which re-imports __main__
    main()
