"""Talking to `lockstep serve` with the official openai client.

    .venv/bin/lockstep serve --model tiny --port 8000 &
    .venv/bin/python examples/openai_client.py --base-url http://127.0.0.1:8000/v1
"""

import argparse

import openai


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused")
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
    print("completion:", repr(out.choices[0].text), out.usage)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=8, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print("\nusage:", chunk.usage)


if __name__ == "__main__":
    main()
