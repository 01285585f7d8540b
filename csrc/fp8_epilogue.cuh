// The FP8 product's epilogue for one chunk of 8 columns of one row (quant.h fp8_epilogue): the token and row scales,
// the bias and the row's LoRA expand. Device code shared by the epilogue's own launch (quant.cu) and the wgmma
// product's fused epilogue (fp8_gemm_sm90.cu), so the two give one set of bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "half_pair.cuh"
#include "quant.h"
#include "quant_row.cuh"

namespace lorafleet {
namespace fp8_epi {

constexpr int kCols = 8;    // columns per chunk: one 16-byte store
constexpr int kChunk = 16;  // rank rows of B loaded together (rank 16 in one go)

// v rounded to T and back (a tensor op's store in T)
template <typename T>
__device__ __forceinline__ float through(float v) { return quant_detail::to_float(Pair<T>::round(v)); }

// acc[e][k mod 4] += v[k] * b[k][e] for the chunk's rank rows k0 .. k0 + kChunk - 1 below r (k0 a multiple of 4).
// kGlobal: v is the global v (read through L2: with the shrink inside the product, other SMs of the same kernel
// wrote it), else the thread's own copy of its first values.
template <typename T, bool kGlobal = false>
__device__ __forceinline__ void lora_chunk(float acc[kCols][4], const uint4 (&bk)[kChunk], const float* v, int k0,
                                           int r) {
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    if (k0 + j < r) {
      const float vk = kGlobal ? __ldcg(v + k0 + j) : v[k0 + j];
      float b[kCols];
      unpack8<T>(bk[j], b);
#pragma unroll
      for (int e = 0; e < kCols; ++e) acc[e][j & 3] = fmaf(vk, b[e], acc[e][j & 3]);
    }
  }
}

// The projection whose output span holds column c (< a.n): its index g, first column `start` and `width`.
__device__ __forceinline__ void span_of(const Fp8EpilogueArgs& a, int c, int& g, int& start, int& width) {
  g = 0;
  start = 0;
  width = a.cols[0];
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

// The row's adapter slot, or -1 for none (no LoRA, or a slot outside the pool).
__device__ __forceinline__ int lora_slot(const Fp8EpilogueLora& l, int row) {
  if (l.v == nullptr) return -1;
  const int s = l.row_slot[row];
  return s >= 0 && s < l.num_slots ? s : -1;
}

// Span g's B pool rank dimension.
__device__ __forceinline__ int b_rank_dim(const Fp8EpilogueLora& l, int g) {
  return g == 0 ? l.b_rank_dim[0] : g == 1 ? l.b_rank_dim[1] : l.b_rank_dim[2];
}

// Slot s's (>= 0) B for span g at column c: the address of its rank row 0.
template <typename T>
__device__ __forceinline__ const T* b_row0(const Fp8EpilogueLora& l, int s, int g, int c, int start, int width) {
  const void* bg = g == 0 ? l.b[0] : g == 1 ? l.b[1] : l.b[2];
  return static_cast<const T*>(bg) + static_cast<int64_t>(s) * b_rank_dim(l, g) * width + (c - start);
}

// Slot s's (>= 0) rank for span g, clamped to the pool's rank dimension and kMaxRank.
__device__ __forceinline__ int slot_rank(const Fp8EpilogueLora& l, int s, int g) {
  return min(max(l.ranks[static_cast<int64_t>(g) * l.num_slots + s], 0), min(b_rank_dim(l, g), kMaxRank));
}

// The row's adapter for span g: its rank r (0: none) and the address of B's rank row 0 at column c.
template <typename T>
__device__ __forceinline__ int lora_rank(const Fp8EpilogueLora& l, int row, int g, int c, int start, int width,
                                         const T*& b) {
  b = nullptr;
  const int s = lora_slot(l, row);
  if (s < 0) return 0;
  b = b_row0<T>(l, s, g, c, start, width);
  return slot_rank(l, s, g);
}

// The row's v for span g (its shrink's rank values).
__device__ __forceinline__ const float* lora_v(const Fp8EpilogueLora& l, int row, int g) {
  return l.v + static_cast<int64_t>(row) * l.v_row_stride + static_cast<int64_t>(g) * l.v_rank_dim;
}

// B's first kChunk rank rows below r at column c (nothing may write B in the kernel launched right before).
template <typename T>
__device__ __forceinline__ void load_b(uint4 (&bk)[kChunk], const T* b, int width, int r) {
#pragma unroll
  for (int j = 0; j < kChunk; ++j)
    if (j < r) bk[j] = __ldg(reinterpret_cast<const uint4*>(b + static_cast<int64_t>(j) * width));
}

// o[e] for columns c .. c + 7 of `row` from the product's fp32 values y[e] (split parts already added, in part
// order): T((y * x_scale) * w_scale), plus the bias (rounded to T), plus the LoRA sum (not rounded: the caller
// stores T(o) or hands o to the activation). bk: B's first rank rows (load_b), b and r from lora_rank; v0: the row's
// first kChunk values of v for span g (lora_v, or a copy of them), v: all of them (lora_v).
template <typename T>
__device__ __forceinline__ void finish(const Fp8EpilogueArgs& a, int row, int c, int width, const float (&y)[kCols],
                                       uint4 (&bk)[kChunk], const T* b, int r, const float* v0, const float* v,
                                       float (&o)[kCols]) {
  const float4 w0 = __ldg(reinterpret_cast<const float4*>(a.w_scale + c));
  const float4 w1 = __ldg(reinterpret_cast<const float4*>(a.w_scale + c + 4));
  const float w[kCols] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
  const float xs = a.x_scale[row];
#pragma unroll
  for (int e = 0; e < kCols; ++e) o[e] = through<T>(__fmul_rn(__fmul_rn(y[e], xs), w[e]));
  if (a.bias != nullptr) {
    float bias[kCols];
    unpack8<T>(__ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.bias) + c)), bias);
#pragma unroll
    for (int e = 0; e < kCols; ++e) o[e] = through<T>(__fadd_rn(o[e], bias[e]));
  }
  if (r > 0) {
    float acc[kCols][4] = {};
    lora_chunk<T>(acc, bk, v0, 0, r);
    for (int k0 = kChunk; k0 < r; k0 += kChunk) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j)
        if (k0 + j < r) bk[j] = __ldg(reinterpret_cast<const uint4*>(b + static_cast<int64_t>(k0 + j) * width));
      lora_chunk<T, true>(acc, bk, v, k0, r);
    }
