"""Sans-I/O policies: everything that decides, with no trio, no torch, no clocks.

Time is passed in as ``now``; randomness takes an explicit seed. The trio engine and the
simulator drive these same objects.
"""
