"""The runner: one process per GPU (or CPU) that executes the batched multi-LoRA engine."""
