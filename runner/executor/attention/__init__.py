"""Paged attention backends: plain torch (CPU, reference) and flashinfer (CUDA)."""
