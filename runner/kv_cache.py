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
        self._layers = [(self.k[i], self.v[i]) for i in range(cfg.num_layers)]  # the same views every step

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def flat(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i as [num_pages * page_size, kv_heads, head_dim] views (token slots)."""
        k, v = self.k[i], self.v[i]
        return k.view(-1, k.shape[-2], k.shape[-1]), v.view(-1, v.shape[-2], v.shape[-1])
