// rope_kv (see rope_kv.h): one warp per (token, head); each lane rotates element pairs
// (i, i + D/2) two at a time with 4-byte loads, so a 128-wide head is one pass of 32 lanes. With the
// optional LoRA add-on each lane first adds v @ B to its elements (r 4-byte loads of B per pair).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "rope_kv.h"
#include "pdl.h"

#include "half_pair.cuh"
#include "quant_row.cuh"  // quant_detail::e4m3x2

namespace lorafleet {
namespace {

constexpr int kWarps = 4;

constexpr int kMaxLoraRank = 128;  // sgmv.h kMaxRank

// LoRA add-on of columns c, c + 1 of one row: sum over k < r of v[k] * b[k * out + c (+1)], in the
// SGMV CUDA-core expand's order (see rope_kv.h).
template <typename T>
__device__ __forceinline__ float2 lora_pair(const float* v, const T* b, int r, int64_t out, int c) {
  using V = typename Pair<T>::V;
  float a0[4] = {0.f, 0.f, 0.f, 0.f}, a1[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k0 = 0; k0 < r; k0 += 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int k = k0 + j;
      if (k < r) {
        const float vk = v[k];
        const float2 bk = Pair<T>::get(*reinterpret_cast<const V*>(b + k * out + c));
        a0[j] = fmaf(vk, bk.x, a0[j]);
        a1[j] = fmaf(vk, bk.y, a1[j]);
      }
    }
  }
  return make_float2((a0[0] + a0[2]) + (a0[1] + a0[3]), (a1[0] + a1[2]) + (a1[1] + a1[3]));
}

// A pair of qkv values with the row's LoRA add-on (r == 0: unchanged), rounded once to the storage type
// as the SGMV expand stores it.
template <typename T>
__device__ __forceinline__ float2 load_pair(const T* src, int i, const float* lv, const T* lb, int r, int64_t out) {
  using V = typename Pair<T>::V;
  const V raw = *reinterpret_cast<const V*>(src + i);
  if (r == 0) return Pair<T>::get(raw);
  const float2 x = Pair<T>::get(raw), o = lora_pair<T>(lv, lb, r, out, i);
  return Pair<T>::get(Pair<T>::put(make_float2(x.x + o.x, x.y + o.y)));
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32) rope_kv_kernel(const RopeKvArgs p) {
  using V = typename Pair<T>::V;
  // the decode attention after it may start now (DecodeAttnArgs::pdl): it reads only the page tables before it waits
  // for this kernel's end
  pdl_launch_dependents();
  // qkv (and the LoRA rows) come from the kernel before, which may have let this grid start early
  // (RopeKvArgs::pdl); every block waits for it before reading or writing anything (a no-op without PDL)
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int heads = p.num_heads + 2 * p.num_kv_heads;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= static_cast<int64_t>(p.num_tokens) * heads) return;
  const int t = static_cast<int>(item / heads), h = static_cast<int>(item - static_cast<int64_t>(t) * heads);
  const int D = p.head_dim, half = D >> 1;
  const T* src = static_cast<const T*>(p.qkv) + t * p.qkv_row_stride + static_cast<int64_t>(h) * D;
  T* dst = nullptr;
  uint8_t* dst8 = nullptr;  // FP8 pages (cache_e4m3)
  bool rotate = true;
  if (h < p.num_heads) {
    dst = static_cast<T*>(p.q_out) + (static_cast<int64_t>(t) * p.num_heads + h) * D;
  } else {
    const int64_t slot = p.slots[t];
    if (slot < 0 || slot >= p.num_cache_slots) return;
    const bool is_k = h < p.num_heads + p.num_kv_heads;
    const int kh = is_k ? h - p.num_heads : h - p.num_heads - p.num_kv_heads;
    const int64_t at = (slot * p.num_kv_heads + kh) * D;
    if (p.cache_e4m3) dst8 = static_cast<uint8_t*>(is_k ? p.k_cache : p.v_cache) + at;
    else dst = static_cast<T*>(is_k ? p.k_cache : p.v_cache) + at;
    rotate = is_k;
  }
  // elements i, i + 1 of the destination: rounded to T, then (FP8 pages) to e4m3 with unit scale
  const auto store = [&](int i, V pair) {
    if (dst8 == nullptr) {
      *reinterpret_cast<V*>(dst + i) = pair;
      return;
    }
    const float2 f = Pair<T>::get(pair);
    *reinterpret_cast<uint16_t*>(dst8 + i) = static_cast<uint16_t>(quant_detail::e4m3x2(f.x, f.y, 1.f));
  };
  // This head's LoRA add-on, if the row has an adapter (projection g, its column offset within it).
  int r = 0;
  const float* lv = nullptr;
  const T* lb = nullptr;
  int64_t out = 0;
  if (p.lora.v != nullptr) {
    const int slot = p.lora.row_slot[t];
    if (slot >= 0 && slot < p.lora.num_slots) {
      const int g = h < p.num_heads ? 0 : (h < p.num_heads + p.num_kv_heads ? 1 : 2);
      const int first = g == 0 ? 0 : (g == 1 ? p.num_heads : p.num_heads + p.num_kv_heads);
      out = static_cast<int64_t>(g == 0 ? p.num_heads : p.num_kv_heads) * D;
      const int cap = min(p.lora.b_rank_dim[g], kMaxLoraRank);
      r = min(max(p.lora.ranks[static_cast<int64_t>(g) * p.lora.num_slots + slot], 0), cap);
      lv = p.lora.v + t * p.lora.v_row_stride + static_cast<int64_t>(g) * p.lora.v_rank_dim;
      lb = static_cast<const T*>(p.lora.b[g]) + static_cast<int64_t>(slot) * p.lora.b_rank_dim[g] * out +
           static_cast<int64_t>(h - first) * D;
    }
  }
  if (!rotate) {
    for (int i = lane * 2; i < D; i += 64) {
      if (r == 0) {
        store(i, *reinterpret_cast<const V*>(src + i));
      } else {
        store(i, Pair<T>::put(load_pair<T>(src, i, lv, lb, r, out)));
      }
    }
    return;
  }
  int64_t pos = p.positions[t];
  pos = pos < 0 ? 0 : (pos >= p.num_positions ? p.num_positions - 1 : pos);
  const float* cs = p.cos_sin + pos * D;
  for (int i = lane * 2; i < half; i += 64) {
    const float2 x1 = load_pair<T>(src, i, lv, lb, r, out);
    const float2 x2 = load_pair<T>(src, half + i, lv, lb, r, out);
    const float2 c = *reinterpret_cast<const float2*>(cs + i);
    const float2 s = *reinterpret_cast<const float2*>(cs + half + i);
    // x * cos + partner * sin with the product of the partner rounded first (as flashinfer's RoPE
    // compiles it), so both paths give the same bits.
    float2 lo, hi;
    lo.x = __fmaf_rn(x1.x, c.x, __fmul_rn(-x2.x, s.x));
    lo.y = __fmaf_rn(x1.y, c.y, __fmul_rn(-x2.y, s.y));
    hi.x = __fmaf_rn(x2.x, c.x, __fmul_rn(x1.x, s.x));
    hi.y = __fmaf_rn(x2.y, c.y, __fmul_rn(x1.y, s.y));
    store(i, Pair<T>::put(lo));
    store(half + i, Pair<T>::put(hi));
  }
}

}  // namespace

