"""bench_kernels.py's sections: the Bench harness (core) and one module per group of kernels."""
