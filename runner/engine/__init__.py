"""Scheduling: requests, continuous batching, KV pages, the step batch; tensor-parallel ranks."""
