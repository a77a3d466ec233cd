"""Hypothesis profiles: "ci" is derandomized (same examples every run), "dev" is quicker.

Pick one with HYPOTHESIS_PROFILE=ci|dev (default dev).
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=50, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=25)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
