// Dynamic per-row FP8 (e4m3) quantization of activations, in one launch.
//
// Torch-free like sgmv.h (the binding is in sgmv_binding.cpp). For every row i < rows of x (bf16/fp16,
// `cols` elements, unit column stride):
//
//   scale[i]  = max(absmax(x[i, :]) * fp32(1 / 448), 1e-12)              fp32 (how torch divides by a scalar)
//   inv[i]    = 1 / scale[i]                                             fp32, correctly rounded
//   out[i, j] = e4m3(clamp(x[i, j] * inv[i], -448, 448))                 round to nearest even
//
// the same bits as runner/model/fp8.py quantize_tokens (x.float(), amax, reciprocal, product, clamp, cast). A
// product, not a division: vLLM's per-token kernels multiply by the reciprocal too, and a correctly rounded
// division per element is most of the kernel's instructions.
#pragma once

#include <cstdint>

#include "sgmv.h"  // DType

namespace lorafleet {

struct QuantizeRowsArgs {
  const void* x = nullptr;      // [rows, cols]
  int64_t x_row_stride = 0;     // elements
  void* out = nullptr;          // [rows, cols] float8_e4m3fn, contiguous
  float* scale = nullptr;       // [rows]
  int rows = 0;
  int cols = 0;
};

// Enqueue on `stream`; no synchronisation or allocation (capturable). nullptr on success.
const char* quantize_rows_e4m3(DType dtype, const QuantizeRowsArgs& args, int device, void* stream);

// The epilogue of an FP8 product taken with unit scales into fp32 (y = x_q @ w_q.T), in one launch: the
// token and row scales, the bias and the rows' LoRA expand. For every row i < m and column c < n, with c in
// the output span of projection g (spans cols[0], cols[1], ... in order, each a multiple of 8), T the dtype:
//
//   o = T((y[i, c] * x_scale[i]) * w_scale[c])                      as y.mul_(sx).mul_(w_scale).to(T)
//   o = T(float(o) + float(bias[c]))                                  with a bias (a bf16 / fp16 tensor add)
//   s = lora.row_slot[i], r = clamp(lora.ranks[g, s], 0, min(b_rank_dim[g], kMaxRank))
//   out[i, c] = T(float(o) + sum_k<r v[i, g, k] * b[g][s, k, c - start_g])   if 0 <= s < S and r > 0, else o
//
// the sum in the SGMV CUDA-core expand's order (4 partial sums over k mod 4, then (p0 + p2) + (p1 + p3)), so
// the result is bit for bit the unit-scale product's three torch ops, the bias add and sgmv expand (decode
// rows) one after the other. Each output element depends only on its own row: no other row changes it.
struct Fp8EpilogueLora {
  const float* v = nullptr;            // [>= m, G, v_rank_dim] fp32, row stride v_row_stride (nullptr: no LoRA)
  int64_t v_row_stride = 0;
  int v_rank_dim = 0;
  const void* b[kMaxGroup] = {};       // [S, b_rank_dim[g], cols[g]] contiguous, dtype T
  int b_rank_dim[kMaxGroup] = {};
  const int32_t* ranks = nullptr;      // [G, S]
  const int32_t* row_slot = nullptr;   // [>= m], -1 (or out of range): no adapter
  int num_slots = 0;                   // S
  // The rows' shrink inside the product (fp8_gemm_sm90_fused, of x with bf16 operands, or fp8_gemm_sm90's shrink
  // first, of `x` below with e4m3 operands; sync nullptr: v comes from a shrink launched before):
  // v[i, g, k] = sum_j x[i, j] * a[g][s, k, j] for k < r (s and r as above, r also below a_rank_dim[g]), in fp32,
  // written into v by the product's own warps before any of its epilogues (or the kernel after it) reads v. sync:
  // uint32 of this call site (three for fp8_gemm_sm90_fused, four with shrink_producer; one for the shrink first),
  // zero before the launch (the launch leaves them zero); no two launches in flight may share them (tickets are
  // drawn before the wait for the kernel before).
  const void* a[kMaxGroup] = {};       // [S, a_rank_dim[g], K] contiguous, dtype T
  int a_rank_dim[kMaxGroup] = {};
  int a_rank_max = 0;                  // max over g of a_rank_dim[g]
  unsigned* sync = nullptr;
  // bf16 [m, K]: the product's x (bf16 operands: set by the launcher), or the bf16 rows the e4m3 operands were
  // quantized from (given by the caller)
  const void* x = nullptr;
  int k = 0;                           // K (set by the launcher)
  int shrink_tickets = 0;              // the shrink's tickets and the rank rows (of one row's G spans) each
  int shrink_per = 0;                  // takes (set by the launcher: see RowShrink::shrink_ticket, sm90_gemm.cuh)
  // The shrink's tickets on the producer warp group's three warps that issue no copies (warps 1-3 of each CTA), beside
  // the main loop, instead of on the consumer warps before it (the same bits: a ticket's sums do not depend on the
  // warp that takes it). fp8_gemm_sm90_fused then counts those warps' exits in a fourth counter (sync[3]), so that
  // the launch's last epilogue zeroes the counters only after the last of them has drawn past the tickets.
  bool shrink_producer = false;
};

struct Fp8EpilogueArgs {
  const float* y = nullptr;            // [splits, m, n] fp32 contiguous
  int splits = 1;                      // y holds this many partial sums of the product, added in order (1..16)
  const float* x_scale = nullptr;      // [m]
  const float* w_scale = nullptr;      // [n]
  const void* bias = nullptr;          // [n] dtype T, or nullptr
  void* out = nullptr;                 // [m, n] dtype T contiguous
  int m = 0;
  int n = 0;                           // multiple of 8
  int num_groups = 1;                  // G, 1..kMaxGroup
  int cols[kMaxGroup] = {};            // output span of each projection, multiples of 8 summing to n
  Fp8EpilogueLora lora;
  // 0: out [m, n] as above. 1 (SiLU) or 2 (GELU with tanh): two spans of equal width I (gate, up) and out [m, I]:
  //   out[i, c] = T(act(float(gate)) * float(up)), gate and up the values above at columns c and I + c (as T), act
  //   flashinfer's activation as its fast-math build computes it, so bit for bit the epilogue followed by
  //   flashinfer's act_and_mul kernel.
  int act = 0;
  // Programmatic dependent launch (sm_90+): the grid starts while the previous kernel (the product) drains
  // and reads row_slot, ranks and the first rank rows of B, then waits for it before reading y, the scales,
  // the bias or v. So nothing may write row_slot, ranks or the B pools in the kernel launched right before.
  bool pdl = true;
  // fp8_epilogue's launch: let the next kernel start at once (griddepcontrol.launch_dependents first), so that its
  // blocks are resident, and a wgmma product streams its weight, while this one runs. Only where every kernel that
  // may follow waits for this one before it reads out or writes anything this one reads (the project's kernels,
  // flashinfer's with programmatic dependent launch), or is launched without programmatic dependent launch.
  // (fp8_gemm_sm90_fused ignores it: its trigger follows the last MMA.)
  bool early = false;
};

// The arguments' host-side checks other than y's (pointers, spans, act, splits, the LoRA tables' presence): nullptr when they pass.
const char* fp8_epilogue_check(const Fp8EpilogueArgs& args);

// Enqueue on `stream`; no synchronisation or allocation (capturable). nullptr on success.
const char* fp8_epilogue(DType dtype, const Fp8EpilogueArgs& args, int device, void* stream);

}  // namespace lorafleet
