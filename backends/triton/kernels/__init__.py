"""The Triton kernels: shared helpers (`common`), the apply, stage and consume kernels."""
