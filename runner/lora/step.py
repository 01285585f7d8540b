"""The LoRA half of one engine step: segment table + workspace, reused by every layer."""

from __future__ import annotations

import torch

from lorafleet.runner.config import KernelChoices
from lorafleet.runner.lora.pool import GROUP_SPANS, LoraPool
from lorafleet.runner.lora.segments import SegmentTable
from lorafleet.runner.lora.sgmv import SGMV


# Per projection group (qkv, o, gate_up, down: pool.GROUP_SPANS), the (shrink, expand) row counts from
# which a segment takes tensor cores, from `lorafleet bench kernels --prefill` on the H200
# (docs/benchmarks.md §1d, Llama-2-7B shapes, rank 16). The tensor-core kernels pay off for segments of
# a few hundred rows in the wide groups (qkv, gate_up), but only from ~512 rows for o and down (one
# projection, K = 11008 for down: too few 16-row tiles to fill the card). Below both thresholds a call
# is one fused CUDA-core launch, which is what a step with a short prompt chunk beside the decodes
# needs: with a 64-row chunk and 31 decode rows, down takes 40.6 us on tensor cores against 11.9 us
# fused, qkv 29.6 against 22.6. The kernel flavour (tensor-core capable or not) is chosen per call from
# the step's padded row count, so the wide groups start at 129 rows: steps padded to 128 rows fuse.
# The path of a given segment depends only on that segment's length (one launch or two gives the
# same bits); a segment's length itself can depend on other requests (a prompt chunk and the decode
# rows of the same adapter form one segment), as with any per-segment threshold.
GROUP_MMA_ROWS = KernelChoices().mma_rows

# Decode steps (every segment on the CUDA-core path) launch the shrink and the expand separately rather
# than the one-launch fused kernel: inside a model the call follows a cuBLAS GEMM (no early launch) and
# the fused kernel's wait of each expand item for its segment's shrink items (an atomic count in L2)
# costs more than the second launch, which starts early and loads B while the shrink runs. Measured
# with `python bench/probe_decode.py` (32 layers of GEMMs, norms and LoRA at batch 32 on the H200,
# docs/benchmarks.md §3.1): LoRA per decode step 1.70 ms as two launches against 1.93 fused (32 distinct
# adapters), 1.19 against 1.38 (one adapter). Both give the same bits.
DECODE_FUSED = False
# Eager and piecewise steps (prompt rows, with or without decodes): one fused launch for a group below
# both tensor-core thresholds. KernelChoices.sgmv_fused (LORAFLEET_SGMV_FUSED=0/1) overrides it for A/B runs.
MIXED_FUSED = True


def mixed_fused(kernels: KernelChoices) -> bool:
    return MIXED_FUSED if kernels.sgmv_fused == "auto" else kernels.sgmv_fused == "1"


# Long prompt chunks: the dense path (KernelChoices.dense_lora_rows). Per segment, v = x_s A^T (the group's
# A rows stacked: x read once) and v_g B_g written into each projection's output rows (the bias where a row
# has no adapter), then the base GEMM accumulates onto them (beta = 1: the output is read in its epilogue,
# which a compute-bound GEMM hides). The LoRA kernels instead read and write the GEMM's output once more, and
# their 16-row shrink tiles re-read x per projection and A per tile. `python bench/probe_lora.py` on the H200
# (Llama-2-7B shapes, rank 16, a 2,048-row segment, docs/perf_notes.md): LoRA 436 us per layer on the
# kernels, 244 us dense per projection, 208 with A and B stacked per adapter; 8 segments of 256 rows 633
# against 417 us (stacked; per projection 673: more launches).
# Eager steps launch every product from the host (~25 ms of launches for a 2,048-token 7B step, ~50 ms of GPU
# work), so the path is kept to steps with prompt rows whose GPU work hides that: at least
# KernelChoices.dense_lora_min_work (token rows x projection weight elements of one layer on this rank; 1,024
# rows of a Llama-2-7B layer, the measured regime: a 135M model never qualifies, two-way tensor parallelism
# needs twice the rows), with few segments. A row's rounding on this path depends on its segment's length (cuBLAS picks kernels by shape),
# as the base GEMM's already depends on the step's.
DENSE_LORA_MAX_SEGMENTS = 4

