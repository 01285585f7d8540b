// quantize_rows_e4m3 (see quant.h): one block per row, of 1,024 threads for rows of 8,192 columns and more in
// launches of at most 256 rows (a decode step's: one block per token row, about as many as the SMs or fewer, so a
// wide row takes more of its SM), else 256 (a prefill chunk's thousands of rows fill the GPU with 256-thread blocks
// and waste fewer lanes on a row's last pass); the row is read twice (absmax, then the scaled cast; the second read
// hits L2), 16-byte loads when the row allows them. The bits do not depend on the block size.
// fp8_epilogue (see quant.h): one thread per 8 columns of one row (16-byte stores), a block per 1,024
// columns of a row; B's first 16 rank rows are loaded before the programmatic-launch wait, at once (rank 16: one
// round trip to memory; at most 128 registers, 4 blocks of 128 threads per SM, no spills).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "quant.h"

#include "fp8_epilogue.cuh"
#include "half_pair.cuh"
#include "quant_row.cuh"

#include "pdl.h"

namespace lorafleet {
namespace {

constexpr int kThreads = 256;
using quant_detail::to_float;

constexpr int kWideThreads = 1024;
constexpr int kWideCols = 8192;
constexpr int kWideMaxRows = 256;

template <typename T, int kBlock>
__global__ void __launch_bounds__(kBlock) quantize_rows_kernel(QuantizeRowsArgs a) {
  // The FP8 product that follows may start now: its producer streams the weight meanwhile and waits for this kernel
  // before it reads these rows (fp8_gemm_sm90.cu WeightFirstMainloop).
  pdl_launch_dependents();
  const int row = blockIdx.x;
  quant_detail::quantize_row<T, kBlock>(static_cast<const T*>(a.x) + static_cast<int64_t>(row) * a.x_row_stride,
                                        static_cast<uint8_t*>(a.out) + static_cast<int64_t>(row) * a.cols,
                                        a.scale + row, a.cols);
}

}  // namespace

const char* quantize_rows_e4m3(DType dtype, const QuantizeRowsArgs& a, int device, void* stream) {
  if (a.rows == 0 || a.cols == 0) return nullptr;
  if (a.x == nullptr || a.out == nullptr || a.scale == nullptr) return "quantize_rows_e4m3: null pointer";
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  auto s = static_cast<cudaStream_t>(stream);
  const bool wide = a.cols >= kWideCols && a.rows <= kWideMaxRows;
  if (dtype == DType::kBFloat16) {
    if (wide) quantize_rows_kernel<__nv_bfloat16, kWideThreads><<<a.rows, kWideThreads, 0, s>>>(a);
    else quantize_rows_kernel<__nv_bfloat16, kThreads><<<a.rows, kThreads, 0, s>>>(a);
  } else {
    if (wide) quantize_rows_kernel<__half, kWideThreads><<<a.rows, kWideThreads, 0, s>>>(a);
    else quantize_rows_kernel<__half, kThreads><<<a.rows, kThreads, 0, s>>>(a);
  }
  e = cudaGetLastError();
  if (prev != device) cudaSetDevice(prev);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

namespace {

// ---------------------------------------------------------------------------------------------------
// fp8_epilogue

constexpr int kEpiThreads = 128;
using fp8_epi::kCols;
using fp8_epi::through;

// The activations of flashinfer's act_and_mul kernels, instruction for instruction as its fast-math build emits them
// (ftz multiplies and adds, ex2.approx, div.approx, tanh.approx), so the fused epilogue gives its bits.
__device__ __forceinline__ float fm_mul(float a, float b) {
  float d;
  asm("mul.ftz.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ float fm_add(float a, float b) {
  float d;
  asm("add.ftz.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
// SiLU: val / (1 + __expf(-val))
__device__ __forceinline__ float act_silu(float x) {
  float e, q;
  const float t = fm_mul(x, -1.44269502162933349609375f);  // -log2(e), 0xBFB8AA3B
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t));
  const float d = fm_add(e, 1.0f);
  asm("div.approx.ftz.f32 %0, %1, %2;" : "=f"(q) : "f"(x), "f"(d));
  return q;
}
// GELU (tanh): val * 0.5 * (1 + tanh(0.7978845608028654 * (val + 0.044715 * val^3)))
__device__ __forceinline__ float act_gelu_tanh(float x) {
  float c, t;
  const float b = fm_mul(x, fm_mul(x, 0.044715f));
  asm("fma.rn.ftz.f32 %0, %1, %2, %1;" : "=f"(c) : "f"(x), "f"(b));
  const float z = fm_mul(c, 0.7978845608028654f);
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(z));
  return fm_mul(x, fm_mul(fm_add(t, 1.0f), 0.5f));
}

// Threads: one per 8 columns of one row. Without `act`, thread t of a row takes columns 8t .. 8t + 7 of y and out.
// With `act` (two spans of I columns, gate then up), lanes 2p and 2p + 1 take columns 8p .. 8p + 7 of the gate
// span and of the up span, each as above (rounded to T as the separate epilogue would store them), the up lane hands
// its values to the gate lane, which stores T(act(gate) * up) at columns 8p .. of out [m, I].
template <typename T>
__global__ void __launch_bounds__(kEpiThreads, 4) fp8_epilogue_kernel(const Fp8EpilogueArgs a) {
  if (a.early) pdl_launch_dependents();  // (Fp8EpilogueArgs::early: what follows waits before it touches our memory)
  const int row = blockIdx.y;
  const int t = blockIdx.x * kEpiThreads + threadIdx.x;
  int c, g = 0, start = 0, width = a.cols[0];
  bool active = true;
  if (a.act != 0) {  // every lane stays for the exchange below; lanes past the row compute nothing
    g = t & 1;
    start = g * width;
    c = start + (t >> 1) * kCols;
    active = (t >> 1) * kCols < width;
  } else {
    c = t * kCols;
    if (c >= a.n) return;
    fp8_epi::span_of(a, c, g, start, width);
  }
  const T* b = nullptr;
  const int r = active ? fp8_epi::lora_rank<T>(a.lora, row, g, c, start, width, b) : 0;
  uint4 bk[fp8_epi::kChunk];
  fp8_epi::load_b<T>(bk, b, width, r);
  pdl_wait();
  float o[kCols] = {};
  if (active) {
    float y[kCols];
    fp8_epi::load_y(a, static_cast<int64_t>(row) * a.n + c, y);  // (split parts added in part order)
    const float* v = r > 0 ? fp8_epi::lora_v(a.lora, row, g) : nullptr;
    fp8_epi::finish<T>(a, row, c, width, y, bk, b, r, v, v, o);
  }
  if (a.act != 0) {
    float up[kCols];
#pragma unroll
    for (int e = 0; e < kCols; ++e) {
      o[e] = through<T>(o[e]);  // the value the separate epilogue stores, read back by the activation kernel
      up[e] = __shfl_xor_sync(0xffffffffu, o[e], 1);
    }
    if (!active || g != 0) return;
    float h[kCols];
    if (a.act == 1) {
#pragma unroll
      for (int e = 0; e < kCols; ++e) h[e] = fm_mul(act_silu(o[e]), up[e]);
    } else {
#pragma unroll
      for (int e = 0; e < kCols; ++e) h[e] = fm_mul(act_gelu_tanh(o[e]), up[e]);
    }
    fp8_epi::store8<T>(static_cast<T*>(a.out) + static_cast<int64_t>(row) * width + (c - start), h);
    return;
  }
  fp8_epi::store8<T>(static_cast<T*>(a.out) + static_cast<int64_t>(row) * a.n + c, o);
}

}  // namespace

const char* fp8_epilogue_check(const Fp8EpilogueArgs& a) {
  if (a.x_scale == nullptr || a.w_scale == nullptr || a.out == nullptr) return "fp8_epilogue: null pointer";
  if (a.m > 65535) return "fp8_epilogue: at most 65535 rows";
  if (a.n % kCols != 0 || a.num_groups < 1 || a.num_groups > kMaxGroup) return "fp8_epilogue: bad column spans";
  int total = 0;
  for (int g = 0; g < a.num_groups; ++g) {
    if (a.cols[g] <= 0 || a.cols[g] % kCols != 0) return "fp8_epilogue: spans must be positive multiples of 8";
    total += a.cols[g];
  }
  if (total != a.n) return "fp8_epilogue: the spans do not cover the columns";
  if (a.act < 0 || a.act > 2) return "fp8_epilogue: act must be 0 (none), 1 (SiLU) or 2 (GELU-tanh)";
  if (a.splits < 1 || a.splits > 16) return "fp8_epilogue: splits must be in [1, 16]";
  if (a.act != 0 && (a.num_groups != 2 || a.cols[0] != a.cols[1]))
    return "fp8_epilogue: an activation needs two spans of equal width (gate, up)";
  const Fp8EpilogueLora& l = a.lora;
  if (l.v != nullptr) {
    if (l.ranks == nullptr || l.row_slot == nullptr || l.num_slots < 1) return "fp8_epilogue: LoRA tables missing";
    for (int g = 0; g < a.num_groups; ++g)
      if (l.b[g] == nullptr || l.b_rank_dim[g] < 1) return "fp8_epilogue: LoRA B pool missing";
  }
  return nullptr;
}

const char* fp8_epilogue(DType dtype, const Fp8EpilogueArgs& a, int device, void* stream) {
  if (a.m == 0 || a.n == 0) return nullptr;
  if (a.y == nullptr) return "fp8_epilogue: null pointer";
  if (const char* err = fp8_epilogue_check(a)) return err;
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
  int major = 0;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((a.n / kCols + kEpiThreads - 1) / kEpiThreads, a.m);
    cfg.blockDim = dim3(kEpiThreads);
    cfg.stream = static_cast<cudaStream_t>(stream);
    cudaLaunchAttribute attr[1];
    set_pdl(cfg, attr, a.pdl, major);
    e = dtype == DType::kBFloat16 ? cudaLaunchKernelEx(&cfg, fp8_epilogue_kernel<__nv_bfloat16>, a)
                                  : cudaLaunchKernelEx(&cfg, fp8_epilogue_kernel<__half>, a);
  }
  if (prev != device) cudaSetDevice(prev);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace lorafleet
