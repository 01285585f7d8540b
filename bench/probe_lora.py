"""Where LoRA's cost in a step goes, and what three ways of folding it into the base GEMM would cost (GPU).

Per projection group of the Llama-2-7B shape (qkv, o, gate_up, down; rank 16 on every projection), each
timed inside a CUDA graph, weights and adapters rotated so nothing stays in L2:

- `base`     the base GEMM alone;
- `today`    the base GEMM, then the engine's LoRA call (CudaSGMV.add with the engine's tensor-core
             thresholds for steps with prompt rows; decode: the two CUDA-core launches);
- `kcat`     one GEMM over the K-extended operands: [x | v] @ [W | B]^T, v = x A from the shrink in bf16,
             B in spare columns of the weight (written per step: the copy is timed with the GEMM), one
             block of columns per adapter of the step, v zero outside a row's own block; y is written
             once instead of read and written again by the expand;
- `merged`   one adapter per step only: W + B^T A written into a scratch weight (per step and layer),
             then one GEMM (no LoRA launch at all, the merge's bytes instead);
- `rowcat`   (decode) the shrink inside the base GEMM: x @ [W; A_pool]^T, the weight's rows followed by the A rows
             of every pool slot (32, whatever the step's adapters), so one GEMM gives y and every slot's v; then
             today's expand (in an engine it would read its row's own slot block of that output, one launch);
             `rowcat_gemm` that GEMM alone, `rowcat_active` the same with only the step's adapters' A rows;
- `launch_floor` (decode): two launches of a kernel that does nothing useful (a one-element fill), the
             least two dependent graph nodes cost; `today` minus it is the LoRA kernels' own work.

Steps: prefill (one 2,048-row segment; 8 segments of 256 rows for 8 adapters) and decode (32 rows, 32
adapters or one). A layer's sum per variant, times 32 layers, is what the step would spend.

    python bench/probe_lora.py --out probe_lora.json

`formulations` is exact math checked on the CPU by tests/test_probe_lora.py; only the timing needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

HIDDEN, INTER, RANK, LAYERS = 4096, 11008, 16, 32
GROUPS = {  # name: (in, outs per projection)
    "qkv": (HIDDEN, (HIDDEN, HIDDEN, HIDDEN)),
    "o": (HIDDEN, (HIDDEN,)),
    "gate_up": (HIDDEN, (INTER, INTER)),
    "down": (INTER, (HIDDEN,)),
}
MMA_ROWS = {"qkv": (129, 129), "o": (512, 512), "gate_up": (129, 129), "down": (512, 512)}  # KernelChoices'


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def write_v_blocks(tail: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, row_adapter: torch.Tensor, S: int):
    """The extra K columns of [x | V] (tail: [T, S*G*R], a view): row t's v [G, R] in its adapter's block, zeros
    elsewhere."""
    T = tail.shape[0]
    blocks = tail.view(T, S, -1)
    blocks.zero_()
    blocks[rows, row_adapter] = v.reshape(T, -1).to(tail.dtype)


def write_b_blocks(tail: torch.Tensor, bs, outs, S: int, G: int, R: int):
    """The extra K columns of [W | Bcat] (tail: [N, S*G*R], a view): projection g's B^T ([S, R, N_g] in
    bs[g]) in its (adapter, g) block; the other projections' blocks are left as they are (zeros)."""
    wb = tail.view(tail.shape[0], S, G, R)
    lo = 0
    for g, n in enumerate(outs):
        wb[lo:lo + n, :, g, :].copy_(bs[g].permute(2, 0, 1))  # [N_g, S, R]
        lo += n