# The attribute of a widened weight (the tensor object the model holds) that records the rank blocks its spare
# columns hold: (pool uid, columns, ((slot, projection, rank, column, the slot's write count), ...));
# LoraStepImpl._kext_weight.
KEXT_RECORD = "_lorafleet_kext_blocks"


def dense_lora_bounds(seg: SegmentTable, num_tokens: int, kernels: KernelChoices,
                      layer_elems: int) -> list[tuple[int, int, int]] | None:
    """The adapted segments (lo, hi, slot) of a step with prompt rows when it takes the dense path, else None.
    `layer_elems`: elements of one layer's projection weights on this rank."""
    if kernels.dense_lora_rows <= 0 or num_tokens * layer_elems < kernels.dense_lora_min_work:
        return None
    hp = seg.host_indptr
    bounds = [(hp[i], hp[i + 1], s) for i, s in enumerate(seg.host_slots) if s >= 0 and hp[i + 1] > hp[i]]
    if not bounds or len(bounds) > DENSE_LORA_MAX_SEGMENTS:
        return None
    if any(hi - lo < kernels.dense_lora_rows for lo, hi, _ in bounds):
        return None
    return bounds


class LoraStepImpl:
    """The LoRA half of a step: `mma=False` (the decode CUDA graphs) puts every segment on the CUDA-core
    path (two launches per group, DECODE_FUSED); otherwise (eager and piecewise steps, also decode-only
    ones) each group's segments take tensor cores from GROUP_MMA_ROWS rows on, and a group below both
    thresholds is one fused launch (MIXED_FUSED, KernelChoices.sgmv_fused). The bits are the same either way."""

    def __init__(self, pool: LoraPool, sgmv: SGMV, seg: SegmentTable, workspace: torch.Tensor | None = None,
                 mma: bool = True, qkv_expand_in_rope: bool = False, kernels: KernelChoices = KernelChoices(),
                 dense: list[tuple[int, int, int]] | None = None):
        self.pool, self.sgmv, self.seg, self.mma = pool, sgmv, seg, mma
        # (lo, hi, slot) of the adapted segments of an eager step on the dense path (dense_lora_bounds), or None
        self.dense = dense
        self.mma_rows = kernels.mma_rows
        # the shrink of add / add_qkv follows the base GEMM on the same x (runner/model/decoder.py): it need not wait
        self.x_ready = kernels.shrink_early
        # per group: rank rows per shrink item of one-row segments (0: the kernel's); row_items: of short segments' too
        self.decode_ranks, self.row_items = kernels.decode_ranks, kernels.shrink_row_items
        # Decode graphs with the fused K/V writer (KernelChoices.rope_kv_lora): the qkv group's expand is left to that
        # kernel (add_qkv), which adds it in the same order as the CUDA-core expand.
        self.qkv_expand_in_rope = qkv_expand_in_rope and not mma
        self._shrunk = None  # (layer, group) whose shrink the norm's launch has done (norm_shrink)
        self._rows = None  # the row-slot buffers (_row_slots), made on first use
        self._row_slot_group = None  # the group whose layer-0 call computes them each step
        self.fused = mixed_fused(kernels) if mma else DECODE_FUSED
        # Decode graphs with KernelChoices.lora_branch: each group's shrink ("shrink"), or its shrink and an expand into
        # one fp32 buffer ("addon"), on a second stream beside the base product (begin); add() waits for them, then runs
        # the expand, or adds the buffer. One buffer serves every group: a group's branch starts after the previous
        # group's add-on was consumed (stream order). "" where it does not apply.
        on = (kernels.lora_branch != "off" and not mma and not self.qkv_expand_in_rope
              and getattr(sgmv, "name", "") == "cuda" and pool.device.type == "cuda")
        self.branch = kernels.lora_branch if on else ""
        self._pending = None  # (layer, group, x, the add-on buffer or None) of the branch in flight
        self.norm_shrink_on = kernels.norm_shrink  # the one-launch norm + shrink (KernelChoices.norm_shrink)
        self._slots_fresh = False  # the last _row_slots call launched the ops that compute them
        if self.branch:
            self._side = torch.cuda.Stream(pool.device)
        if self.branch == "addon":
            width = max(sum(b.shape[2] for b in pool.group_args[0][g][1]) for g in range(len(GROUP_SPANS)))
            self._addon = torch.empty(seg.num_rows * width, dtype=torch.float32, device=pool.device)
        need = seg.num_rows * 3 * pool.max_rank
        if workspace is None or workspace.numel() < need:
            workspace = torch.empty(need, dtype=torch.float32, device=pool.device)
        self.ws = workspace
        self.active = seg.any_adapter
        n, R = seg.num_rows, pool.max_rank
        self.views = {g: workspace[: n * g * R].view(n, g, R) for g in {g for _, g in GROUP_SPANS}}

    def add_qkv(self, layer: int, x: torch.Tensor, ys: tuple[torch.Tensor, ...]):
        """The qkv group of a layer. With `qkv_expand_in_rope`: only the shrink, and the expand's operands
        (v, B pools, ranks, slot of each row) for the rope_kv kernel; otherwise the whole add-on, and None.
        The row slots are recomputed from the step's segment table at layer 0 (inside a captured graph,
        on every replay)."""
        if not (self.qkv_expand_in_rope and self.active):
            self.add(layer, 0, x, ys)
            return None
        v = self.views[GROUP_SPANS[0][1]]
        a, b, ranks, host = self.pool.group_args[layer][0]
        row_slot = self._row_slots(layer, 0, x.shape[0])
        if self._take_shrunk(layer, 0):
            pass
        elif getattr(self.sgmv, "name", "") == "cuda":  # CUDA-core items, as the decode call's shrink
            self.sgmv.shrink(v, x, a, ranks, host, self.seg, mma_min_rows=1 << 30, x_ready=self.x_ready,
                             decode_ranks=self.decode_ranks[0], row_items=self.row_items)
        else:
            self.sgmv.shrink(v, x, a, ranks, host, self.seg)
        return v, b, ranks, row_slot

    def norm_shrink(self, layer: int, group: int, x_out: torch.Tensor, norm,
                    quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """The RMSNorm `norm` (runner/model/norm.py NormOperands) before layer's `group` (qkv or gate_up) into x_out,
        with the group's shrink in the same launch where it applies (norm_shrink_on: decode graphs with adapters, CUDA
        kernels; `quant`: x_out's e4m3 rows and scales too), v bit for bit the separate shrink's; the group's next call
        (add, add_qkv, epilogue_operands) then skips its shrink. False where it does not apply: the caller runs the
        norm."""
        if not (self.norm_shrink_on and self.active and not self.mma and self.dense is None
                and getattr(self.sgmv, "name", "") == "cuda" and hasattr(self.sgmv, "norm_shrink")):
            return False
        v = self.views[GROUP_SPANS[group][1]]
        a, _, ranks, _ = self.pool.group_args[layer][group]
        # the row slots before the norm's launch (groups -1 and -3 for the qkv and gate_up norms: at layer 0 the qkv
        # norm's launch opens the step, before the groups' own calls, and every later call reuses them): the product
        # that finishes the group with the expand in its epilogue (epilogue_operands) reads them before its
        # programmatic-launch wait, so they must not be written by the kernel right before it
        self._row_slots(layer, -1 - group, x_out.shape[0])
        self.sgmv.norm_shrink(v, x_out, norm, a, ranks, self.seg, quant)
        self._shrunk = (layer, group)
        return True

    def _take_shrunk(self, layer: int, group: int) -> bool:
        """Whether the norm's launch did this group's shrink (then forgotten: one use)."""
        done = self._shrunk == (layer, group)
        if done:
            self._shrunk = None
        return done

    def _row_slots(self, layer: int, group: int, rows: int) -> torch.Tensor:
        """Each row's adapter slot (int32, at least `rows` entries, -1: none) from the step's segment table, computed on
        the device once per step: at layer 0 in the first group that asks for them (inside a captured graph, on every
        replay), and at this object's first call whatever its layer; later calls reuse them. Row t lies in the
        segment i with indptr[i] <= t < indptr[i + 1]."""
        fresh = self._rows is None or self._rows.numel() < rows
        if fresh:
            n, dev = max(rows, self.seg.num_rows), self.pool.device
            self._rows = torch.arange(n, dtype=torch.int32, device=dev)
            self._seg_of_row = torch.empty(n, dtype=torch.int64, device=dev)
            self.row_slot = torch.empty(n, dtype=torch.int32, device=dev)
        if layer == 0 and self._row_slot_group is None:
            self._row_slot_group = group  # the layers' groups come in one order: this one opens every step
        self._slots_fresh = fresh or (layer == 0 and group == self._row_slot_group)
        if self._slots_fresh:
            torch.searchsorted(self.seg.indptr[1:], self._rows, right=True, out=self._seg_of_row)
            self._seg_of_row.clamp_(max=self.seg.slots.shape[0] - 1)
            torch.index_select(self.seg.slots, 0, self._seg_of_row, out=self.row_slot)
            self.row_slot.masked_fill_(self._rows >= self.seg.indptr[-1], -1)
        return self.row_slot

    @property
    def epilogue_ready(self) -> bool:
        """An epilogue kernel can take this step's expands (the FP8 product's, the bf16 wgmma product's): the CUDA LoRA
        kernels, not the dense path."""
        return getattr(self.sgmv, "name", "") == "cuda" and self.dense is None

    def epilogue_operands(self, layer: int, group: int, x: torch.Tensor,
                          quant: tuple[torch.Tensor, torch.Tensor] | None = None, in_product: bool = False):
        """The group's shrink, launched now on the CUDA-core path (the path of every segment of at most 64 rows
        with the default KernelChoices.mma_rows, so the same v as `add`), and the expand's operands (v, B pools,
        ranks, each row's slot, A pools or None) for the kernel that finishes the product (runner/model/fp8.py:
        fp8_linear's epilogue, bf16_sm90_linear); None, and nothing launched: no adapter in the step. `quant` (e4m3
        rows, scales): the shrink's launch also quantizes x into them. `in_product` (bf16_sm90_linear's kernel, or
        fp8_linear's wgmma product with the shrink first, can shrink): no launch, and the A pools for that kernel to
        write v from (None where the norm's launch wrote v, and where this call has just launched the ops that compute
        the row slots: the kernel reads them before its programmatic-launch wait, so the step's first group keeps its
        shrink's launch between the two). The kernel's
        v sums in its own order (a warp's lanes over K, then its xor tree): not the bits of `add`'s, a row's still its
        own."""
        if not self.active:
            return None
        v = self.views[GROUP_SPANS[group][1]]
        a, b, ranks, host = self.pool.group_args[layer][group]
        row_slot = self._row_slots(layer, group, x.shape[0])
        if self._take_shrunk(layer, group):
            if quant is not None:
                raise ValueError("epilogue_operands: the norm's launch did the shrink; it quantizes x itself")
        elif in_product and quant is None and not self._slots_fresh:
            return v, b, ranks, row_slot, a
        else:
            self.sgmv.shrink(v, x, a, ranks, host, self.seg, mma_min_rows=1 << 30, quant=quant,
                             decode_ranks=self.decode_ranks[group], row_items=self.row_items)
        return v, b, ranks, row_slot, None

    def begin(self, layer: int, group: int, x: torch.Tensor) -> None:
        """Before layer's `group` base product on x (decoder): with `branch`, the group's shrink ("shrink"), or its
        shrink and an expand writing the add-on into the fp32 buffer, zeroed first so that rows without an adapter
        add 0 ("addon"), start on the second stream now, beside the product; add() waits for them and finishes the
        group. Nothing otherwise."""
        if not (self.branch and self.active) or self._shrunk == (layer, group):
            return
        if self._pending is not None:
            raise RuntimeError(f"LoRA branch of layer {self._pending[0]} group {self._pending[1]} was never added")
        v = self.views[GROUP_SPANS[group][1]]
        a, b, ranks, host = self.pool.group_args[layer][group]
        rows = x.shape[0]
        widths = [t.shape[2] for t in b]
        addon = self._addon[: rows * sum(widths)].view(rows, sum(widths)) if self.branch == "addon" else None
        main = torch.cuda.current_stream(x.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            if addon is not None:
                addon.zero_()
            self.sgmv.shrink(v, x, a, ranks, host, self.seg, mma_min_rows=1 << 30,
                             decode_ranks=self.decode_ranks[group], row_items=self.row_items)
            if addon is not None:
                self.sgmv.expand(list(addon.split(widths, dim=-1)), v, b, ranks, host, self.seg,
                                 mma_min_rows=1 << 30, write=True)
        # x stays referenced until add(): its memory is not handed to later work on the main stream meanwhile
        self._pending = (layer, group, x, addon)

    def _finish_branch(self, layer: int, group: int, ys: tuple[torch.Tensor, ...]) -> bool:
        """add()'s half of begin(): the main stream waits for the branch, then the expand onto ys ("shrink"), or
        ys += the add-on in one launch (fp32 sum, one rounding: the expand's own bits). False where no branch of
        (layer, group) is in flight."""
        if self._pending is None or self._pending[:2] != (layer, group):
            return False
        addon = self._pending[3]
        self._pending = None
        torch.cuda.current_stream(ys[0].device).wait_stream(self._side)
        if addon is None:
            _, b, ranks, host = self.pool.group_args[layer][group]
            self.sgmv.expand(ys, self.views[GROUP_SPANS[group][1]], b, ranks, host, self.seg, mma_min_rows=1 << 30)
            return True
        # ys are column views of one product, side by side (the decoder's split): one add over all of them
        y = ys[0]
        side_by_side = all(t.stride() == y.stride() for t in ys) and all(
            ys[j + 1].data_ptr() == ys[j].data_ptr() + ys[j].shape[1] * ys[j].element_size() for j in range(len(ys) - 1))
        if not side_by_side:
            raise ValueError("LoRA branch: the group's outputs must be column views of one product, side by side")
        y.as_strided(addon.shape, y.stride()).add_(addon)
        return True

    def add(self, layer: int, group: int, x: torch.Tensor, ys: tuple[torch.Tensor, ...]) -> None:
        """ys[g] += the group's LoRA add-on of x."""
        if not self.active or self._finish_branch(layer, group, ys):
            return
        v = self.views[GROUP_SPANS[group][1]]
        a, b, ranks, host = self.pool.group_args[layer][group]  # ranks [G, S]
        if self._take_shrunk(layer, group):  # decode graphs: the expand's CUDA-core launch, as add's two launches
            self.sgmv.expand(ys, v, b, ranks, host, self.seg, mma_min_rows=1 << 30)
            return
        self.sgmv.add(ys, v, x, a, b, ranks, host, self.seg, self.mma, self.mma_rows[group],
                      fused=self.fused, x_ready=self.x_ready, decode_ranks=self.decode_ranks[group],
                      row_items=self.row_items)

    def dense_linear(self, layer: int, group: int, x: torch.Tensor, w: torch.Tensor,
                     bias: torch.Tensor | None, out_spare: int = 0) -> torch.Tensor:
        """x @ w.T + bias plus the group's LoRA on the dense path (self.dense). Where w has spare columns
        (Decoder.widen_for_lora) and so has x (the previous projection's output, normalized in place), and they hold
        the step's rank blocks: one GEMM over K-extended operands (_kext_linear).
        Otherwise per segment v = x_s A^T (the projections' A rows stacked, one product), per projection
        bias_g + v_g B_g written into the output (v rounded to x's dtype, as the kernels and TorchSGMV do), rows
        without an adapter set to the bias (or zero), then the base product accumulated onto it. `out_spare`: the
        output is the [:, :N] view of a [T, N + out_spare] tensor (the next projection's input, whose spare columns
        its own K-extended GEMM then fills without a copy of x)."""
        a, b, ranks, host = self.pool.group_args[layer][group]  # a[g] [S, R, in], b[g] [S, R, out_g]
        T, N = x.shape[0], w.shape[0]
        spans = [b_g.shape[-1] for b_g in b]
        if sum(spans) != N:
            raise ValueError(f"LoRA outputs of group {group} cover {sum(spans)} columns, the weight has {N}")
        y = torch.empty(T, N + max(out_spare, 0), dtype=x.dtype, device=x.device)[:, :N]
        room = min(w.stride(0) - w.shape[1] if w.stride(1) == 1 else 0,
                   x.stride(0) - x.shape[1] if x.stride(1) == 1 else 0)
        blocks = self._kext_blocks(host, len(b), room)
        if blocks is not None:
            self._kext_weight(layer, group, w, b, spans, blocks)
            return self._kext_linear(x, w, bias, self._kext_a_rows(layer, group, a, blocks[0]), spans, blocks, y)
        ys, bs, lo_col = [], [], 0
        for n in spans:
            ys.append(y[:, lo_col: lo_col + n])
            bs.append(bias[lo_col: lo_col + n] if bias is not None else None)
            lo_col += n

        def fill(rows: torch.Tensor, bias_part: torch.Tensor | None) -> None:
            if bias_part is None:
                rows.zero_()
            else:
                rows.copy_(bias_part.expand_as(rows))

        prev = 0
        for lo, hi, s in self.dense:
            if lo > prev:  # rows without an adapter
                fill(y[prev:lo], bias)
            prev = hi
            xs = x[lo:hi]
            rs = [host[g][s] for g in range(len(b))]
            used = [g for g in range(len(b)) if rs[g]]
            if len(used) > 1:  # one shrink over the projections' A rows stacked: x read once
                v = torch.mm(xs, torch.cat([a[g][s, :rs[g]] for g in used]).t())
            off = 0
            for g in range(len(b)):
                r = rs[g]
                if not r:
                    fill(ys[g][lo:hi], bs[g])
                    continue
                vg = v[:, off:off + r] if len(used) > 1 else torch.mm(xs, a[g][s, :r].t())
                off += r
                if bs[g] is None:
                    torch.mm(vg, b[g][s, :r], out=ys[g][lo:hi])
                else:
                    torch.addmm(bs[g], vg, b[g][s, :r], out=ys[g][lo:hi])
        if T > prev:
            fill(y[prev:T], bias)
        y.addmm_(x, w.t())
        return y

    def _kext_blocks(self, host, projections: int, spare: int):
        """The step's rank blocks in the spare columns: ([per dense segment (lo, hi, slot, [(g, r, col)])], columns
        used), each adapted projection g's r columns from `col` on, the segment's blocks side by side; None where
        they do not fit in `spare`."""
        blocks, col = [], 0
        for lo, hi, s in self.dense:
            parts = []
            for g in range(projections):
                r = int(host[g][s])
                if r > 0:
                    parts.append((g, r, col))
                    col += r
            blocks.append((lo, hi, s, parts))
        return (blocks, col) if 0 < col <= spare else None

    def _kext_weight(self, layer: int, group: int, w: torch.Tensor, b, spans: list[int], blocks) -> None:
        """The weight's spare columns for the step's rank blocks: each block's B^T in its projection's output rows,
        zeros in the others'. Skipped where they already hold exactly that: the same blocks (slot, projection, rank,
        column) of the same pool's slots, not written since (LoraPool.slot_writes), as in every step of one
        adapter's prompts. The record lives on the weight (KEXT_RECORD), so an engine sharing the model that wrote
        other blocks there in between is seen."""
        blocks, c = blocks
        K = w.shape[1]
        writes, uid = getattr(self.pool, "slot_writes", None), getattr(self.pool, "uid", None)
        key = None if writes is None or uid is None else (
            uid, c, tuple((s, g, r, col, writes[s]) for _, _, s, parts in blocks for g, r, col in parts))
        before = getattr(w, KEXT_RECORD, None)
        if key is not None and before == key:
            return
        setattr(w, KEXT_RECORD, None)
        ww = w.as_strided((w.shape[0], K + c), (w.stride(0), 1))
        # the zeros around the blocks are there already where the last write had the same layout (projection, rank,
        # column of each block; e.g. one adapter after another of the same ranks): only the blocks change
        def layout(k):  # (pool uid, columns, (projection, rank, column) of each block)
            return k[0], k[1], tuple(e[1:4] for e in k[2])

        if key is None or before is None or layout(before) != layout(key):
            ww[:, K:].zero_()
        starts = [sum(spans[:g]) for g in range(len(spans))]
        for _, _, s, parts in blocks:
            for g, r, col in parts:
                ww[starts[g]: starts[g] + spans[g], K + col: K + col + r].copy_(b[g][s, :r].t())
        if key is not None:
            setattr(w, KEXT_RECORD, key)

    def _kext_a_rows(self, layer: int, group: int, a, blocks) -> list[torch.Tensor | None]:
        """Per dense segment, its blocks' A rows stacked [sum r, in] (None: no block). A step with one segment keeps
        them on the pool for the next step of the same slot, rank blocks and slot contents (LoraPool.slot_writes):
        one adapter's 2,048-token chunks stack them once per layer and group, not per step (bounded: one stack per
        layer and group)."""
        def stack(s, parts):
            if not parts:
                return None
            return a[parts[0][0]][s, :parts[0][1]] if len(parts) == 1 else torch.cat([a[g][s, :r] for g, r, _ in parts])

        writes, cache = getattr(self.pool, "slot_writes", None), getattr(self.pool, "kext_a_rows", None)
        if len(blocks) != 1 or len(blocks[0][3]) < 2 or writes is None or cache is None:  # nothing worth keeping
            return [stack(s, parts) for _, _, s, parts in blocks]
        _, _, s, parts = blocks[0]
        key = (s, writes[s], tuple((g, r) for g, r, _ in parts))
        hit = cache.get((layer, group))
        if hit is None or hit[0] != key:
            hit = cache[(layer, group)] = (key, stack(s, parts))
        return [hit[1]]

    @staticmethod
    def _kext_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, a_rows, spans: list[int], blocks,
                     y: torch.Tensor) -> torch.Tensor:
        """y = [x | V] @ [W | B]^T + bias in one GEMM: V [T, c] holds each dense segment's v = x_s A^T (rounded to x's
        dtype, as PEFT does; `a_rows`: per segment its blocks' A rows stacked, _kext_a_rows) in its rank blocks'
        columns and zeros elsewhere (rows without an adapter, other segments' blocks), written per call by the
        shrink's product straight into x's own spare columns (dense_linear checked the room: a copy of x beside V
        would cost more than the add-on's write this saves); the weight's spare columns hold the blocks' B^T
        (_kext_weight)."""
        T, K = x.shape
        blocks, c = blocks
        ww = w.as_strided((w.shape[0], K + c), (w.stride(0), 1))
        xw = x.as_strided((T, K + c), (x.stride(0), 1))
        if not (len(blocks) == 1 and blocks[0][0] == 0 and blocks[0][1] == T):  # one segment fills all of V
            xw[:, K:].zero_()
        for (lo, hi, s, parts), rows in zip(blocks, a_rows):
            if not parts:
                continue
            c0, c1 = parts[0][2], parts[-1][2] + parts[-1][1]
            torch.mm(x[lo:hi], rows.t(), out=xw[lo:hi, K + c0: K + c1])  # a strided output: no copy of v
        if bias is None:
            torch.mm(xw, ww.t(), out=y)
        else:
            torch.addmm(bias, xw, ww.t(), out=y)
        return y
