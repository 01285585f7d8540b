// FP8 (e4m3) products of decode-sized steps: at most 64 token rows against a weight of N rows.
//
// Torch-free like sgmv.h (the binding is in sgmv_binding.cpp). With x_q [M, K] and w_q [N, K] in e4m3
// (row-major, unit column stride, K a multiple of 64, N a multiple of 16, M <= 64):
//
//   out[m, n] = bf16( (sum_k x_q[m, k] * w_q[n, k]) * x_scale[m] * w_scale[n] )
//
// the e4m3 operands converted exactly to f16 in registers and multiplied on the tensor cores (mma.sync
// m16n8k16, fp32 accumulation: the sums of an FP8 MMA), the weight streamed once from memory: a block of 4
// warps owns 128 weight rows (32 per warp) and a range of K, streamed through shared memory by cp.async
// several stages ahead; where N alone gives too few blocks for the GPU, K is split over blocks whose fp32
// partial sums meet in a workspace (its size from fp8_gemm_workspace). The split depends on N, K and the
// GPU, never on M, and the partials are added in a fixed order: a token's row of `out` is the same whatever
// else is in x. The same value as torch._scaled_mm with per-row scales up to the order of the fp32 additions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lorafleet {

struct Fp8GemmArgs {
  const uint8_t* x = nullptr;      // [M, K] e4m3, or bf16 with x_bf16
  const float* x_scale = nullptr;  // [M] (unused with x_bf16)
  const uint8_t* w = nullptr;      // [N, K] e4m3
  const float* w_scale = nullptr;  // [N]
  void* out = nullptr;             // [M, N] bf16, contiguous
  int m = 0;
  int n = 0;
  int k = 0;
  bool x_bf16 = false;  // x in bf16, unquantized: out = bf16((x @ w_q.T) * w_scale), on the bf16 tensor cores
  void* workspace = nullptr;   // device memory of fp8_gemm_workspace(m, n, k, device) bytes (none when 0)
  size_t workspace_bytes = 0;
};

constexpr int kFp8GemmMaxRows = 64;

// Bytes of workspace fp8_gemm needs for these sizes on `device` (0: none). No synchronisation.
size_t fp8_gemm_workspace(int m, int n, int k, int device);

// Enqueue on `stream` (a memset of the workspace's counters, then the kernel); no synchronisation or
// allocation (capturable). nullptr on success.
const char* fp8_gemm(const Fp8GemmArgs& args, int device, void* stream);

}  // namespace lorafleet
