"""Tensor parallelism: one runner drives a group of GPUs of one node as one engine."""
