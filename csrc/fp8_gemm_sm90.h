// The unit-scale FP8 product of decode-sized steps on Hopper's wgmma (CUTLASS sm90 collectives):
//
//   out[m, n] = sum_k x_q[m, k] * w_q[n, k]        (fp32, no scales: the caller's epilogue applies them)
//
// x_q [M, K] and w_q [N, K] e4m3, row-major with unit column stride (w's rows w_ld apart), 16-byte aligned base
// addresses, K a multiple of 16, N of 4, 1 <= M <= 64; out [M, N] fp32 contiguous. With `bf16` the operands are bf16
// instead (the same tiles of 256 bytes of K, bf16 wgmma accumulating in fp32), for the bf16 base product of decode
// steps. The weight is the MMA's long side (64-row tiles), the tokens its narrow side (16, 32 or 64 per tile, by M).
// A token's row of `out` does not depend on the other rows. Torch-free like sgmv.h; the binding is in
// sgmv_binding.cpp.
#pragma once

#include <cstdint>

#include "quant.h"  // Fp8EpilogueArgs

namespace lorafleet {

struct Fp8Sm90Args {
  const uint8_t* x = nullptr;  // [M, K] e4m3 (bf16 with `bf16`)
  const uint8_t* w = nullptr;  // [N, K] e4m3 (bf16 with `bf16`)
  float* out = nullptr;        // [M, N] fp32
  int m = 0;
  int n = 0;
  int k = 0;
  int device = -1;  // the CUDA device of the operands and the stream (made current for the launch, then restored)
  int splits = 1;  // K in this many equal parts (K a multiple of 16 * splits): out is [splits, M, N] partial sums
  // Programmatic dependent launch (sm_90): the grid may start while the kernel before it runs; it reads the
  // weight's first k-tiles before it waits for that kernel's completion and the activations only after, so any
  // kernel that does not write the weight may precede it.
  bool pdl = true;
  // CUTLASS's persistent ping-pong schedule (one CTA per SM over the tiles, a tile's epilogue beside the next tile's
  // loads) instead of one CTA per tile; the same bits (the same k-tiles in the same order per tile). e4m3 operands only.
  bool persistent = false;
  bool bf16 = false;  // x and w bf16 (one CTA per tile only: with `persistent`, refused)
  // elements from one row of w to the next (0: k), a multiple of 16 bytes: a weight with spare columns after its k
  // (a bf16 weight of LoRA's K-extended prefill GEMM is the [:, :k] view of a wider tensor)
  int64_t w_ld = 0;
  // fp8_gemm_sm90 only (one CTA a tile, not persistent): the rows' LoRA shrink on the product's own consumer warps
  // before their main loop (or its producer's warps beside it: lora.shrink_producer), into shrink->lora.v
  // (num_groups, the spans and lora as for fp8_gemm_sm90_fused's shrink: v, ranks, row_slot, the B pools' rank
  // dimensions, A pools, sync; lora.x the bf16 rows of x with e4m3 operands, x itself with bf16 ones: the launcher
  // sets it). v is complete when the launch has ended: the kernel after it reads v after its wait for this one
  // (the FP8 epilogue's launch). sync: at least one uint32 of this call site, zero before the launch, zero after; no
  // two launches in flight may share it (its tickets are drawn before the wait for the kernel before).
  const Fp8EpilogueArgs* shrink = nullptr;
};

constexpr int kFp8Sm90MaxRows = 64;

// Whether this build holds the kernel (CUTLASS's headers were found); it runs on compute capability 9.0 only.
bool fp8_gemm_sm90_built();

// Enqueue on `stream`; no allocation or synchronisation (capturable). nullptr on success.
const char* fp8_gemm_sm90(const Fp8Sm90Args& args, void* stream);

// The product with quant.h's FP8 epilogue inside the same kernel: out (epilogue.out, bf16 [M, N]) gets the bits of
// fp8_gemm_sm90 into fp32 followed by fp8_epilogue(kBFloat16, epilogue), without the fp32 round trip or a second
// launch. One part (splits 1), no activation; epilogue.y and epilogue.pdl are not read (args.pdl is). The row slots
// are read at the kernel's start (the kernel right before must not write them), every other operand of the epilogue
// after the product's main loop, so after the kernel before has finished. But the kernel lets the next one start
// after its main loop: a kernel launched after it with programmatic dependent launch must not write x_scale, w_scale,
// bias, v, ranks, row_slot, B or out before its own wait.
const char* fp8_gemm_sm90_fused(const Fp8Sm90Args& args, const Fp8EpilogueArgs& epilogue, void* stream);

}  // namespace lorafleet
