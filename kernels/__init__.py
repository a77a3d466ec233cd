"""Triton kernels, each above its launcher and next to a torch reference."""
