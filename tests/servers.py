"""Waiting for `lockstep serve` processes the tests start (their health endpoint answers)."""

import subprocess
import time

import httpx


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 60.0) -> None:
    """Until ``url``/health says 200; fails with the process's output if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, f"server at {url} did not come up"
        time.sleep(0.2)
