"""C kernels for the CPU (OpenMP), compiled on first use by build.py and called through ctypes."""
