// One row of the dynamic per-row FP8 (e4m3) quantization of quant.h, as a block-wide device function: the
// one-launch kernel of quant.cu runs it per row, and the LoRA shrink (sgmv.cu) for the rows of its input when
// asked to (so an FP8 projection's activations are quantized without a launch of their own).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace lorafleet {
namespace quant_detail {

constexpr float kE4m3Max = 448.f;

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// v times a row's reciprocal scale, saturated to e4m3: cvt's satfinite is torch's clamp to +-448 followed by the
// cast (a NaN stays NaN), round to nearest even. Two values per conversion, the first in the low byte.
__device__ __forceinline__ uint32_t e4m3x2(float a, float b, float inv) {
  return static_cast<uint32_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, inv), __fmul_rn(b, inv)), __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ uint8_t e4m3(float v, float inv) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(v, inv), __NV_SATFINITE, __NV_E4M3));
}

// 8 values times a row's reciprocal scale as e4m3, packed in order (the first value in the lowest byte).
__device__ __forceinline__ uint2 e4m3x8(const float (&v)[8], float inv) {
  uint2 packed;
  packed.x = e4m3x2(v[0], v[1], inv) | (e4m3x2(v[2], v[3], inv) << 16);
  packed.y = e4m3x2(v[4], v[5], inv) | (e4m3x2(v[6], v[7], inv) << 16);
  return packed;
}

// A row's scale from each thread's share of it (m: the absmax of its values, nan: whether one is NaN), by a whole
// block of kThreads threads (every thread must call it; every thread gets the scale). max is exact in any order, so
// any split of the row over the threads gives the same scale.
template <int kThreads>
__device__ __forceinline__ float row_scale(float m, bool nan) {
  __shared__ float red[kThreads / 32];
  __shared__ int any_nan;
  if (threadIdx.x == 0) any_nan = 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  if (nan) atomicExch(&any_nan, 1);
  if (threadIdx.x < 32) {
    float w = threadIdx.x < kThreads / 32 ? red[threadIdx.x] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) w = fmaxf(w, __shfl_xor_sync(0xffffffffu, w, o));
    if (threadIdx.x == 0) red[0] = w;
  }
  __syncthreads();
  // torch divides a tensor by a Python scalar as a product with the scalar's fp32 reciprocal
  const float s = any_nan ? __int_as_float(0x7fffffff) : fmaxf(__fmul_rn(red[0], 1.f / kE4m3Max), 1e-12f);
  __syncthreads();  // every thread has read red and any_nan: the block may call this again for another row
  return s;
}

// One row of quantize_rows_e4m3 (quant.h) by a whole block of kThreads threads (every thread must call it):
// out[:cols] and *scale from x[:cols].
template <typename T, int kThreads>
__device__ __forceinline__ void quantize_row(const T* x, uint8_t* out, float* scale, int cols) {
  const bool vec = (cols % 8 == 0) && (reinterpret_cast<uintptr_t>(x) % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(out) % 8 == 0);
  // fmaxf drops NaN; torch's amax propagates it: a NaN anywhere makes the row's scale NaN.
  float m = 0.f;
  bool nan = false;
  if (vec) {
    for (int j = threadIdx.x * 8; j < cols; j += kThreads * 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + j);
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float f = to_float(v[e]);
        nan |= f != f;
        m = fmaxf(m, fabsf(f));
      }
    }
  } else {
    for (int j = threadIdx.x; j < cols; j += kThreads) {
      const float f = to_float(x[j]);
      nan |= f != f;
      m = fmaxf(m, fabsf(f));
    }
  }
  const float s = row_scale<kThreads>(m, nan);
  const float inv = __frcp_rn(s);  // the values are multiplied by it (quantize_tokens: x * scale.reciprocal())
  if (threadIdx.x == 0) *scale = s;
  if (vec) {
    for (int j = threadIdx.x * 8; j < cols; j += kThreads * 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + j);
      const T* v = reinterpret_cast<const T*>(&raw);
      float f[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = to_float(v[e]);
      *reinterpret_cast<uint2*>(out + j) = e4m3x8(f, inv);
    }
  } else {
    for (int j = threadIdx.x; j < cols; j += kThreads) out[j] = e4m3(to_float(x[j]), inv);
  }
}
}  // namespace quant_detail
}  // namespace lorafleet
