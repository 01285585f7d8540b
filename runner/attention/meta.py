"""Per-step attention metadata, built once per step from the batch and shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttnMeta:
    """Requests of one step in batch order: prefill requests first, then decode requests.

    For request i: its query rows are `qo_indptr[i]:qo_indptr[i+1]` of the flat batch, its
    KV length after this step is `kv_lens[i]`, and its page table is `page_tables[i]`.
    `slot_mapping[t]` is the flat KV slot (page * page_size + offset) the token t writes.
    """

    num_prefill: int  # the first num_prefill requests are prefill, the rest decode (1 row each)
    qo_indptr: list[int]  # [B + 1]
    kv_lens: list[int]  # [B]
    page_tables: list[list[int]]  # [B][pages]
    page_size: int
    slot_mapping: torch.Tensor  # int64 [T] on device

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    @property
    def num_prefill_tokens(self) -> int:
        return self.qo_indptr[self.num_prefill]
