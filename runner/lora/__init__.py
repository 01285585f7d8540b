"""LoRA adapters: loading, the slot pool, and the SGMV add-on."""
