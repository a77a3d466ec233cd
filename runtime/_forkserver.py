"""Imported only in the multiprocessing forkserver that runtime processes start from (it is
in ``RuntimeClient``'s forkserver preload list, and nothing else imports it).

The forkserver ignores SIGTERM, as the runtimes do: a service manager's SIGTERM to the whole
process group must not take it down while the engine drains (the engine would read that as
every runtime exiting, code 255, and fail their requests). It still ends when the engine
goes away: multiprocessing closes its alive pipe.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