const char* rope_kv(DType dtype, const RopeKvArgs& args, int device, void* stream) {
  if (args.num_tokens <= 0) return nullptr;
  if (args.head_dim % 4 != 0 || args.head_dim > 512) return "rope_kv: head_dim must be a multiple of 4, at most 512";
  if (args.lora.v != nullptr && (args.lora.ranks == nullptr || args.lora.row_slot == nullptr ||
                                 args.lora.num_slots < 1 || args.lora.b[0] == nullptr || args.lora.b[1] == nullptr ||
                                 args.lora.b[2] == nullptr))
    return "rope_kv: incomplete LoRA arguments";
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  int major = 0;
  if (args.pdl) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) {
    const int64_t items = static_cast<int64_t>(args.num_tokens) * (args.num_heads + 2 * args.num_kv_heads);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>((items + kWarps - 1) / kWarps));
    cfg.blockDim = dim3(kWarps * 32);
    cfg.stream = static_cast<cudaStream_t>(stream);
    cudaLaunchAttribute attr[1];
    set_pdl(cfg, attr, args.pdl, major);
    e = dtype == DType::kBFloat16 ? cudaLaunchKernelEx(&cfg, rope_kv_kernel<__nv_bfloat16>, args)
                                  : cudaLaunchKernelEx(&cfg, rope_kv_kernel<__half>, args);
  }
  if (e != cudaSuccess) cudaGetLastError();  // reported here, not left for the next unrelated check
  if (prev != device) cudaSetDevice(prev);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace lorafleet
