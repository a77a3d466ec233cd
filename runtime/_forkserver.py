"""Imported only in the multiprocessing forkserver that runtime processes start from (it is
in ``RuntimeClient``'s forkserver preload list, and nothing else imports it).

The forkserver holds SIGTERM off, as the runtimes ignore it: a service manager's SIGTERM to
the whole process group must not take it down while the engine drains (the engine would read
that as every runtime exiting, code 255, and fail their requests). It still ends when the
engine goes away: multiprocessing closes its alive pipe.

Blocked, not ignored or handled in Python: a process the forkserver forks inherits the mask
and unblocks it as it starts (``register_at_fork``), so a SIGTERM sent to it at any moment,
even before Python in it has started, stays pending and then acts as the default does; another
library's forkserver processes (a pool, a data loader) still stop on ``terminate()``. Runtimes
ignore SIGTERM on their own (``lockstep.runtime.main``).
"""

import os
import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM}))
