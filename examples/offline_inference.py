"""Batch generation from a script with the synchronous API, as with vLLM's ``LLM``.

    .venv/bin/python examples/offline_inference.py            # the tiny preset on CPU
    .venv/bin/python examples/offline_inference.py --model /path/to/checkpoint --device cuda --dtype bfloat16

The engine starts once, when the ``LLM`` is made, and serves every ``generate`` call.
"""

import argparse

from lockstep import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=0, logprobs=1)
    with LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=2048) as llm:
        for prompt, out in zip(prompts, llm.generate(prompts, greedy)):
            print(f"{prompt!r} -> {out.text!r} ({out.finish_reason}, {len(out.token_ids)} tokens)")
        out = llm.generate(prompts[0], sampled)[0]  # one prompt, one Completion in a list
        print(f"sampled: {out.text!r}; first token's logprob {out.logprobs[0][1]:.3f}")
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy)[0]  # token ids, vLLM's dict form
        print(f"from token ids: {out.token_ids.tolist()}")


if __name__ == "__main__":  # runtimes start from a forkserver, which re-imports __main__
    main()