#pragma unroll
    for (int e = 0; e < kCols; ++e)
      o[e] = __fadd_rn(o[e], __fadd_rn(__fadd_rn(acc[e][0], acc[e][2]), __fadd_rn(acc[e][1], acc[e][3])));
  }
}

// The product's fp32 values y[e] at element `at` (row * n + the chunk's first column) of a.y: with split parts, their
// partial sums added in part order.
__device__ __forceinline__ void load_y(const Fp8EpilogueArgs& a, int64_t at, float (&y)[kCols]) {
  const float4 y0 = *reinterpret_cast<const float4*>(a.y + at), y1 = *reinterpret_cast<const float4*>(a.y + at + 4);
  y[0] = y0.x, y[1] = y0.y, y[2] = y0.z, y[3] = y0.w, y[4] = y1.x, y[5] = y1.y, y[6] = y1.z, y[7] = y1.w;
  for (int s = 1; s < a.splits; ++s) {
    const float* ys = a.y + static_cast<int64_t>(s) * a.m * a.n + at;
    const float4 p0 = *reinterpret_cast<const float4*>(ys), p1 = *reinterpret_cast<const float4*>(ys + 4);
    const float p[kCols] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
    for (int e = 0; e < kCols; ++e) y[e] = __fadd_rn(y[e], p[e]);
  }
}

// T(o[e]) for the 8 columns, stored at `dst` (16-byte aligned).
template <typename T>
__device__ __forceinline__ void store8(T* dst, const float (&o)[kCols]) {
  uint4 packed;
  T* p = reinterpret_cast<T*>(&packed);
#pragma unroll
  for (int e = 0; e < kCols; ++e) p[e] = Pair<T>::round(o[e]);
  *reinterpret_cast<uint4*>(dst) = packed;
}

}  // namespace fp8_epi
}  // namespace lorafleet
