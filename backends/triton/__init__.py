"""The Triton backends (`backend`: `triton-cuda`, `triton-rocm`) and their kernels (`kernels/`)."""
