// The 16-bit float storage types (bf16, fp16) as pairs and scalars in fp32, shared by rope_kv.cu and quant.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lorafleet {

template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using V = __nv_bfloat162;
  static __device__ __forceinline__ float2 get(V v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ V put(float2 f) { return __float22bfloat162_rn(f); }
  static __device__ __forceinline__ __nv_bfloat16 round(float f) { return __float2bfloat16_rn(f); }
};
template <>
struct Pair<__half> {
  using V = __half2;
  static __device__ __forceinline__ float2 get(V v) { return __half22float2(v); }
  static __device__ __forceinline__ V put(float2 f) { return __float22half2_rn(f); }
  static __device__ __forceinline__ __half round(float f) { return __float2half_rn(f); }
};

// The 8 values of T in a 16-byte load, in fp32.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float f[8]) {
  const typename Pair<T>::V* p = reinterpret_cast<const typename Pair<T>::V*>(&raw);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 t = Pair<T>::get(p[e]);
    f[2 * e] = t.x;
    f[2 * e + 1] = t.y;
  }
}

}  // namespace lorafleet
