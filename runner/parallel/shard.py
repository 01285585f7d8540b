"""Which slice of every weight (and of every LoRA adapter) a tensor-parallel rank holds.

Megatron-style split over G ranks (G divides the query and the KV heads and the MLP width):

    column-parallel (split the output rows):  q, k, v (by whole heads), gate, up
    row-parallel    (split the input columns): o, down   -> one all-reduce after each
    replicated: embeddings, lm_head, norms (the vocabulary stays whole: every rank computes the
    same logits from the same all-reduced hidden state, so no all-gather and no extra traffic).

The checkpoint loader (runner/model/weights.py) reads each rank's rows or columns of every tensor
through the family's plan (lorafleet.models.contract.checkpoint_plan), fused checkpoint tensors part
by part.

LoRA follows the layer it adds to, with no communication of its own: for column-parallel layers B
is split by output and A kept whole; for row-parallel layers A is split by input and B kept whole,
so the expand's partial sums join the layer's all-reduce. Biases of row-parallel layers live on
rank 0 only (the all-reduce adds them once).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lorafleet.models.contract import SPLIT_DIM, ModelConfig, ModelConfigError

COLUMN = tuple(p for p, d in SPLIT_DIM.items() if d == 0)  # projections split by output
ROW = tuple(p for p, d in SPLIT_DIM.items() if d == 1)  # projections split by input


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is out of range")

    def check(self, cfg: ModelConfig) -> None:
        """A clear error when this model cannot be split G ways."""
        g = self.size
        bad = [f"{what} ({n})" for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                                               ("MLP width", cfg.intermediate_size)) if n % g]
        if bad:
            raise ModelConfigError(f"tensor parallelism over {g} GPUs needs {g} to divide the model's "
                                   + ", ".join(bad))

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The per-rank model config: its heads, KV heads and MLP width (hidden size and head size whole)."""
        self.check(cfg)
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // self.size,
                                   num_kv_heads=cfg.num_kv_heads // self.size,
                                   intermediate_size=cfg.intermediate_size // self.size)

    def span(self, n: int) -> tuple[int, int]:
        """This rank's [lo, hi) of a dimension of n split evenly."""
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k


def lora_slice(proj: str, in_dim: int, out_dim: int, shard: Shard) -> tuple[str, int, int] | None:
    """Which factor of a LoRA pair on `proj` a rank slices: ("b", lo, hi) over the output for
    column-parallel projections, ("a", lo, hi) over the input for row-parallel ones."""
    if shard.size == 1:
        return None
    if proj in COLUMN:
        return ("b", *shard.span(out_dim))
    return ("a", *shard.span(in_dim))
