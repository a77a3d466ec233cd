"""Files a runtime process made that must not outlive it, whatever way it ends.

The code that makes such a file removes it on its own paths (``track`` it when made,
``untrack`` it when removed); the engine watcher's hard exit (``runtime.main``), which skips
every ``finally``, calls ``remove_all`` for those a blocked thread never got to remove.
"""

from __future__ import annotations

import os
import threading

_paths: set[str] = set()
_lock = threading.Lock()


def track(path: str) -> None:
    with _lock:
        _paths.add(path)


def untrack(path: str) -> None:
    with _lock:
        _paths.discard(path)


def remove_all() -> None:
    with _lock:
        paths = sorted(_paths)
        _paths.clear()
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