class formulations:
    """The alternatives as plain torch, for one group: x [T, K]; w [N, K] (the group's projections stacked);
    a [S, G, R, K] and b [S, G, R, N_g] of the step's adapters; row_adapter [T] (index into S). Products in
    fp32, or in the inputs' dtype where that is wider."""

    @staticmethod
    def reference(x, w, a, b, row_adapter, outs):
        """x W^T plus every row's own adapter, per projection, in x's dtype."""
        f = _acc(x)
        y = (x.to(f) @ w.to(f).t())
        lo = 0
        for g, n in enumerate(outs):
            v = torch.einsum("tk,trk->tr", x.to(f), a[row_adapter, g].to(f))
            y[:, lo:lo + n] += torch.einsum("tr,trn->tn", v, b[row_adapter, g].to(f))
            lo += n
        return y.to(x.dtype)

    @staticmethod
    def kcat_operands(x, w, a, b, row_adapter, outs, v=None):
        """([x | V] [T, K + S*G*R], [W | Bcat] [N, K + S*G*R]): V holds each row's v = x A in its adapter's
        block (zeros elsewhere), Bcat each projection's B^T in its (adapter, projection) block."""
        T, K = x.shape
        S, G, R = a.shape[0], a.shape[1], a.shape[2]
        if v is None:
            v = torch.einsum("tk,tgrk->tgr", x.to(_acc(x)), a[row_adapter].to(_acc(x)))
        xe = torch.empty(T, K + S * G * R, dtype=x.dtype, device=x.device)
        xe[:, :K] = x
        write_v_blocks(xe[:, K:], v, torch.arange(T, device=x.device), row_adapter, S)
        we = torch.zeros(w.shape[0], K + S * G * R, dtype=w.dtype, device=w.device)
        we[:, :K] = w
        write_b_blocks(we[:, K:], [b[:, g] for g in range(G)], outs, S, G, R)
        return xe, we

    @staticmethod
    def rowcat_weight(w, a_pool):
        """[W; A_pool] [N + S*G*R, K]: the base weight's rows, then every slot's A rows (a_pool [S, G, R, K]) in slot
        order, so that x @ it^T holds x W^T in its first N columns and slot s's v = x A_s^T in columns
        N + s*G*R ... N + (s+1)*G*R (projection g's R columns at offset g*R of the block)."""
        S, G, R, K = a_pool.shape
        return torch.cat([w, a_pool.reshape(S * G * R, K).to(w.dtype)], 0)

    @staticmethod
    def rowcat_apply(ye, b, row_adapter, outs, R):
        """y from x @ rowcat_weight^T (ye [T, N + S*G*R]): its first N columns plus each row's own slot block of v
        through that slot's B (b [S, G, R, N_g]), in ye's dtype widened to fp32."""
        N, G = sum(outs), len(outs)
        f = _acc(ye)
        T = ye.shape[0]
        y = ye[:, :N].to(f).clone()
        blocks = ye[:, N:].to(f).view(T, -1, G, R)[torch.arange(T), row_adapter]  # [T, G, R]
        lo = 0
        for g, n in enumerate(outs):
            y[:, lo:lo + n] += torch.einsum("tr,trn->tn", blocks[:, g], b[row_adapter, g].to(f))
            lo += n
        return y

    @staticmethod
    def merged_weight(w, a, b, outs):
        """W + B^T A for one adapter (a [1, G, R, K], b [1, G, R, N_g])."""
        f = _acc(w)
        m = w.to(f).clone()
        lo = 0
        for g, n in enumerate(outs):
            m[lo:lo + n] += b[0, g].to(f).t() @ a[0, g].to(f)
            lo += n
        return m.to(w.dtype)


def timer():
    from lorafleet.bench.kernels import Timer

    return Timer(flush_bytes=1 << 20)


