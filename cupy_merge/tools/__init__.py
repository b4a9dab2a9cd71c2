"""Tools around the library: the self-check (``python -m cupy_merge``), the benchmark
(``python -m cupy_merge.bench``), the kernel sweep and GPU timing."""
