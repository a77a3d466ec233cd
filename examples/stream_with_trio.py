"""Streaming several requests concurrently with the trio-native API.

    .venv/bin/python examples/stream_with_trio.py

Each request's deltas arrive as they are generated; leaving a loop early (or
``engine.abort``) stops that request and frees its KV blocks.
"""

import trio

import lockstep
from lockstep import EngineConfig, SamplingParams


async def one(engine, name: str, prompt: str, max_tokens: int) -> None:
    async for out in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)):
        if out.finished:
            print(f"[{name}] {out.num_output_tokens} tokens, ttft {out.ttft_s * 1e3:.1f} ms, "
                  f"e2e {out.e2e_s * 1e3:.1f} ms, finish_reason={out.finish_reason}")


async def main() -> None:
    async with lockstep.open_engine(EngineConfig(model="tiny")) as engine:
        async with trio.open_nursery() as nursery:
            for i, n in enumerate((8, 32, 64)):
                nursery.start_soon(one, engine, f"req{i}", f"prompt number {i}", n)
        with trio.move_on_after(0.05):  # a request cut short by its caller
            async for _ in engine.generate("long", SamplingParams(max_tokens=4000, ignore_eos=True)):
                pass
        await trio.sleep(0.05)  # the abort lands at the next step boundary
        print("after all:", engine.statistics())


if __name__ == "__main__":
    trio.run(main)
