"""Names of the seven LoRA-able projections of a Llama layer, in one place."""

from __future__ import annotations

# Index order is the order of the adapter pool's per-layer tables.
PROJECTIONS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
PROJ_INDEX = {name: i for i, name in enumerate(PROJECTIONS)}

# PEFT / HF module names of each projection inside a Llama decoder layer.
HF_MODULE = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
HF_SHORT = {mod.split(".")[-1]: proj for proj, mod in HF_MODULE.items()}  # "q_proj" -> "q"

# Projections that read the same input and run as one LoRA launch.
GROUPS: tuple[tuple[str, ...], ...] = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))


def proj_shape(proj: str, hidden: int, intermediate: int, q_dim: int, kv_dim: int) -> tuple[int, int]:
    """(in_features, out_features) of a projection for a model's dimensions."""
    return {
        "q": (hidden, q_dim),
        "k": (hidden, kv_dim),
        "v": (hidden, kv_dim),
        "o": (q_dim, hidden),
        "gate": (hidden, intermediate),
        "up": (hidden, intermediate),
        "down": (intermediate, hidden),
    }[proj]
