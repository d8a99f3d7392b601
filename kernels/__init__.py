"""Triton kernels beside their torch references: arrive with the kernels issue."""
