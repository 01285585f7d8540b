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


def fa3_tile_rows(head_dim: int) -> int:
    """Query rows of one FA3 prefill work item (flashinfer 0.5.3: 192 for head_dim 64, else 128)."""
    return 192 if head_dim == 64 else 128


def prefill_kernel(qo_lens: list[int], num_heads: int, head_dim: int, num_sms: int) -> str:
    """flashinfer's prefill kernel for one step's prompt rows when both may run (sm90,
    LORAFLEET_PREFILL_BACKEND=auto): "fa2" while FA3's work items would occupy at most a quarter of
    the SMs, else "fa3".

    FA3's plan makes one work item per (tile of a request's query rows, query head) and never splits the
    K/V, so a short chunk of a long prompt (a 64-row chunk beside the decodes, over a 7,000-token prefix:
    32 items for Llama-2-7B) keeps 32 of 132 SMs busy; FA2's plan splits the K/V across CTAs. Measured on
    the H200 (Llama-2-7B shape, 8,000-token prompts chunked beside 31 decodes, docs/benchmarks.md §3.2):
    with 64-row chunks (32 items) a step with prompt rows takes 11.1 ms with FA2 against 12.2 with FA3
    (the late chunks' attention 1.33 against 3.58 ms); with 256-row chunks (64 items) 16.6 ms with FA3
    against 17.0 with FA2, and with 1,024-row chunks 40.4 against 42.7: once the chunk is long enough
    FA3's faster tensor-core loop wins with a partly idle card.
    The choice counts all prompt rows of the step, so a prompt's attention output (and, in the last bits,
    its logits) can depend on which other prompts share its step, as its chunk boundaries already do.
    Decode rows never take this kernel."""
    tile = fa3_tile_rows(head_dim)
    items = sum(-(-n // tile) for n in qo_lens) * num_heads
    return "fa3" if 4 * items > num_sms else "fa2"
