// quantize_rows_e4m3 (see quant.h): one block per row; the row is read twice (absmax, then the scaled
// cast; the second read hits L2), 16-byte loads when the row allows them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "quant.h"

namespace lorafleet {
namespace {

constexpr int kThreads = 256;
constexpr float kE4m3Max = 448.f;

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

__device__ __forceinline__ uint8_t e4m3(float v, float s) {
  const float d = __fdiv_rn(v, s);
  // torch's clamp keeps a NaN (fminf / fmaxf would drop it): a NaN input or a NaN row scale gives NaN
  const float q = d != d ? d : fminf(fmaxf(d, -kE4m3Max), kE4m3Max);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(QuantizeRowsArgs a) {
  const int row = blockIdx.x;
  const T* x = static_cast<const T*>(a.x) + static_cast<int64_t>(row) * a.x_row_stride;
  uint8_t* out = static_cast<uint8_t*>(a.out) + static_cast<int64_t>(row) * a.cols;
  const bool vec = (a.cols % 8 == 0) && (reinterpret_cast<uintptr_t>(x) % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(out) % 8 == 0);
  // fmaxf drops NaN; torch's amax propagates it: a NaN anywhere makes the row's scale NaN.
  float m = 0.f;
  bool nan = false;
  if (vec) {
    for (int j = threadIdx.x * 8; j < a.cols; j += kThreads * 8) {
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
    for (int j = threadIdx.x; j < a.cols; j += kThreads) {
      const float f = to_float(x[j]);
      nan |= f != f;
      m = fmaxf(m, fabsf(f));
    }
  }
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
  if (threadIdx.x == 0) a.scale[row] = s;
  if (vec) {
    for (int j = threadIdx.x * 8; j < a.cols; j += kThreads * 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + j);
      const T* v = reinterpret_cast<const T*>(&raw);
      uint2 packed;
      uint8_t* b = reinterpret_cast<uint8_t*>(&packed);
#pragma unroll
      for (int e = 0; e < 8; ++e) b[e] = e4m3(to_float(v[e]), s);
      *reinterpret_cast<uint2*>(out + j) = packed;
    }
  } else {
    for (int j = threadIdx.x; j < a.cols; j += kThreads) out[j] = e4m3(to_float(x[j]), s);
  }
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

}  // namespace lorafleet
