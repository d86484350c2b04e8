"""Weight formats and their kernels, one module a format (int8, int4); build.py chooses
among them by ModelConfig and the CPU."""
