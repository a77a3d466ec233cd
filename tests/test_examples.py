"""The Python examples in examples/ run as a user runs them (the tiny preset on CPU)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script, expect", [
    ("offline_inference.py", ["'Hello, my name is' -> ", "sampled: ", "from token ids: "]),
    ("stream_with_trio.py", ["[req2] 64 tokens", "running=0, waiting=0, kv_blocks_used=0"]),
    ("structured_outputs.py", ["json: '{\"name\": ", "  parsed: {'name': ", "choice: '", "grammar: '", "chat: '"]),
])
def test_example_runs(script, expect):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in expect:
        assert line in out.stdout, out.stdout
