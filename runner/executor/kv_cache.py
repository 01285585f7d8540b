"""The KV page pool: one K and one V tensor of pages per layer, batch dimension outermost.

Layout per layer: `[num_pages, page_size, num_kv_heads, head_dim]` (flashinfer's "NHD"),
so a request's cache is just the pages its page table names; requests enter and leave the
batch independently (Punica §5.4).
"""

from __future__ import annotations

import torch

from lorafleet.runner.config import ModelConfig


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.kv_dim * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages, self.page_size = num_pages, page_size
        # the same views every step: per layer, and per layer as [num_pages * page_size, kv_heads, head_dim]
        self._layers = [(self.k[i], self.v[i]) for i in range(cfg.num_layers)]
        self._flat = [tuple(t.view(-1, *t.shape[-2:]) for t in kv) for kv in self._layers]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def flat(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i as [num_pages * page_size, kv_heads, head_dim] views (token slots)."""
        return self._flat[i]