def probe_group(name: str, T: int, n_adapters: int, decode: bool, tm, copies: int = 4) -> dict:
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    dev, dt = torch.device("cuda"), torch.bfloat16
    K, outs = GROUPS[name]
    N, G = sum(outs), len(outs)
    gen = torch.Generator(device=dev).manual_seed(T + n_adapters)
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=gen) * 0.02  # noqa: E731
    ws = [rnd(N, K) for _ in range(copies)]
    S = n_adapters
    pool_a = [[rnd(S, RANK, K) for _ in range(G)] for _ in range(copies)]  # the engine's pool layout
    pool_b = [[rnd(S, RANK, n) for n in outs] for _ in range(copies)]
    ranks = torch.full((G, S), RANK, dtype=torch.int32, device=dev)
    row_slots = [i * S // T for i in range(T)]
    seg = build_segments(row_slots, dev)
    x = rnd(T, K)
    y = torch.empty(T, N, device=dev, dtype=dt)
    v = torch.empty(T, G, RANK, device=dev, dtype=torch.float32)
    sgmv = CudaSGMV()
    i = [0]

    def nxt():
        i[0] = (i[0] + 1) % copies
        return i[0]

    def views(out):
        vs, lo = [], 0
        for n in outs:
            vs.append(out[:, lo:lo + n])
            lo += n
        return vs

    def base():
        torch.mm(x, ws[nxt()].t(), out=y)

    def today():
        c = nxt()
        torch.mm(x, ws[c].t(), out=y)
        sgmv.add(views(y), v, x, pool_a[c], pool_b[c], ranks, None, seg, mma=not decode,
                 mma_rows=MMA_ROWS[name], fused=not decode)

    extra = S * G * RANK
    wes = [torch.zeros(N, K + extra, device=dev, dtype=dt) for _ in range(copies)]
    for c in range(copies):
        wes[c][:, :K] = ws[c]
    xe = torch.zeros(T, K + extra, device=dev, dtype=dt)
    xe[:, :K] = x
    slot_col = torch.tensor(row_slots, device=dev)
    all_rows = torch.arange(T, device=dev)

    def kcat():
        c = nxt()
        sgmv.shrink(v, x, pool_a[c], ranks, None, seg, mma_min_rows=MMA_ROWS[name][0] if not decode else 1 << 30)
        write_v_blocks(xe[:, K:], v, all_rows, slot_col, S)
        write_b_blocks(wes[c][:, K:], pool_b[c], outs, S, G, RANK)  # the step's B: a per-step copy
        torch.mm(xe, wes[c].t(), out=y)

    def shrink():  # today's shrink alone (the part of `today` that reads x)
        sgmv.shrink(v, x, pool_a[nxt()], ranks, None, seg, mma_min_rows=MMA_ROWS[name][0] if not decode else 1 << 30)

    def expand():  # today's expand alone (the read-modify-write of y)
        sgmv.expand(views(y), v, pool_b[nxt()], ranks, None, seg,
                    mma_min_rows=MMA_ROWS[name][1] if not decode else 1 << 30)

    def kcat_gemm():  # the K-extended GEMM alone, operands in place (what the layer would pay if the norm
        torch.mm(xe, wes[nxt()].t(), out=y)  # wrote [x | V] and the weight carried the step's B)

    hp = list(seg.host_indptr)
    bounds = [(hp[i], hp[i + 1], sl) for i, sl in enumerate(seg.host_slots)]
    vb = torch.empty(T, RANK, device=dev, dtype=dt)

    def cublas():  # the base GEMM, then per segment and projection x_s A^T and y_s += v_s B with cuBLAS
        c = nxt()
        torch.mm(x, ws[c].t(), out=y)
        ys = views(y)
        for lo, hi, s_i in bounds:
            for g in range(G):
                torch.mm(x[lo:hi], pool_a[c][g][s_i].t(), out=vb[lo:hi])
                ys[g][lo:hi].addmm_(vb[lo:hi], pool_b[c][g][s_i])

    # per adapter of the step: its A rows of the group stacked [G*R, K] and its B block-diagonal [G*R, N]
    # (built at load time in an engine; not timed)
    a_stack = [[torch.cat([pool_a[c][g][s_i] for g in range(G)], 0) for s_i in range(S)] for c in range(copies)]
    b_block = []
    for c in range(copies):
        blocks = []
        for s_i in range(S):
            bb = torch.zeros(G * RANK, N, device=dev, dtype=dt)
            lo = 0
            for g, n in enumerate(outs):
                bb[g * RANK:(g + 1) * RANK, lo:lo + n] = pool_b[c][g][s_i]
                lo += n
            blocks.append(bb)
        b_block.append(blocks)
    vg = torch.empty(T, G * RANK, device=dev, dtype=dt)

    def first():  # per segment v = x_s A_stack^T, y_s = v B_block (y written once), then y += x W^T (beta = 1)
        c = nxt()
        for lo, hi, s_i in bounds:
            torch.mm(x[lo:hi], a_stack[c][s_i].t(), out=vg[lo:hi])
            torch.mm(vg[lo:hi], b_block[c][s_i], out=y[lo:hi])
        y.addmm_(x, ws[c].t())

    def first_views():  # the same with the pool's per-projection A and B (y's column views as outputs)
        c = nxt()
        ys = views(y)
        for lo, hi, s_i in bounds:
            for g in range(G):
                torch.mm(x[lo:hi], pool_a[c][g][s_i].t(), out=vb[lo:hi])
                torch.mm(vb[lo:hi], pool_b[c][g][s_i], out=ys[g][lo:hi])
        y.addmm_(x, ws[c].t())

    pool_slots = 32  # the pool of a max batch of 32 decode rows, whatever this step's adapters
    w_rowcat = [torch.cat([ws[c], rnd(pool_slots * G * RANK, K)], 0) for c in range(copies)]
    w_rowcat_active = [formulations.rowcat_weight(ws[c], torch.stack(pool_a[c], 1)) for c in range(copies)]
    ye = torch.empty(T, N + pool_slots * G * RANK, device=dev, dtype=dt)
    ye_active = torch.empty(T, N + S * G * RANK, device=dev, dtype=dt)

    def rowcat_gemm():  # y and every pool slot's v from one GEMM
        torch.mm(x, w_rowcat[nxt()].t(), out=ye)

    def rowcat():  # ... then today's expand (reading its slot's block of ye in an engine)
        c = nxt()
        torch.mm(x, w_rowcat[c].t(), out=ye)
        sgmv.expand(views(ye[:, :N]), v, pool_b[c], ranks, None, seg, mma_min_rows=1 << 30)

    def rowcat_active():  # the same GEMM with only the step's adapters' A rows
        torch.mm(x, w_rowcat_active[nxt()].t(), out=ye_active)

    fns = {"base": base, "today": today, "kcat": kcat, "shrink": shrink, "expand": expand, "kcat_gemm": kcat_gemm}
    if decode:
        fns.update(rowcat=rowcat, rowcat_gemm=rowcat_gemm, rowcat_active=rowcat_active)
    if not decode:
        fns.update(cublas=cublas, first=first, first_views=first_views)
    if S == 1:
        scratch = torch.empty(N, K, device=dev, dtype=dt)

        def merged():
            c = nxt()
            scratch.copy_(ws[c])
            lo = 0
            for g, n in enumerate(outs):
                scratch[lo:lo + n].addmm_(pool_b[c][g][0].t(), pool_a[c][g][0])
                lo += n
            torch.mm(x, scratch.t(), out=y)

        fns["merged"] = merged
    if decode:
        tiny = torch.empty(1, device=dev)

        def launch_floor():
            tiny.fill_(1.0)
            tiny.fill_(2.0)

        fns["launch_floor"] = launch_floor
    row = {"group": name, "rows": T, "adapters": S, "decode": decode}
    if not decode:  # the cuBLAS orders against the engine's call, same operands: largest |diff| / largest |y|
        i[0] = copies - 1
        today()
        ref = y.float().clone()
        for label in ("cublas", "first", "first_views"):
            i[0] = copies - 1
            fns[label]()
            row[f"{label}_rel_diff"] = float((y.float() - ref).abs().max() / ref.abs().max())
    for label, fn in fns.items():
        try:
            row[label] = round(tm.graph_us([fn] * 8), 2)
        except Exception as exc:  # a variant this torch does not take
            row[label] = None
            row[f"{label}_error"] = str(exc)[:160]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="probe_lora.json", help="result file (default: probe_lora.json)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_lora needs a CUDA GPU", file=sys.stderr)
        return 2
    tm, t0 = timer(), time.time()
    cases = [(2048, 1, False), (2048, 8, False), (32, 32, True), (32, 1, True)]
    rows = [probe_group(g, T, S, d, tm) for T, S, d in cases for g in GROUPS]
    summary = []
    for T, S, d in cases:
        rs = [r for r in rows if (r["rows"], r["adapters"], r["decode"]) == (T, S, d)]
        layer = {k: round(sum(r[k] for r in rs), 1) for k in ("base", "today", "kcat", "merged", "launch_floor",
                                                                   "shrink", "expand", "kcat_gemm", "cublas", "first",
                                                                   "first_views", "rowcat", "rowcat_gemm",
                                                                   "rowcat_active")
                 if all(r.get(k) is not None for r in rs)}
        s = {"rows": T, "adapters": S, "decode": d, "us_per_layer": layer,
             "ms_per_step_32_layers": {k: round(us * LAYERS / 1000, 3) for k, us in layer.items()}}
        if "today" in layer:
            s["lora_over_base"] = {k: round((layer[k] - layer["base"]) / layer["base"], 3) for k in layer
                                   if k in ("today", "kcat", "merged", "kcat_gemm", "cublas",
                                                                          "first", "first_views", "rowcat",
                                                                          "rowcat_gemm", "rowcat_active")}
        summary.append(s)
        print(f"{'decode' if d else 'prefill'} T={T} adapters={S}: " + "  ".join(f"{k} {us} us" for k, us in layer.items()))
    out = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "shape": "llama2-7b", "rank": RANK, "rows": rows, "summary": summary, "seconds": round(time.time() - t0, 1)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
