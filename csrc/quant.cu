// quantize_rows_e4m3 (see quant.h): one block per row; the row is read twice (absmax, then the scaled
// cast; the second read hits L2), 16-byte loads when the row allows them.
// fp8_epilogue (see quant.h): one thread per 8 columns of one row (16-byte stores), a block per 1,024
// columns of a row; B's first 16 rank rows are loaded before the programmatic-launch wait, at once (rank 16: one
// round trip to memory; at most 128 registers, 4 blocks of 128 threads per SM, no spills).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "quant.h"

#include "half_pair.cuh"
#include "quant_row.cuh"

#include "pdl.h"

namespace lorafleet {
namespace {

constexpr int kThreads = 256;
using quant_detail::to_float;

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(QuantizeRowsArgs a) {
  const int row = blockIdx.x;
  quant_detail::quantize_row<T, kThreads>(static_cast<const T*>(a.x) + static_cast<int64_t>(row) * a.x_row_stride,
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
  if (dtype == DType::kBFloat16) quantize_rows_kernel<__nv_bfloat16><<<a.rows, kThreads, 0, s>>>(a);
  else quantize_rows_kernel<__half><<<a.rows, kThreads, 0, s>>>(a);
  e = cudaGetLastError();
  if (prev != device) cudaSetDevice(prev);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

namespace {

// ---------------------------------------------------------------------------------------------------
// fp8_epilogue

constexpr int kEpiThreads = 128;
constexpr int kEpiCols = 8;  // columns per thread: one 16-byte store
constexpr int kEpiChunk = 16;  // rank rows of B loaded together (the first chunk before the wait): rank 16 in one go

// v rounded to T and back (a tensor op's store in T)
template <typename T>
__device__ __forceinline__ float through(float v) { return to_float(Pair<T>::round(v)); }

// acc[e][k mod 4] += v[k] * b[k][e] for the chunk's rank rows k0 .. k0 + kEpiChunk - 1 below r (k0 a multiple of 4)
template <typename T>
__device__ __forceinline__ void lora_chunk(float acc[kEpiCols][4], const uint4 (&bk)[kEpiChunk], const float* v, int k0,
                                           int r) {
#pragma unroll
  for (int j = 0; j < kEpiChunk; ++j) {
    if (k0 + j < r) {
      const float vk = v[k0 + j];
      float b[kEpiCols];
      unpack8<T>(bk[j], b);
#pragma unroll
      for (int e = 0; e < kEpiCols; ++e) acc[e][j & 3] = fmaf(vk, b[e], acc[e][j & 3]);
    }
  }
}

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
  const int row = blockIdx.y;
  const int t = blockIdx.x * kEpiThreads + threadIdx.x;
  int c, g = 0, start = 0, width = a.cols[0];
  bool active = true;
  if (a.act != 0) {  // every lane stays for the exchange below; lanes past the row compute nothing
    g = t & 1;
    start = g * width;
    c = start + (t >> 1) * kEpiCols;
    active = (t >> 1) * kEpiCols < width;
  } else {
    c = t * kEpiCols;
    if (c >= a.n) return;
    // the projection whose output span holds column c
    if (a.num_groups > 1 && c >= a.cols[0]) {
      g = 1;
      start = a.cols[0];
      width = a.cols[1];
      if (a.num_groups > 2 && c >= start + a.cols[1]) {
        g = 2;
        start += a.cols[1];
        width = a.cols[2];
      }
    }
  }
  const Fp8EpilogueLora& l = a.lora;
  int r = 0;
  const T* b = nullptr;
  if (active && l.v != nullptr) {
    const int s = l.row_slot[row];
    if (s >= 0 && s < l.num_slots) {
      const int rdim = g == 0 ? l.b_rank_dim[0] : g == 1 ? l.b_rank_dim[1] : l.b_rank_dim[2];
      r = min(max(l.ranks[static_cast<int64_t>(g) * l.num_slots + s], 0), min(rdim, kMaxRank));
      const void* bg = g == 0 ? l.b[0] : g == 1 ? l.b[1] : l.b[2];
      b = static_cast<const T*>(bg) + static_cast<int64_t>(s) * rdim * width + (c - start);
    }
  }
  uint4 bk[kEpiChunk];
#pragma unroll
  for (int j = 0; j < kEpiChunk; ++j)
    if (j < r) bk[j] = __ldg(reinterpret_cast<const uint4*>(b + static_cast<int64_t>(j) * width));
  pdl_wait();
  float o[kEpiCols] = {};
  if (active) {
    const int64_t at = static_cast<int64_t>(row) * a.n + c;
    const float4 y0 = *reinterpret_cast<const float4*>(a.y + at), y1 = *reinterpret_cast<const float4*>(a.y + at + 4);
    const float4 w0 = __ldg(reinterpret_cast<const float4*>(a.w_scale + c));
    const float4 w1 = __ldg(reinterpret_cast<const float4*>(a.w_scale + c + 4));
    float y[kEpiCols] = {y0.x, y0.y, y0.z, y0.w, y1.x, y1.y, y1.z, y1.w};
    for (int s = 1; s < a.splits; ++s) {  // the split-K product's partial sums, in part order
      const float* ys = a.y + static_cast<int64_t>(s) * a.m * a.n + at;
      const float4 p0 = *reinterpret_cast<const float4*>(ys), p1 = *reinterpret_cast<const float4*>(ys + 4);
      const float p[kEpiCols] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
      for (int e = 0; e < kEpiCols; ++e) y[e] = __fadd_rn(y[e], p[e]);
    }
    const float w[kEpiCols] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
    const float xs = a.x_scale[row];
#pragma unroll
    for (int e = 0; e < kEpiCols; ++e) o[e] = through<T>(__fmul_rn(__fmul_rn(y[e], xs), w[e]));
    if (a.bias != nullptr) {
      float bias[kEpiCols];
      unpack8<T>(__ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.bias) + c)), bias);
#pragma unroll
      for (int e = 0; e < kEpiCols; ++e) o[e] = through<T>(__fadd_rn(o[e], bias[e]));
    }
    if (r > 0) {
      const float* v = l.v + static_cast<int64_t>(row) * l.v_row_stride + static_cast<int64_t>(g) * l.v_rank_dim;
      float acc[kEpiCols][4] = {};
      lora_chunk<T>(acc, bk, v, 0, r);
      for (int k0 = kEpiChunk; k0 < r; k0 += kEpiChunk) {
#pragma unroll
        for (int j = 0; j < kEpiChunk; ++j)
          if (k0 + j < r) bk[j] = __ldg(reinterpret_cast<const uint4*>(b + static_cast<int64_t>(k0 + j) * width));
        lora_chunk<T>(acc, bk, v, k0, r);
      }
#pragma unroll
      for (int e = 0; e < kEpiCols; ++e)
        o[e] = __fadd_rn(o[e], __fadd_rn(__fadd_rn(acc[e][0], acc[e][2]), __fadd_rn(acc[e][1], acc[e][3])));
    }
  }
  uint4 packed;
  T* p = reinterpret_cast<T*>(&packed);
  if (a.act != 0) {
    float up[kEpiCols];
#pragma unroll
    for (int e = 0; e < kEpiCols; ++e) {
      o[e] = through<T>(o[e]);  // the value the separate epilogue stores, read back by the activation kernel
      up[e] = __shfl_xor_sync(0xffffffffu, o[e], 1);
    }
    if (!active || g != 0) return;
    if (a.act == 1) {
#pragma unroll
      for (int e = 0; e < kEpiCols; ++e) p[e] = Pair<T>::round(fm_mul(act_silu(o[e]), up[e]));
    } else {
#pragma unroll
      for (int e = 0; e < kEpiCols; ++e) p[e] = Pair<T>::round(fm_mul(act_gelu_tanh(o[e]), up[e]));
    }
    *reinterpret_cast<uint4*>(static_cast<T*>(a.out) + static_cast<int64_t>(row) * width + (c - start)) = packed;
    return;
  }
#pragma unroll
  for (int e = 0; e < kEpiCols; ++e) p[e] = Pair<T>::round(o[e]);
  *reinterpret_cast<uint4*>(static_cast<T*>(a.out) + static_cast<int64_t>(row) * a.n + c) = packed;
}

}  // namespace

const char* fp8_epilogue(DType dtype, const Fp8EpilogueArgs& a, int device, void* stream) {
  if (a.m == 0 || a.n == 0) return nullptr;
  if (a.y == nullptr || a.x_scale == nullptr || a.w_scale == nullptr || a.out == nullptr)
    return "fp8_epilogue: null pointer";
  if (a.m > 65535) return "fp8_epilogue: at most 65535 rows";
  if (a.n % kEpiCols != 0 || a.num_groups < 1 || a.num_groups > kMaxGroup) return "fp8_epilogue: bad column spans";
  int total = 0;
  for (int g = 0; g < a.num_groups; ++g) {
    if (a.cols[g] <= 0 || a.cols[g] % kEpiCols != 0) return "fp8_epilogue: spans must be positive multiples of 8";
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
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
  int major = 0;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((a.n / kEpiCols + kEpiThreads - 1) / kEpiThreads, a.m);
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
