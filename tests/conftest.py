"""Hypothesis profiles: "ci" is derandomized (same examples every run), "dev" is quicker.

Pick one with HYPOTHESIS_PROFILE=ci|dev (default dev).
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=50, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=25)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# A test runner started in the background by a non-interactive shell inherits SIGINT ignored
# (POSIX), and Python then installs no KeyboardInterrupt handler; the Ctrl-C tests (in this
# process and in the commands they start, which inherit it) need the usual one.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
