// SGMV shrink / expand kernels for fp16 and bf16 (see sgmv.h for the semantics and docs/kernels.md
// for the design).
//
// Both kernels share one structure. Every block first copies the segment table into shared memory
// and turns it into a list of work items (a block-wide prefix sum over segments, ~2 dependent global
// round trips), then takes items blockIdx.x, blockIdx.x + gridDim.x, ... The grid therefore depends
// only on host-known shapes (T, capacity, G, pool shapes, SM count), and any segment table, however
// its rows are distributed, is covered by the same launch: capturable once, replayable with new
// tables.
//
// Items of a segment with fewer than `mma_min_rows` rows use the CUDA-core path (memory bound:
// decode, distinct adapters): 16-byte vector loads, fp32 accumulate.
//   shrink item = 1 row x 2 rank rows (one-row segments; 1 or 4 with LaunchOptions::decode_ranks),
//                 2 rows x 2 rank rows (up to 95 rows) or 2 x 4 (longer): full-K dot products,
//                 reduced through shared memory.
//   expand item = (up to 2 rows) x (64 column vectors = 512 columns): 4 lanes per column vector split
//                 the rank, then a warp reduce-scatter leaves each lane 4 finished outputs of one row.
// Items of longer segments use tensor cores (WMMA 16x16x16, fp32 accumulate):
//   shrink item = 16 rows x all r ranks of one projection, full K split over the 8 warps (each warp
//                 its own cp.async double buffer), partials summed in warp order.
//   expand item = 64 rows x 64 output columns of one projection, K = r.
// On sm_90 both kernels use programmatic dependent launch: they start while the previous kernel
// drains, read the tables and their first weight tile, then griddepcontrol.wait before touching
// x, v or y. Every output element is written by one thread: no atomics, bitwise reproducible.
#include "sgmv.h"

#include "pdl.h"
#include "quant_row.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace lorafleet {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

// CUDA-core path.
constexpr int kShrinkRows = 2;    // rows per shrink item
constexpr int kShrinkLong = 96;   // segments of at least this many rows use kShrinkRanksLong
constexpr int kShrinkRanks1 = 2;  // rank rows per shrink item in one-row segments (decode), by default
// ... in the tensor-core capable shrink and in the fused launch, whose grids were not re-tuned (a lone
// fused call with 256 distinct rows took 33.8 us with 1 x 2 items against 31.3 with 1 x 4)
constexpr int kShrinkRanksMma1 = 4;
constexpr int kShrinkRanksN = 2;  // ... in short segments: 2 rows x 2 rank rows, two K steps in flight
constexpr int kShrinkRanksLong = 4;  // ... in long segments: 2 rows x 4 rank rows (x re-read half as often)
constexpr int kExpandRows = 2;    // rows per expand item
constexpr int kExpandVecs = 64;   // 16-byte column vectors per expand item (8 per warp)
constexpr int kExpandBatch = 4;   // rank rows per lane loaded together
// Shrink grid cap per SM (the kernel's register budget allows 4). With decode items of 2 rank rows and
// 4 blocks per SM, every decode item of a Llama-2-7B group is in flight at once; measured in 32 decode
// layers with 32 distinct adapters (bench/probe_decode.py, docs/benchmarks.md §3.2): LoRA 48.3 us per
// layer over none against 53.5 with the earlier 2 blocks x 4 rank rows; one adapter (one 32-row
// segment) within 1.3 us either way.
constexpr int kShrinkBlocksPerSm = 4;
// Register budget of the CUDA-core kernels (min resident blocks of 256 threads): 64 registers. The
// sm_80 code of the shrink needs a few more to avoid spilling.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
constexpr int kShrinkMinBlocks = 3;
#else
constexpr int kShrinkMinBlocks = 4;
#endif
// Tensor-core path.
constexpr int kTileM = 64;        // expand: rows per item
constexpr int kTileN = 64;        // expand: output columns per item
constexpr int kLds = kTileN + 8;  // expand: smem row stride (elements) of 64-wide B tiles: 144 B, no bank conflicts
constexpr int kLdc = kTileN + 4;  // expand: fp32 staging row stride
constexpr int kQuantRowSmem = 64;  // static shared memory of quant_detail::quantize_row (36 bytes), rounded up
constexpr int kShrinkTileM = 16;  // tensor-core shrink: rows per item
constexpr int kShrinkK = 32;      // ... K per stage of one warp
constexpr int kLdsS = kShrinkK + 8;  // ... its smem row stride (elements): 80 B

static_assert(kMaxSegments % kThreads == 0, "table build splits the capacity evenly");
static_assert(kShrinkRanks1 == 1 || kShrinkRanks1 == 2 || kShrinkRanks1 == 4, "decode items: 1, 2 or 4 rank rows");
static_assert(kShrinkRanksMma1 == 1 || kShrinkRanksMma1 == 2 || kShrinkRanksMma1 == 4, "decode items: 1, 2 or 4");
static_assert(4 <= kShrinkRows * kShrinkRanksLong, "the CUDA-core reduction area holds decode items of 4 rank rows");

// ---------------------------------------------------------------------------------------------------
// Small device helpers.

template <typename To, typename From>
__device__ __forceinline__ To bit_cast(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "size mismatch");
  To t;
  memcpy(&t, &f, sizeof(To));
  return t;
}

template <typename T>
struct Cvt;

template <>
struct Cvt<__half> {
  __device__ __forceinline__ static float2 unpack(uint32_t u) { return __half22float2(bit_cast<__half2>(u)); }
  __device__ __forceinline__ static uint32_t pack(float a, float b) { return bit_cast<uint32_t>(__floats2half2_rn(a, b)); }
  __device__ __forceinline__ static __half from(float a) { return __float2half_rn(a); }
};

template <>
struct Cvt<__nv_bfloat16> {
  __device__ __forceinline__ static float2 unpack(uint32_t u) {
    return __bfloat1622float2(bit_cast<__nv_bfloat162>(u));
  }
  __device__ __forceinline__ static uint32_t pack(float a, float b) {
    return bit_cast<uint32_t>(__floats2bfloat162_rn(a, b));
  }
  __device__ __forceinline__ static __nv_bfloat16 from(float a) { return __float2bfloat16_rn(a); }
};

// 8 packed 16-bit values -> 8 floats.
template <typename T>
__device__ __forceinline__ void to_float8(const uint4& u, float (&f)[8]) {
  float2 p;
  p = Cvt<T>::unpack(u.x); f[0] = p.x; f[1] = p.y;
  p = Cvt<T>::unpack(u.y); f[2] = p.x; f[3] = p.y;
  p = Cvt<T>::unpack(u.z); f[4] = p.x; f[5] = p.y;
  p = Cvt<T>::unpack(u.w); f[6] = p.x; f[7] = p.y;
}

template <typename T>
__device__ __forceinline__ uint4 from_float8(const float (&f)[8]) {
  uint4 u;
  u.x = Cvt<T>::pack(f[0], f[1]);
  u.y = Cvt<T>::pack(f[2], f[3]);
  u.z = Cvt<T>::pack(f[4], f[5]);
  u.w = Cvt<T>::pack(f[6], f[7]);
  return u;
}

// Read-only 16-byte load (weights and x are never written by these kernels).
template <typename T>
__device__ __forceinline__ uint4 ldg16(const T* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ int rank_of(int packed, int g) { return (packed >> (8 * g)) & 0xff; }

// The slice order of a row's reductions over K (the RMSNorm's sum of squares, the CUDA-core shrink's dot products):
// the KV 16-byte vectors of a row fall into kSlices slices of ceil(KV / kSlices) vectors, slice c = [x, y); lane l
// of the slice's warp accumulates its vectors x + l, x + l + 32, ... in order with fmaf, the warp's xor tree sums
// the lanes, and the slices' sums are added in slice order from 0. One block of kWarps warps reduces a whole row
// (warp c: slice c).
constexpr int kSlices = 8;
static_assert(kWarps == kSlices, "a block of the CUDA-core kernels reduces a row's slices with one warp each");
__device__ __forceinline__ int2 slice_of(int KV, int c) {
  const int per = (KV + kSlices - 1) / kSlices;
  const int lo = min(c * per, KV);
  return make_int2(lo, min(lo + per, KV));
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------------
// Kernel parameters (passed by value; a few hundred bytes).

struct ShrinkParams {
  SegmentArgs seg;
  const void* x;
  const void* a[kMaxGroup];
  int a_rank_dim[kMaxGroup];
  int rank_cap[kMaxGroup];  // min(a_rank_dim[g], kMaxRank): device ranks are clamped to it
  int in_features;
  float* v;
  int v_row_stride;         // G * v_rank_dim
  int v_rank_dim;
  int mma_min_rows;
  int decode_ranks;         // rank rows per CUDA-core item of one-row segments: 1, 2 or 4
  int rank_pad;             // max rank_cap rounded up to 16: rows of the A tile in shared memory
  int work_offset;          // bytes from the start of dynamic shared memory to the work area
  int x_ready;              // LaunchOptions::x_ready: read x and write v without waiting for the previous kernel
  int row_items;            // LaunchOptions::row_items: segments below kShrinkLong rows as one-row items too
  uint8_t* quant_out;       // optional: x's rows quantized to e4m3 (ShrinkArgs)
  float* quant_scale;
  NormArgs norm;            // sgmv_norm_shrink: x is norm.x_out, computed by the launch (kNorm kernels only)
};

struct ExpandParams {
  SegmentArgs seg;
  const float* v;
  int v_row_stride;
  int v_rank_dim;
  const void* b[kMaxGroup];
  int b_rank_dim[kMaxGroup];
  int rank_cap[kMaxGroup];
  void* y[kMaxGroup];
  int64_t y_row_stride[kMaxGroup];
  int out_features[kMaxGroup];
  int mma_min_rows;
  int rank_pad;
  int work_offset;
  int write_f32;  // ExpandArgs::write_f32: y[g] are fp32 and receive the add-on itself (no read of y)
};

// ---------------------------------------------------------------------------------------------------
// Segment table in shared memory, and the work-item prefix sum.

struct Table {
  int* lo;      // [cap] first row
  int* n;       // [cap] rows (0: no work)
  int* slot;    // [cap]
  int* rk;      // [cap] ranks of the G projections, 8 bits each
  int* prefix;  // [cap + 1] exclusive prefix of work items
  int* warp_totals;  // [kWarps]
  int cap;
};

__host__ __device__ constexpr int table_ints(int cap) { return ((5 * cap + 1 + kWarps) + 31) / 32 * 32; }

__device__ __forceinline__ Table carve_table(int* smem, int cap) {
  Table t;
  t.cap = cap;
  t.lo = smem;
  t.n = smem + cap;
  t.slot = smem + 2 * cap;
  t.rk = smem + 3 * cap;
  t.prefix = smem + 4 * cap;
  t.warp_totals = smem + 5 * cap + 1;
  return t;
}

// Block-wide exclusive prefix of the per-segment item counts `cnt` (thread t owns segments
// [t * per, t * per + per), `local` is their sum) into `prefix` [cap + 1]; returns the total.
// Uses t.warp_totals; ends with a block barrier.
template <int kPer>
__device__ __forceinline__ int write_prefix(Table t, int* prefix, const int (&cnt)[kPer], int local) {
  const int tid = threadIdx.x;
  const int per = ceil_div(t.cap, kThreads);
  const int lane = tid & 31, warp = tid >> 5;
  int incl = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) t.warp_totals[warp] = incl;
  __syncthreads();
  int base = 0, total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int wt = t.warp_totals[w];
    base += w < warp ? wt : 0;
    total += wt;
  }
  int run = base + incl - local;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int i = tid * per + e;
    if (e < per && i < t.cap) {
      prefix[i] = run;
      run += cnt[e];
    }
  }
  if (tid == 0) prefix[t.cap] = total;
  __syncthreads();
  return total;
}

// Fills the table and returns the total number of work items. `count(n, packed_ranks)` gives the
// items of one non-empty segment. Thread t owns segments [t * per, t * per + per).
template <class Count>
__device__ int build_table(const SegmentArgs& s, const int (&rank_cap)[kMaxGroup], Table t, const Count& count) {
  constexpr int kPer = kMaxSegments / kThreads;
  const int tid = threadIdx.x;
  const int per = ceil_div(t.cap, kThreads);
  int lo[kPer], hi[kPer], slot[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int i = tid * per + e;
    lo[e] = 0;
    hi[e] = 0;
    slot[e] = -1;
    if (e < per && i < t.cap) {
      lo[e] = __ldg(s.indptr + i);
      hi[e] = __ldg(s.indptr + i + 1);
      slot[e] = __ldg(s.slots + i);
    }
  }
  int cnt[kPer];
  int local = 0;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int i = tid * per + e;
    const int l = max(lo[e], 0);
    int n = min(hi[e], s.num_rows) - l;
    const int sl = slot[e];
    int packed = 0;
    if (n > 0 && sl >= 0 && sl < s.num_slots) {
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < s.num_groups) {
          const int r = __ldg(s.ranks + static_cast<int64_t>(g) * s.num_slots + sl);
          packed |= min(max(r, 0), rank_cap[g]) << (8 * g);
        }
      }
    }
    if (packed == 0 || n < 0) n = 0;
    cnt[e] = n > 0 ? count(n, packed) : 0;
    if (e < per && i < t.cap) {
      t.lo[i] = l;
      t.n[i] = n;
      t.slot[i] = sl;
      t.rk[i] = packed;
    }
    local += cnt[e];
  }
  return write_prefix(t, t.prefix, cnt, local);
}

// The segment i with prefix[i] <= item < prefix[i + 1] (requires 0 <= item < prefix[cap]).
__device__ __forceinline__ int find_segment(const int* prefix, int cap, int item) {
  int lo = 0, hi = cap;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (prefix[mid] <= item) lo = mid; else hi = mid;
  }
  return lo;
}

// ---------------------------------------------------------------------------------------------------
// RMSNorm rows (NormArgs, sgmv.h): the standalone launch and the rows of sgmv_norm_shrink.

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return quant_detail::to_float(Cvt<T>::from(v));
}

// r's 8 values at element offset `off` (a multiple of 8) of the rows: T(h + res), or h.
template <typename T>
__device__ __forceinline__ void norm_load8(const NormArgs& n, int64_t off, float (&r)[8]) {
  to_float8<T>(ldg16(static_cast<const T*>(n.h) + off), r);
  if (n.res != nullptr) {
    float q[8];
    to_float8<T>(ldg16(static_cast<const T*>(n.res) + off), q);
#pragma unroll
    for (int e = 0; e < 8; ++e) r[e] = round_to<T>(r[e] + q[e]);
  }
}

// r -> x in place for the 8 columns of vector kv: the norm's scaling and roundings (ops.py rms_norm).
template <typename T>
__device__ __forceinline__ void norm_apply8(const NormArgs& n, int kv, float rs, float (&r)[8]) {
  float w[8];
  to_float8<T>(ldg16(static_cast<const T*>(n.w) + static_cast<int64_t>(kv) * 8), w);
  if (n.offset == 0.f) {
#pragma unroll
    for (int e = 0; e < 8; ++e) r[e] = round_to<T>(w[e] * round_to<T>(r[e] * rs));
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) r[e] = round_to<T>((r[e] * rs) * (n.offset + w[e]));
  }
}

// rs of a row from each thread's sum of squares `ss` over its vectors in the slice order (see slice_of), by the whole
// block (every thread calls it, every thread gets it): the warp's xor tree, then the slices in order.
__device__ __forceinline__ float norm_rs_of(const NormArgs& n, float ss) {
  __shared__ float part[kWarps];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t += part[w];
  __syncthreads();  // `part` is reused by the next call
  return rsqrtf(__fdiv_rn(t, static_cast<float>(n.cols)) + n.eps);
}

// rs of a row, by the whole block (every thread calls it, every thread gets it), in the slice order (see
// slice_of): warp w sums slice w, each lane the squares of its vectors with fmaf, then the warp's xor tree, then
// the slices in order — the same value in every launch and block that computes it.
template <typename T>
__device__ float norm_rs(const NormArgs& n, int row) {
  const int KV = n.cols >> 3;
  const int64_t base = static_cast<int64_t>(row) * n.cols;
  const int2 sl = slice_of(KV, threadIdx.x >> 5);
  float ss = 0.f;
  for (int kv = sl.x + (threadIdx.x & 31); kv < sl.y; kv += 32) {
    float r[8];
    norm_load8<T>(n, base + static_cast<int64_t>(kv) * 8, r);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = fmaf(r[e], r[e], ss);
  }
  return norm_rs_of(n, ss);
}

// One row's outputs (res_out, x_out, and the e4m3 row and scale) by the whole block.
template <typename T>
__device__ void norm_row(const NormArgs& n, int row) {
  const float rs = norm_rs<T>(n, row);
  const int KV = n.cols >> 3;
  const int64_t base = static_cast<int64_t>(row) * n.cols;
  for (int kv = threadIdx.x; kv < KV; kv += kThreads) {
    const int64_t off = base + static_cast<int64_t>(kv) * 8;
    float r[8];
    norm_load8<T>(n, off, r);
    if (n.res != nullptr) *reinterpret_cast<uint4*>(static_cast<T*>(n.res_out) + off) = from_float8<T>(r);
    norm_apply8<T>(n, kv, rs, r);
    *reinterpret_cast<uint4*>(static_cast<T*>(n.x_out) + off) = from_float8<T>(r);
  }
  if (n.quant_out != nullptr) {
    __syncthreads();  // the block's x_out stores are visible to all its threads
    quant_detail::quantize_row<T, kThreads>(static_cast<const T*>(n.x_out) + base, n.quant_out + base,
                                            n.quant_scale + row, n.cols);
  }
}

// The same outputs with the row in registers, for rows whose slices give each lane at most kVecs vectors (cols up to
// kSlices * 32 * kVecs * 8): each thread loads its vectors of h and res once, in the slice order, and keeps r, then x;
// the block reduces twice (the sum of squares in the slice order: norm_rs's value; the absmax, exact in any order),
// against norm_row's three passes over memory (rs, x, then the quantization reading x back). The same bits.
template <typename T, int kVecs>
__device__ void norm_row_regs(const NormArgs& n, int row) {
  const int KV = n.cols >> 3;
  const int64_t base = static_cast<int64_t>(row) * n.cols;
  const int2 sl = slice_of(KV, threadIdx.x >> 5);
  const int kv0 = sl.x + (threadIdx.x & 31);
  float r[kVecs][8];
#pragma unroll
  for (int j = 0; j < kVecs; ++j)
    if (kv0 + 32 * j < sl.y) norm_load8<T>(n, base + static_cast<int64_t>(kv0 + 32 * j) * 8, r[j]);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j)
    if (kv0 + 32 * j < sl.y) {
#pragma unroll
      for (int e = 0; e < 8; ++e) ss = fmaf(r[j][e], r[j][e], ss);
    }
  const float rs = norm_rs_of(n, ss);
  float m = 0.f;  // x's absmax and NaN flag over this thread's vectors (quantize_row's)
  bool nan = false;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int kv = kv0 + 32 * j;
    if (kv >= sl.y) continue;
    const int64_t off = base + static_cast<int64_t>(kv) * 8;
    if (n.res != nullptr) *reinterpret_cast<uint4*>(static_cast<T*>(n.res_out) + off) = from_float8<T>(r[j]);
    norm_apply8<T>(n, kv, rs, r[j]);  // r[j] now holds x's values, each a T (norm_apply8 rounds them)
    *reinterpret_cast<uint4*>(static_cast<T*>(n.x_out) + off) = from_float8<T>(r[j]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      nan |= r[j][e] != r[j][e];
      m = fmaxf(m, fabsf(r[j][e]));
    }
  }
  if (n.quant_out == nullptr) return;
  const float s = quant_detail::row_scale<kThreads>(m, nan);
  const float inv = __frcp_rn(s);
  if (threadIdx.x == 0) n.quant_scale[row] = s;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int kv = kv0 + 32 * j;
    if (kv < sl.y)
      *reinterpret_cast<uint2*>(n.quant_out + base + static_cast<int64_t>(kv) * 8) = quant_detail::e4m3x8(r[j], inv);
  }
}

// Blocks per SM of the norm's launch (norm_typed's grid), in its launch bounds too. Without a block count there,
// ptxas compiled the kernel to 32 registers with a spill across the quantization's reciprocal (a call on its slow
// path); with this count it fits the same 32 registers without one (tests/test_csrc_compile.py checks).
constexpr int kNormBlocksPerSm = 8;
// ... of the register-resident launch (norm_row_regs): 64 registers a thread for a lane's kVecs vectors
constexpr int kNormRegBlocksPerSm = 4;
constexpr int kNormRegMaxVecs = 4;  // rows up to 8 * 32 * 4 * 8 = 8,192 wide in registers

template <typename T>
__global__ void __launch_bounds__(kThreads, kNormBlocksPerSm) rms_norm_rows_kernel(const __grid_constant__ NormArgs n) {
  // with the rows' e4m3 copy (or `early`), the wgmma product that follows may start now (it waits for this kernel
  // before it reads them, sm90_gemm.cuh WeightFirstMainloop) and stream its weight meanwhile
  if (n.quant_out != nullptr || n.early) pdl_launch_dependents();
  pdl_wait();  // h and res come from the preceding kernel
  for (int row = blockIdx.x; row < n.rows; row += gridDim.x) norm_row<T>(n, row);
}

template <typename T, int kVecs>
__global__ void __launch_bounds__(kThreads, kNormRegBlocksPerSm)
    rms_norm_rows_regs_kernel(const __grid_constant__ NormArgs n) {
  // with the rows' e4m3 copy (or `early`), the wgmma product that follows may start now (it waits for this kernel
  // before it reads them, sm90_gemm.cuh WeightFirstMainloop) and stream its weight meanwhile
  if (n.quant_out != nullptr || n.early) pdl_launch_dependents();
  pdl_wait();  // h and res come from the preceding kernel
  for (int row = blockIdx.x; row < n.rows; row += gridDim.x) norm_row_regs<T, kVecs>(n, row);
}

// ---------------------------------------------------------------------------------------------------
// Shrink.

// Whether a segment of n rows runs as one-row CUDA-core items of decode_ranks rank rows (row_items: ShrinkParams's).
__device__ __forceinline__ bool one_row_items(int n, int row_items) { return n == 1 || (row_items && n < kShrinkLong); }

template <bool kMma>
struct ShrinkCount {
  int mma_min_rows;
  int decode_ranks;  // ShrinkParams::decode_ranks
  int row_items = 0;  // ShrinkParams::row_items (the fused and norm launches: 0)
  __device__ int operator()(int n, int packed) const {
    int rt = 0, active = 0;
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      const int r = rank_of(packed, g);
      rt += r;
      active += r > 0;
    }
    if (kMma && n >= mma_min_rows) return ceil_div(n, kShrinkTileM) * active;
    if (one_row_items(n, row_items)) return n * ceil_div(rt, decode_ranks);
    const int rb = n >= kShrinkLong ? kShrinkRanksLong : kShrinkRanksN;
    return ceil_div(n, kShrinkRows) * ceil_div(rt, rb);
  }
};

// Rank row f of the flattened (projection, rank) list of a slot -> (projection, row within it).
__device__ __forceinline__ int2 split_rank_row(int packed, int f) {
  const int r0 = rank_of(packed, 0), r1 = rank_of(packed, 1);
  if (f < r0) return make_int2(0, f);
  f -= r0;
  if (f < r1) return make_int2(1, f);
  return make_int2(2, f - r1);
}

// v[row0 + m, rank row f0 + j] = dot(x[row0 + m], A row) for m < NR, j < RB (rank rows
// flattened over the projections). Each warp accumulates its slice of K (slice_of); the slice order's reduction.
// The first A loads are issued before waiting for the preceding kernel (A is never written by it).
template <typename T, int NR, int RB, bool kNorm = false>
__device__ __forceinline__ void shrink_cc(const ShrinkParams& p, int row0, int slot, int packed, int f0, float* red,
                                          bool& waited) {
  // K steps in flight per thread (register budget: 64 registers, no spills at any of these). Items of one rank row of
  // one row (decode_ranks 1) keep four in flight (8 loads; a 1 x 2 item's two steps: 6), so the long rows of wide
  // inputs (Llama-2-70B's down: 14 vectors per lane) take half the dependent round trips. Never a bit of v: the lane
  // accumulates its vectors in increasing order whatever U (the zero vectors past its slice add +0 to a sum that
  // started at +0).
  constexpr int U = kNorm ? 1 : (NR * RB == 1 ? 4 : (NR * RB <= 4 ? 2 : 1));
  const int K = p.in_features;
  const int KV = K >> 3;
  const int rt = rank_of(packed, 0) + rank_of(packed, 1) + rank_of(packed, 2);
  const T* ap[RB];
#pragma unroll
  for (int j = 0; j < RB; ++j) {
    // a missing rank row (f0 + j >= rt) re-reads the last one; its result is dropped
    const int2 gf = split_rank_row(packed, min(f0 + j, rt - 1));
    ap[j] = static_cast<const T*>(p.a[gf.x]) + (static_cast<int64_t>(slot) * p.a_rank_dim[gf.x] + gf.y) * K;
  }
  const T* x0 = static_cast<const T*>(p.x) + static_cast<int64_t>(row0) * K;
  // this warp's slice of K (slice_of): the lane takes its vectors start, start + 32, ... below end
  const int2 sl = slice_of(KV, threadIdx.x >> 5);
  const int start = sl.x + (threadIdx.x & 31), end = sl.y;

  float acc[NR][RB];
#pragma unroll
  for (int m = 0; m < NR; ++m)
#pragma unroll
    for (int j = 0; j < RB; ++j) acc[m][j] = 0.f;

  uint4 av[U][RB];
  auto load_a = [&](int kv0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kv = kv0 + u * 32;
#pragma unroll
      for (int j = 0; j < RB; ++j)
        av[u][j] = kv < end ? ldg16(ap[j] + static_cast<int64_t>(kv) * 8) : make_uint4(0, 0, 0, 0);
    }
  };
  load_a(start);
  if (!waited && !p.x_ready) {  // block-uniform
    pdl_wait();
    waited = true;
  }
  // kNorm: x is not in memory yet (this launch writes it after its items); each row's normalized values are made
  // here from the norm's inputs, with the roundings of the values the launch writes, so v is the plain shrink's.
  float rs[NR];
  if constexpr (kNorm) {
#pragma unroll
    for (int m = 0; m < NR; ++m) rs[m] = norm_rs<T>(p.norm, row0 + m);
  }
  for (int kv0 = start; kv0 < end; kv0 += U * 32) {
    uint4 xv[U][NR];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kv = kv0 + u * 32;
#pragma unroll
      for (int m = 0; m < NR; ++m) {
        if constexpr (kNorm) {
          if (kv < end) {
            float r[8];
            norm_load8<T>(p.norm, static_cast<int64_t>(row0 + m) * K + kv * 8, r);
            norm_apply8<T>(p.norm, kv, rs[m], r);
            xv[u][m] = from_float8<T>(r);  // exact: r holds values of T
          } else {
            xv[u][m] = make_uint4(0, 0, 0, 0);
          }
        } else {
          xv[u][m] = kv < end ? ldg16(x0 + static_cast<int64_t>(m) * K + kv * 8) : make_uint4(0, 0, 0, 0);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < RB; ++j) {
        float af[8];
        to_float8<T>(av[u][j], af);
#pragma unroll
        for (int m = 0; m < NR; ++m) {
          float xf[8];
          to_float8<T>(xv[u][m], xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[m][j] = fmaf(xf[e], af[e], acc[m][j]);
        }
      }
    }
    if (kv0 + U * 32 < end) load_a(kv0 + U * 32);
  }

  // The slice order's reduction: each warp's xor tree (its slice's sum), then the slices in order.
  // (the partial sums go through shared memory first: the block's register budget holds no more)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  constexpr int NV = NR * RB;
#pragma unroll
  for (int m = 0; m < NR; ++m)
#pragma unroll
    for (int j = 0; j < RB; ++j) red[(m * RB + j) * kThreads + tid] = acc[m][j];
  __syncthreads();
  for (int vi = warp; vi < NV; vi += kWarps) {
    float s[kWarps];
#pragma unroll
    for (int c = 0; c < kWarps; ++c) s[c] = warp_sum(red[vi * kThreads + c * 32 + lane]);
    float t = 0.f;
#pragma unroll
    for (int c = 0; c < kWarps; ++c) t += s[c];
    const int m = vi / RB, f = f0 + vi % RB;
    if (lane == 0 && f < rt) {
      const int2 gf = split_rank_row(packed, f);
      p.v[static_cast<int64_t>(row0 + m) * p.v_row_stride + gf.x * p.v_rank_dim + gf.y] = t;
    }
  }
  __syncthreads();  // `red` is reused by the next item
}

// v[row0 : row0 + nr, g, :r] = x[row0 : row0 + nr] @ A_g[slot, :r]^T with tensor cores, nr <= 16.
// The 8 warps split K: warp w takes the 32-wide K chunks w, w + 8, ..., each through its own
// double-buffered cp.async stage (16 x rows and rank_pad A rows), so one block keeps 8 chunks in
// flight and a 16-row tile of a 4096-wide x streams at an SM's share of the bandwidth. The 8 partial
// [16 x r] products are then summed in warp order (deterministic) and written once.
template <typename T>
__device__ void shrink_mma(const ShrinkParams& p, int row0, int nr, int slot, int g, int r, unsigned char* work,
                           bool& waited) {
  using namespace nvcuda;
  const int K = p.in_features;
  const int rp = (r + 15) & ~15;
  const int nfr = rp / 16;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int stage = (kShrinkTileM + p.rank_pad) * kLdsS;  // elements of one stage of one warp
  T* ws = reinterpret_cast<T*>(work) + warp * 2 * stage;   // this warp's [2][16 + rank_pad][kLdsS]
  const T* xg = static_cast<const T*>(p.x) + static_cast<int64_t>(row0) * K;
  const T* ag = static_cast<const T*>(p.a[g]) + static_cast<int64_t>(slot) * p.a_rank_dim[g] * K;
  const int nk = ceil_div(K, kShrinkK);
  const int mine = nk > warp ? ceil_div(nk - warp, kWarps) : 0;  // chunks warp, warp + 8, ...

  // Stage rows 0..15: x rows (zero beyond nr); rows 16..16+rp-1: A rank rows (zero beyond r).
  auto load = [&](int i, int buf) {
    const int k0 = (warp + i * kWarps) * kShrinkK;
    T* dst = ws + buf * stage;
    for (int id = lane; id < (kShrinkTileM + rp) * (kShrinkK / 8); id += 32) {
      const int row = id >> 2, k = k0 + (id & 3) * 8;
      const T* src;
      bool ok;
      if (row < kShrinkTileM) {
        ok = row < nr && k < K;
        src = xg + static_cast<int64_t>(row) * K + k;
      } else {
        ok = row - kShrinkTileM < r && k < K;
        src = ag + static_cast<int64_t>(row - kShrinkTileM) * K + k;
      }
      cp_async16(dst + row * kLdsS + (id & 3) * 8, ok ? src : xg, ok);
    }
    cp_async_commit();
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMaxRank / 16];
#pragma unroll
  for (int j = 0; j < kMaxRank / 16; ++j) wmma::fill_fragment(acc[j], 0.f);

  if (!waited && !p.x_ready) {  // block-uniform; x comes from the preceding kernel
    pdl_wait();
    waited = true;
  }
  if (mine > 0) load(0, 0);
  for (int i = 0; i < mine; ++i) {
    if (i + 1 < mine) {
      load(i + 1, (i + 1) & 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();
    const T* xb = ws + (i & 1) * stage;
    const T* ab = xb + kShrinkTileM * kLdsS;
#pragma unroll
    for (int kk = 0; kk < kShrinkK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
      wmma::load_matrix_sync(fa, xb + kk, kLdsS);
#pragma unroll
      for (int j = 0; j < kMaxRank / 16; ++j) {
        if (j < nfr) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, ab + j * 16 * kLdsS + kk, kLdsS);
          wmma::mma_sync(acc[j], fa, fb, acc[j]);
        }
      }
    }
    __syncwarp();  // this buffer is refilled by the load two chunks later
  }

  // Partials: warp w's [16][rp + 4] fp32 block inside its own (now idle) stage area.
  const int ldc = p.rank_pad + 4;
  float* part = reinterpret_cast<float*>(ws);
#pragma unroll
  for (int j = 0; j < kMaxRank / 16; ++j)
    if (j < nfr) wmma::store_matrix_sync(part + j * 16, acc[j], ldc, wmma::mem_row_major);
  __syncthreads();
  float* vg = p.v + static_cast<int64_t>(row0) * p.v_row_stride + g * p.v_rank_dim;
  const float* base = reinterpret_cast<const float*>(work);
  const int warp_floats = 2 * stage * static_cast<int>(sizeof(T)) / 4;
  for (int id = tid; id < nr * r; id += kThreads) {
    const int row = id / r, k = id - row * r;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += base[w * warp_floats + row * ldc + k];
    vg[static_cast<int64_t>(row) * p.v_row_stride + k] = s;
  }
  __syncthreads();  // the stages are reused by the next item
}

// One CUDA-core shrink item: item `local` of the segment (lo, n, slot, packed ranks) -> its rows
// and rank rows, and the shrink_cc instantiation for its shape. Must agree with ShrinkCount. The item
// shape never changes a bit of v: every lane of shrink_cc accumulates its vectors of its warp's slice of K
// in increasing order with explicit fmaf (trailing zero vectors past the slice only add +0), and the
// reduction is the slice order's (slice_of), whatever NR, RB or block.
template <typename T, bool kNorm = false>
__device__ __forceinline__ void shrink_cc_item(const ShrinkParams& p, int lo, int n, int slot, int packed, int local,
                                               float* red, bool& waited) {
  const int rt = rank_of(packed, 0) + rank_of(packed, 1) + rank_of(packed, 2);
  const bool long_seg = n >= kShrinkLong;
  const bool one_row = one_row_items(n, p.row_items);
  const int rb = one_row ? p.decode_ranks : (long_seg ? kShrinkRanksLong : kShrinkRanksN);
  const int rows = one_row ? 1 : kShrinkRows;  // per item
  const int nq = ceil_div(rt, rb);
  const int c = local / nq, q = local - c * nq;
  const int row0 = lo + c * rows;
  const int f0 = q * rb;
  const int nr = min(rows, n - c * rows);
  static_assert(kShrinkRows == 2, "one shrink_cc instantiation per row count");
  if (one_row) {  // decode rows (and with row_items short segments' rows): p.decode_ranks is 1, 2 or 4 (checked
                  // by the launchers)
    if (rb == 4) {
      shrink_cc<T, 1, 4, kNorm>(p, row0, slot, packed, f0, red, waited);
    } else if (rb == 2) {
      shrink_cc<T, 1, 2, kNorm>(p, row0, slot, packed, f0, red, waited);
    } else {
      shrink_cc<T, 1, 1, kNorm>(p, row0, slot, packed, f0, red, waited);
    }
  } else if (long_seg) {
    if (nr == 1) {
      shrink_cc<T, 1, kShrinkRanksLong, kNorm>(p, row0, slot, packed, f0, red, waited);
    } else {
      shrink_cc<T, 2, kShrinkRanksLong, kNorm>(p, row0, slot, packed, f0, red, waited);
    }
  } else if (nr == 1) {  // the odd last row of a short segment
    shrink_cc<T, 1, kShrinkRanksN, kNorm>(p, row0, slot, packed, f0, red, waited);
  } else {
    shrink_cc<T, 2, kShrinkRanksN, kNorm>(p, row0, slot, packed, f0, red, waited);
  }
}

template <typename T, bool kMma, bool kNorm = false>
__global__ void __launch_bounds__(kThreads, kMma ? 2 : (kNorm ? 3 : kShrinkMinBlocks)) sgmv_shrink_kernel(const __grid_constant__ ShrinkParams p) {
  static_assert(!(kMma && kNorm), "the norm's shrink runs CUDA-core items only");
  pdl_launch_dependents();
  extern __shared__ __align__(128) unsigned char smem[];
  // The segment table, the ranks and the first A tile are read while the preceding kernel may
  // still run (they are written before a step starts, never by the kernel right before a shrink);
  // x is read and v written only after the wait (with p.x_ready: at once, the wait at the end).
  const Table t = carve_table(reinterpret_cast<int*>(smem), p.seg.capacity);
  const int total = build_table(p.seg, p.rank_cap, t, ShrinkCount<kMma>{p.mma_min_rows, p.decode_ranks, p.row_items});
  unsigned char* work = smem + p.work_offset;
  float* red = reinterpret_cast<float*>(work);
  bool waited = false;  // every global write (v) comes after pdl_wait() (the previous expand may read v), unless
                        // p.x_ready: then the previous kernel leaves x and v alone, and the wait comes at the end

  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    const int i = find_segment(t.prefix, t.cap, item);
    const int local = item - t.prefix[i];
    const int lo = t.lo[i], n = t.n[i], slot = t.slot[i], packed = t.rk[i];
    if (kMma && n >= p.mma_min_rows) {
      int active = 0;
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) active += rank_of(packed, g) > 0;
      const int tile = local / active;
      int j = local - tile * active, g = 0;
      for (; g < kMaxGroup; ++g) {
        if (rank_of(packed, g) > 0) {
          if (j == 0) break;
          --j;
        }
      }
      shrink_mma<T>(p, lo + tile * kShrinkTileM, min(kShrinkTileM, n - tile * kShrinkTileM), slot, g,
                    rank_of(packed, g), work, waited);
    } else {
      shrink_cc_item<T, kNorm>(p, lo, n, slot, packed, local, red, waited);
    }
  }
  if (!waited) pdl_wait();  // finish only after the preceding kernel (see the expand kernel)
  if constexpr (kNorm) {  // after the items, like the quantization below (which kNorm launches never ask for)
    __syncthreads();
    for (int row = blockIdx.x; row < p.norm.rows; row += gridDim.x) norm_row<T>(p.norm, row);
    return;
  }
  if (p.quant_out != nullptr) {  // after the items, so that their A loads overlap the preceding kernel's tail
    __syncthreads();  // the items' last use of shared memory
    const T* x = static_cast<const T*>(p.x);
    // Rows on the grid's last blocks: items go to blocks 0, 1, ... first, so the last blocks hold the fewest
    // (row r on block gridDim.x - 1 - r, and every gridDim.x-th row after it on the same block).
    for (int row = gridDim.x - 1 - static_cast<int>(blockIdx.x); row < p.seg.num_rows; row += gridDim.x)
      quant_detail::quantize_row<T, kThreads>(x + static_cast<int64_t>(row) * p.in_features,
                                              p.quant_out + static_cast<int64_t>(row) * p.in_features,
                                              p.quant_scale + row, p.in_features);
  }
}

// ---------------------------------------------------------------------------------------------------
// Expand.

template <bool kMma>
struct ExpandCount {
  int mma_min_rows;
  int out[kMaxGroup];
  __device__ int operator()(int n, int packed) const {
    int vecs = 0, tiles = 0;
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (rank_of(packed, g) > 0) {
        vecs += out[g] >> 3;
        tiles += ceil_div(out[g], kTileN);
      }
    }
    if (kMma && n >= mma_min_rows) return ceil_div(n, kTileM) * tiles;
    return ceil_div(n, kExpandRows) * ceil_div(vecs, kExpandVecs);
  }
};

// v is read through the read-only cache when another kernel wrote it, and from L2 (coherent) when
// other blocks of the same fused launch wrote it moments ago.
template <bool kCoherent>
__device__ __forceinline__ float load_v(const float* p) {
  return kCoherent ? __ldcg(p) : __ldg(p);
}

// y[row0 + m, cols of item q] += v[row0 + m, g, :r] @ B_g[slot, :r, cols] for m < nr (<= 2).
// Lane layout: rank group rg = lane & 3 (rank rows rg, rg + 4, ...), column vector warp * 8 + lane / 4.
// `ready()` runs (block-uniformly) after the first B batch is requested and before v or y is read:
// the two-launch path waits there for the preceding kernel, the fused path also for the segment's
// shrink items, so B streams in while they finish.
struct PdlReady {
  bool& waited;
  __device__ __forceinline__ void operator()() const {
    if (!waited) {
      pdl_wait();
      waited = true;
    }
  }
};

template <typename T, bool kCoherentV = false, class Ready = PdlReady>
__device__ __forceinline__ void expand_cc(const ExpandParams& p, int row0, int nr, int slot, int packed, int q,
                                          const Ready& ready) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rg = lane & 3;
  int f = q * kExpandVecs + warp * 8 + (lane >> 2);  // column vector, flattened over adapted projections
  int g = -1;
#pragma unroll
  for (int gg = 0; gg < kMaxGroup; ++gg) {
    if (g < 0 && rank_of(packed, gg) > 0) {
      const int nv = p.out_features[gg] >> 3;
      if (f < nv) g = gg; else f -= nv;
    }
  }
  const bool valid = g >= 0;
  const int r = valid ? rank_of(packed, g) : 0;
  const int out = valid ? p.out_features[g] : 0;
  const T* bp = valid ? static_cast<const T*>(p.b[g]) + static_cast<int64_t>(slot) * p.b_rank_dim[g] * out + f * 8
                      : nullptr;

  uint4 bv[kExpandBatch];
  auto load_batch = [&](int k0) {
#pragma unroll
    for (int j = 0; j < kExpandBatch; ++j) {
      const int k = k0 + 4 * j;
      bv[j] = k < r ? ldg16(bp + static_cast<int64_t>(k) * out) : make_uint4(0, 0, 0, 0);
    }
  };
  load_batch(rg);  // the first B batch may load before the preceding kernel finishes
  ready();
  // This lane's output after the reduce-scatter below: row hi2, columns 4 * hi1 .. + 3 of its
  // vector. Load y now; it is used at the end.
  const bool hi2 = lane & 2, hi1 = lane & 1;
  const int row = hi2 ? 1 : 0;
  const bool writes = valid && row < nr;
  const int64_t yoff = writes ? static_cast<int64_t>(row0 + row) * p.y_row_stride[g] + f * 8 + (hi1 ? 4 : 0) : 0;
  T* yp = writes && !p.write_f32 ? static_cast<T*>(p.y[g]) + yoff : nullptr;
  uint2 yv = yp != nullptr ? *reinterpret_cast<const uint2*>(yp) : make_uint2(0, 0);

  const float* vp = p.v + static_cast<int64_t>(row0) * p.v_row_stride + (valid ? g : 0) * p.v_rank_dim;
  const bool two = nr > 1;
  float acc[2][8];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[m][e] = 0.f;
  for (int k0 = rg; k0 < r; k0 += 4 * kExpandBatch) {
#pragma unroll
    for (int j = 0; j < kExpandBatch; ++j) {
      const int k = k0 + 4 * j;
      if (k < r) {
        float bf[8];
        to_float8<T>(bv[j], bf);
        const float v0 = load_v<kCoherentV>(vp + k);
        const float v1 = two ? load_v<kCoherentV>(vp + p.v_row_stride + k) : 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          acc[0][e] = fmaf(v0, bf[e], acc[0][e]);
          acc[1][e] = fmaf(v1, bf[e], acc[1][e]);
        }
      }
    }
    if (k0 + 4 * kExpandBatch < r) load_batch(k0 + 4 * kExpandBatch);
  }
  // Reduce-scatter over the 4 rank groups (lanes 4c .. 4c + 3): lane (hi2, hi1) ends with row hi2,
  // columns 4 * hi1 .. + 3.
  float h[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float send = hi2 ? acc[0][e] : acc[1][e];
    const float keep = hi2 ? acc[1][e] : acc[0][e];
    h[e] = keep + __shfl_xor_sync(kFullMask, send, 2);
  }
  float o[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float send = hi1 ? h[e] : h[4 + e];
    const float keep = hi1 ? h[4 + e] : h[e];
    o[e] = keep + __shfl_xor_sync(kFullMask, send, 1);
  }
  if (writes && p.write_f32) {
    *reinterpret_cast<float4*>(static_cast<float*>(p.y[g]) + yoff) = make_float4(o[0], o[1], o[2], o[3]);
  } else if (writes) {
    const float2 a = Cvt<T>::unpack(yv.x), b = Cvt<T>::unpack(yv.y);
    yv.x = Cvt<T>::pack(a.x + o[0], a.y + o[1]);
    yv.y = Cvt<T>::pack(b.x + o[2], b.y + o[3]);
    *reinterpret_cast<uint2*>(yp) = yv;
  }
}

// y_g[row0 : row0 + nr, col0 : col0 + 64] += v[rows, g, :r] @ B_g[slot, :r, col0 : col0 + 64] with tensor cores.
template <typename T>
__device__ void expand_mma(const ExpandParams& p, int row0, int nr, int slot, int g, int r, int col0,
                           unsigned char* work, bool& waited) {
  using namespace nvcuda;
  const int tid = threadIdx.x;
  const int rp = (r + 15) & ~15;
  const int ldv = p.rank_pad + 8;
  const int out = p.out_features[g];
  T* vs = reinterpret_cast<T*>(work);  // [kTileM][ldv]
  T* bs = vs + kTileM * ldv;           // [rank_pad][kLds]
  const T* bg = static_cast<const T*>(p.b[g]) + static_cast<int64_t>(slot) * p.b_rank_dim[g] * out;
  for (int id = tid; id < rp * (kTileN / 8); id += kThreads) {
    const int rr = id >> 3, col = col0 + (id & 7) * 8;
    const bool ok = rr < r && col < out;
    cp_async16(bs + rr * kLds + (id & 7) * 8, ok ? bg + static_cast<int64_t>(rr) * out + col : bg, ok);
  }
  cp_async_commit();
  if (!waited) {
    pdl_wait();
    waited = true;
  }
  // This thread's two 8-column vectors of the y tile, requested now so that their latency overlaps
  // the v loads and the MMA (they are added at the end, as before: the same bits).
  static_assert(kTileM * (kTileN / 8) == 2 * kThreads, "two y vectors per thread");
  uint4 yv[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int id = tid + j * kThreads, row = id >> 3, col = col0 + (id & 7) * 8;
    yv[j] = (row < nr && col < out && !p.write_f32)
                ? *reinterpret_cast<const uint4*>(static_cast<const T*>(p.y[g]) +
                                                  static_cast<int64_t>(row0 + row) * p.y_row_stride[g] + col)
                : make_uint4(0, 0, 0, 0);
  }
  const float* vg = p.v + static_cast<int64_t>(row0) * p.v_row_stride + g * p.v_rank_dim;
  for (int id = tid; id < kTileM * rp; id += kThreads) {
    const int row = id / rp, k = id - row * rp;
    const float val = (row < nr && k < r) ? vg[static_cast<int64_t>(row) * p.v_row_stride + k] : 0.f;
    vs[row * ldv + k] = Cvt<T>::from(val);
  }
  cp_async_wait<0>();
  __syncthreads();

  const int warp = tid >> 5;
  const int mf = warp & 3, nf0 = warp >> 2;  // column blocks nf0 and nf0 + 2
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
  wmma::fill_fragment(acc[0], 0.f);
  wmma::fill_fragment(acc[1], 0.f);
  for (int kk = 0; kk < rp; kk += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, vs + mf * 16 * ldv + kk, ldv);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
      wmma::load_matrix_sync(fb, bs + kk * kLds + (nf0 + 2 * j) * 16, kLds);
      wmma::mma_sync(acc[j], fa, fb, acc[j]);
    }
  }
  __syncthreads();  // vs / bs are overwritten by the staging below
  float* cs = reinterpret_cast<float*>(work);  // [kTileM][kLdc]
#pragma unroll
  for (int j = 0; j < 2; ++j)
    wmma::store_matrix_sync(cs + mf * 16 * kLdc + (nf0 + 2 * j) * 16, acc[j], kLdc, wmma::mem_row_major);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int id = tid + j * kThreads, row = id >> 3, c = id & 7, col = col0 + c * 8;
    if (row < nr && col < out && p.write_f32) {
      float* dp = static_cast<float*>(p.y[g]) + static_cast<int64_t>(row0 + row) * p.y_row_stride[g] + col;
      const float* cp = cs + row * kLdc + c * 8;
      reinterpret_cast<float4*>(dp)[0] = make_float4(cp[0], cp[1], cp[2], cp[3]);
      reinterpret_cast<float4*>(dp)[1] = make_float4(cp[4], cp[5], cp[6], cp[7]);
    } else if (row < nr && col < out) {
      T* yp = static_cast<T*>(p.y[g]) + static_cast<int64_t>(row0 + row) * p.y_row_stride[g] + col;
      float yf[8];
      to_float8<T>(yv[j], yf);
#pragma unroll
      for (int e = 0; e < 8; ++e) yf[e] += cs[row * kLdc + c * 8 + e];
      *reinterpret_cast<uint4*>(yp) = from_float8<T>(yf);
    }
  }
  __syncthreads();
}

template <typename T, bool kMma>
__global__ void __launch_bounds__(kThreads, 4) sgmv_expand_kernel(const __grid_constant__ ExpandParams p) {
  pdl_launch_dependents();
  extern __shared__ __align__(128) unsigned char smem[];
  // The tables, ranks and B are not written by the kernel this one overlaps (the shrink), so they
  // are read before pdl_wait(); v and y only after it.
  const Table t = carve_table(reinterpret_cast<int*>(smem), p.seg.capacity);
  ExpandCount<kMma> count{p.mma_min_rows, {p.out_features[0], p.out_features[1], p.out_features[2]}};
  const int total = build_table(p.seg, p.rank_cap, t, count);
  unsigned char* work = smem + p.work_offset;
  bool waited = false;

  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    const int i = find_segment(t.prefix, t.cap, item);
    const int local = item - t.prefix[i];
    const int lo = t.lo[i], n = t.n[i], slot = t.slot[i], packed = t.rk[i];
    if (kMma && n >= p.mma_min_rows) {
      int tiles = 0;  // column tiles over the adapted projections
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) tiles += rank_of(packed, g) > 0 ? ceil_div(p.out_features[g], kTileN) : 0;
      const int tile = local / tiles;
      int c = local - tile * tiles, g = 0;
      for (; g < kMaxGroup; ++g) {
        if (rank_of(packed, g) > 0) {
          const int nt = ceil_div(p.out_features[g], kTileN);
          if (c < nt) break;
          c -= nt;
        }
      }
      expand_mma<T>(p, lo + tile * kTileM, min(kTileM, n - tile * kTileM), slot, g, rank_of(packed, g), c * kTileN,
                    work, waited);
    } else {
      int vecs = 0;
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) vecs += rank_of(packed, g) > 0 ? p.out_features[g] >> 3 : 0;
      const int nq = ceil_div(vecs, kExpandVecs);
      const int c = local / nq, q = local - c * nq;
      expand_cc<T>(p, lo + c * kExpandRows, min(kExpandRows, n - c * kExpandRows), slot, packed, q, PdlReady{waited});
    }
  }
  // Never finish before the preceding kernel: whatever follows this one in the stream may rely on
  // both being complete.
  if (!waited) pdl_wait();
}


// ---------------------------------------------------------------------------------------------------
// Fused shrink + expand (CUDA-core items only): one launch per projection group.
//
// The item list is [every shrink item][every expand item] of the same segment table, taken
// blockIdx.x, blockIdx.x + gridDim.x, ... as in the two kernels above, so each block finishes all of
// its shrink items before its first expand item. An expand item of segment i waits until the
// segment's shrink items are done: the block that finishes a shrink item publishes it (barrier,
// one gpu-scope fence, one atomic increment of done_shrink[i]); the expand item's first thread
// spins on that count, then fences, and the block reads v from L2. The grid never exceeds the
// blocks that can be resident at once (LaunchOptions::blocks_per_sm and max_blocks only lower it, and
// any grid of at least one block covers every item), and every block starts (and calls
// launch_dependents) before any dependent kernel may occupy an SM, so every waited-for shrink item is
// running or done: no deadlock. The last expand item of a segment (done_expand[i] reaching its
// count) sets both counters back to zero, so they are zero between launches without a memset. Every
// output element is still written by exactly one thread with a fixed reduction order: bitwise
// reproducible, and bitwise equal to the two-launch CUDA-core path.

struct FusedParams {
  ShrinkParams s;
  ExpandParams e;
  int* done_shrink;  // [capacity], zero between launches
  int* done_expand;  // [capacity], zero between launches
  int eprefix_offset;  // ints from the start of shared memory to the expand-item prefix [cap + 1]
};

// Exclusive prefix of `count(n, packed)` over the segments already in `t` (thread t owns the same
// segments as in build_table) into `prefix`; returns the total.
template <class Count>
__device__ int scan_items(Table t, int* prefix, const Count& count) {
  constexpr int kPer = kMaxSegments / kThreads;
  const int tid = threadIdx.x;
  const int per = ceil_div(t.cap, kThreads);
  int cnt[kPer];
  int local = 0;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int i = tid * per + e;
    cnt[e] = (e < per && i < t.cap && t.n[i] > 0) ? count(t.n[i], t.rk[i]) : 0;
    local += cnt[e];
  }
  return write_prefix(t, prefix, cnt, local);
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kShrinkMinBlocks) sgmv_fused_kernel(const __grid_constant__ FusedParams p) {
  pdl_launch_dependents();
  extern __shared__ __align__(128) unsigned char smem[];
  const Table t = carve_table(reinterpret_cast<int*>(smem), p.s.seg.capacity);
  int* eprefix = reinterpret_cast<int*>(smem) + p.eprefix_offset;
  const int ns = build_table(p.s.seg, p.s.rank_cap, t,
                             ShrinkCount<false>{p.s.mma_min_rows, p.s.decode_ranks, p.s.row_items});
  const ExpandCount<false> ecount{p.e.mma_min_rows, {p.e.out_features[0], p.e.out_features[1], p.e.out_features[2]}};
  const int ne = scan_items(t, eprefix, ecount);
  float* red = reinterpret_cast<float*>(smem + p.s.work_offset);
  bool waited = false;

  for (int item = blockIdx.x; item < ns + ne; item += gridDim.x) {
    if (item < ns) {
      const int i = find_segment(t.prefix, t.cap, item);
      const int local = item - t.prefix[i];
      const int lo = t.lo[i], n = t.n[i], slot = t.slot[i], packed = t.rk[i];
      shrink_cc_item<T>(p.s, lo, n, slot, packed, local, red, waited);
      // shrink_cc ends with a block barrier after every v store of the item: publish it.
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(p.done_shrink + i, 1);
      }
    } else {
      const int e = item - ns;
      const int i = find_segment(eprefix, t.cap, e);
      const int local = e - eprefix[i];
      const int lo = t.lo[i], n = t.n[i], slot = t.slot[i], packed = t.rk[i];
      int vecs = 0;
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) vecs += rank_of(packed, g) > 0 ? p.e.out_features[g] >> 3 : 0;
      const int nq = ceil_div(vecs, kExpandVecs);
      const int c = local / nq, q = local - c * nq;
      const int need = t.prefix[i + 1] - t.prefix[i];
      // B (never written by any kernel of the step) is requested first; then this waits for the
      // preceding kernel (y) and for the segment's shrink items (v).
      const auto ready = [&]() {
        PdlReady{waited}();  // block-uniform (a block may have had no shrink item)
        if (threadIdx.x == 0) {
          while (load_acquire(p.done_shrink + i) < need) __nanosleep(32);
          __threadfence();
        }
        __syncthreads();
      };
      expand_cc<T, true>(p.e, lo + c * kExpandRows, min(kExpandRows, n - c * kExpandRows), slot, packed, q, ready);
      __syncthreads();  // every thread of the block is past its v reads
      if (threadIdx.x == 0) {
        const int items = eprefix[i + 1] - eprefix[i];
        if (atomicAdd(p.done_expand + i, 1) == items - 1) {  // the segment's last expand item
          p.done_shrink[i] = 0;
          p.done_expand[i] = 0;
        }
      }
    }
  }
  if (!waited) pdl_wait();
}

// ---------------------------------------------------------------------------------------------------
// Host side.

}  // namespace

const char* device_info(int device, DeviceInfo* info) {
  static std::mutex mu;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it == cache.end()) {
    DeviceInfo d;
    cudaError_t e = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (e != cudaSuccess) return cudaGetErrorString(e);
    it = cache.emplace(device, d).first;
  }
  *info = it->second;
  return nullptr;
}

namespace {

// Resident blocks per SM for `kernel` with `smem` bytes of dynamic shared memory (raises the kernel's
// dynamic shared-memory limit first when needed; never lowers it, since launches with a larger size
// seen earlier must keep working). Cached: host-only calls, safe during capture.
template <typename Kernel>
const char* blocks_per_sm(Kernel kernel, int device, int smem, int* out) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  static std::map<std::pair<const void*, int>, int> limit;  // dynamic smem limit set per (kernel, device)
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, smem);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int& lim = limit[std::make_pair(reinterpret_cast<const void*>(kernel), device)];
    if (smem > 48 * 1024 && smem > lim) {
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return cudaGetErrorString(e);
      lim = smem;
    }
    int n = 0;
    cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem);
    if (e != cudaSuccess) return cudaGetErrorString(e);
    it = cache.emplace(key, n > 0 ? n : 1).first;
  }
  *out = it->second;
  return nullptr;
}

// Grid: one block per possible work item, at most `max_per_sm` resident blocks per SM.
template <typename Kernel, typename Params>
const char* launch(Kernel kernel, const Params& params, int max_items, int max_per_sm, int smem,
                   const LaunchOptions& opt, int device, cudaStream_t stream) {
  DeviceInfo info;
  if (const char* err = device_info(device, &info)) return err;
  int per_sm = 1;
  if (const char* err = blocks_per_sm(kernel, device, smem, &per_sm)) return err;
  int blocks = std::min(max_items, info.sms * std::min(per_sm, max_per_sm));
  if (opt.max_blocks > 0) blocks = std::min(blocks, opt.max_blocks);
  blocks = std::max(1, blocks);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  set_pdl(cfg, attr, opt.pdl, info.major);
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, params);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// Restores the calling thread's current device on scope exit.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != device) {
      ok_ = cudaSetDevice(device) == cudaSuccess;
      switched_ = true;
    }
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(prev_);
  }
  bool ok() const { return ok_; }

 private:
  int prev_ = -1;
  bool switched_ = false;
  bool ok_ = true;
};

const char* check_segments(const SegmentArgs& s) {
  if (s.num_groups < 1 || s.num_groups > kMaxGroup) return "sgmv: number of projections must be 1, 2 or 3";
  if (s.capacity < 1 || s.capacity > kMaxSegments) return "sgmv: segment capacity must be in [1, 1024]";
  if (s.num_slots < 1) return "sgmv: the adapter pool has no slots";
  if (s.num_rows < 0) return "sgmv: negative number of rows";
  if (!s.indptr || !s.slots || !s.ranks) return "sgmv: null segment or rank table";
  return nullptr;
}

// Rank rows per CUDA-core shrink item of one-row segments for these options (`fallback` when unset);
// 0 if invalid.
int decode_ranks_of(const LaunchOptions& opt, int fallback = kShrinkRanks1) {
  switch (opt.decode_ranks) {
    case 0:
      return fallback;
    case 1:
    case 2:
    case 4:
      return opt.decode_ranks;
    default:
      return 0;
  }
}

// The launcher's per-SM grid bound, or options.blocks_per_sm when set.
int per_sm_cap(const LaunchOptions& opt, int fallback) { return opt.blocks_per_sm > 0 ? opt.blocks_per_sm : fallback; }

int rank_pad_of(const int (&cap)[kMaxGroup], int groups) {
  int m = 1;
  for (int g = 0; g < groups; ++g) m = std::max(m, cap[g]);
  return (m + 15) / 16 * 16;
}

// Upper bound on the rows chunks any table of this (T, capacity) can produce with `rows` per chunk.
int row_chunks_bound(const SegmentArgs& s, int rows) {
  return ceil_div(s.num_rows, rows) + std::min(s.capacity, s.num_rows);
}

// `norm` (sgmv_norm_shrink): the norm's launch, CUDA-core items only, x = norm->x_out.
template <typename T>
const char* shrink_typed(const ShrinkArgs& args, const LaunchOptions& opt, int device, cudaStream_t stream,
                         const NormArgs* norm = nullptr) {
  ShrinkParams p = {};
  p.seg = args.seg;
  p.x = norm != nullptr ? norm->x_out : args.x;
  p.in_features = args.in_features;
  p.v = args.v;
  p.v_rank_dim = args.v_rank_dim;
  p.v_row_stride = args.seg.num_groups * args.v_rank_dim;
  p.mma_min_rows = std::max(1, opt.mma_min_rows);
  p.decode_ranks = decode_ranks_of(opt);  // checked by sgmv_shrink
  p.x_ready = opt.x_ready && norm == nullptr;
  p.row_items = opt.row_items && norm == nullptr;
  p.quant_out = norm != nullptr ? nullptr : args.quant_out;
  p.quant_scale = p.quant_out != nullptr ? args.quant_scale : nullptr;
  if (p.quant_out != nullptr && args.quant_scale == nullptr) return "sgmv_shrink: quant_out without quant_scale";
  if (norm != nullptr) p.norm = *norm;
  int rank_sum = 0;
  for (int g = 0; g < kMaxGroup; ++g) {
    const bool used = g < args.seg.num_groups;
    p.a[g] = used ? args.a[g] : args.a[0];
    p.a_rank_dim[g] = used ? args.a_rank_dim[g] : 0;
    p.rank_cap[g] = used ? std::min(args.a_rank_dim[g], kMaxRank) : 0;
    if (used && (args.a[g] == nullptr || args.a_rank_dim[g] < 1 || args.a_rank_dim[g] > args.v_rank_dim))
      return "sgmv_shrink: every A pool needs a rank dimension in [1, v.size(2)]";
    rank_sum += p.rank_cap[g];
  }
  p.rank_pad = rank_pad_of(p.rank_cap, args.seg.num_groups);
  p.work_offset = table_ints(args.seg.capacity) * 4;
  const int cc_work = kShrinkRows * kShrinkRanksLong * kThreads * 4;
  // Tensor-core items: per warp two stages of 16 x rows + rank_pad A rows (the fp32 partials reuse them).
  const int mma_work = std::max(cc_work, kWarps * 2 * (kShrinkTileM + p.rank_pad) * kLdsS * 2);
  DeviceInfo info;
  if (const char* err = device_info(device, &info)) return err;
  // A device whose blocks cannot hold the stages (large ranks before sm_90) runs every segment on the
  // CUDA-core path, which is exact too.
  // (kQuantRowSmem: the static shared memory of the rows' quantization, which both variants carry)
  const bool mma = norm == nullptr && args.seg.num_rows >= p.mma_min_rows &&
                   p.work_offset + mma_work + kQuantRowSmem <= info.smem_optin;
  if (!mma) p.mma_min_rows = 1 << 30;
  // The tensor-core capable variant holds 2 blocks per SM: there its decode rows keep the 1 x 4 items
  // (with 1 x 2 items a lone call with 64 or 256 distinct rows took 10.3 / 38.2 us against 9.0 / 32.3).
  if (mma) p.decode_ranks = decode_ranks_of(opt, kShrinkRanksMma1);
  const int smem = p.work_offset + (mma ? mma_work : cc_work);
  // fewest rank rows per CUDA-core item: kShrinkRanksN (two-row chunks), or decode_ranks (one-row segments)
  int64_t items = static_cast<int64_t>(row_chunks_bound(args.seg, p.row_items ? 1 : kShrinkRows)) *
                  ceil_div(rank_sum, std::min(kShrinkRanksN, p.decode_ranks));
  if (mma) items += static_cast<int64_t>(row_chunks_bound(args.seg, kShrinkTileM)) * args.seg.num_groups;
  if (norm != nullptr) items = std::max<int64_t>(items, norm->rows);  // every row's norm, whatever the adapters
  const int max_items = static_cast<int>(std::min<int64_t>(items, 1 << 30));
  const int per_sm = per_sm_cap(opt, kShrinkBlocksPerSm);
  if (norm != nullptr) return launch(sgmv_shrink_kernel<T, false, true>, p, max_items, per_sm, smem, opt, device, stream);
  return mma ? launch(sgmv_shrink_kernel<T, true>, p, max_items, per_sm, smem, opt, device, stream)
             : launch(sgmv_shrink_kernel<T, false>, p, max_items, per_sm, smem, opt, device, stream);
}

template <typename T>
const char* norm_typed(const NormArgs& n, bool pdl, int max_blocks, int device, cudaStream_t stream) {
  DeviceInfo info;
  if (const char* err = device_info(device, &info)) return err;
  // a lane's vectors in the slice order (slice_of): the register-resident launch where they fit (and the e4m3 rows,
  // if any, take its 8-byte stores; quantize_row falls back to byte stores elsewhere)
  const int lane_vecs = ceil_div(ceil_div(n.cols / 8, kSlices), 32);
  const bool regs = lane_vecs <= kNormRegMaxVecs && reinterpret_cast<uintptr_t>(n.quant_out) % 8 == 0;
  int blocks = std::min(n.rows, info.sms * (regs ? kNormRegBlocksPerSm : kNormBlocksPerSm));
  if (max_blocks > 0) blocks = std::min(blocks, max_blocks);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(std::max(1, blocks));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  set_pdl(cfg, attr, pdl, info.major);
  const cudaError_t e = !regs            ? cudaLaunchKernelEx(&cfg, rms_norm_rows_kernel<T>, n)
                        : lane_vecs <= 2 ? cudaLaunchKernelEx(&cfg, rms_norm_rows_regs_kernel<T, 2>, n)
                                         : cudaLaunchKernelEx(&cfg, rms_norm_rows_regs_kernel<T, kNormRegMaxVecs>, n);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

const char* check_norm(const NormArgs& n) {
  if (n.rows < 0 || n.cols < 8 || n.cols % 8 != 0) return "rms_norm: the rows' width must be a positive multiple of 8";
  if (n.h == nullptr || n.w == nullptr || n.x_out == nullptr) return "rms_norm: null h, w or x_out";
  if ((n.res == nullptr) != (n.res_out == nullptr)) return "rms_norm: res and res_out go together";
  if ((n.quant_out == nullptr) != (n.quant_scale == nullptr)) return "rms_norm: quant_out and quant_scale go together";
  return nullptr;
}

template <typename T>
const char* expand_typed(const ExpandArgs& args, const LaunchOptions& opt, int device, cudaStream_t stream) {
  ExpandParams p = {};
  p.seg = args.seg;
  p.v = args.v;
  p.v_rank_dim = args.v_rank_dim;
  p.v_row_stride = args.seg.num_groups * args.v_rank_dim;
  p.mma_min_rows = std::max(1, opt.mma_min_rows);
  p.write_f32 = args.write_f32 ? 1 : 0;
  int vecs = 0, tiles = 0;
  for (int g = 0; g < kMaxGroup; ++g) {
    const bool used = g < args.seg.num_groups;
    p.b[g] = used ? args.b[g] : args.b[0];
    p.b_rank_dim[g] = used ? args.b_rank_dim[g] : 0;
    p.rank_cap[g] = used ? std::min(args.b_rank_dim[g], kMaxRank) : 0;
    p.y[g] = used ? args.y[g] : args.y[0];
    p.y_row_stride[g] = used ? args.y_row_stride[g] : 0;
    p.out_features[g] = used ? args.out_features[g] : 0;
    if (used) {
      if (args.b[g] == nullptr || args.y[g] == nullptr || args.b_rank_dim[g] < 1 ||
          args.b_rank_dim[g] > args.v_rank_dim)
        return "sgmv_expand: every B pool needs a rank dimension in [1, v.size(2)]";
      if (args.out_features[g] < 8 || args.out_features[g] % 8 != 0 || args.y_row_stride[g] % 8 != 0)
        return "sgmv_expand: output widths and row strides must be multiples of 8";
      vecs += args.out_features[g] / 8;
      tiles += ceil_div(args.out_features[g], kTileN);
    }
  }
  p.rank_pad = rank_pad_of(p.rank_cap, args.seg.num_groups);
  const bool mma = args.seg.num_rows >= p.mma_min_rows;
  p.work_offset = table_ints(args.seg.capacity) * 4;
  int work = 128;
  if (mma) {
    work = std::max(work, kTileM * (p.rank_pad + 8) * 2 + p.rank_pad * kLds * 2);
    work = std::max(work, kTileM * kLdc * 4);
  }
  const int smem = p.work_offset + work;
  int64_t items = static_cast<int64_t>(row_chunks_bound(args.seg, kExpandRows)) * ceil_div(vecs, kExpandVecs);
  if (mma) items += static_cast<int64_t>(row_chunks_bound(args.seg, kTileM)) * tiles;
  const int max_items = static_cast<int>(std::min<int64_t>(items, 1 << 30));
  const int per_sm = per_sm_cap(opt, kThreads);  // default: the occupancy only
  return mma ? launch(sgmv_expand_kernel<T, true>, p, max_items, per_sm, smem, opt, device, stream)
             : launch(sgmv_expand_kernel<T, false>, p, max_items, per_sm, smem, opt, device, stream);
}


template <typename T>
const char* fused_typed(const ShrinkArgs& sa, const ExpandArgs& ea, int* counters, const LaunchOptions& opt,
                        int device, cudaStream_t stream) {
  if (ea.write_f32) return "sgmv_fused: the fused launch adds the add-on to y (write_f32 is sgmv_expand's)";
  FusedParams p = {};
  ShrinkParams& s = p.s;
  ExpandParams& e = p.e;
  s.seg = sa.seg;
  e.seg = ea.seg;
  s.x = sa.x;
  s.in_features = sa.in_features;
  s.v = sa.v;
  e.v = sa.v;
  s.v_rank_dim = e.v_rank_dim = sa.v_rank_dim;
  s.v_row_stride = e.v_row_stride = sa.seg.num_groups * sa.v_rank_dim;
  s.mma_min_rows = e.mma_min_rows = 1 << 30;  // CUDA-core items only
  s.decode_ranks = decode_ranks_of(opt, kShrinkRanksMma1);  // checked by sgmv_fused; 1 x 4 as before (see below)
  s.row_items = 0;  // (LaunchOptions::row_items is the shrink launch's: the expand items count on these shapes)
  int rank_sum = 0, vecs = 0;
  for (int g = 0; g < kMaxGroup; ++g) {
    const bool used = g < sa.seg.num_groups;
    if (used && (sa.a[g] == nullptr || ea.b[g] == nullptr || ea.y[g] == nullptr || sa.a_rank_dim[g] < 1 ||
                 sa.a_rank_dim[g] > sa.v_rank_dim || ea.b_rank_dim[g] < 1 || ea.b_rank_dim[g] > sa.v_rank_dim))
      return "sgmv_fused: every A and B pool needs a rank dimension in [1, v.size(2)]";
    if (used && (ea.out_features[g] < 8 || ea.out_features[g] % 8 != 0 || ea.y_row_stride[g] % 8 != 0))
      return "sgmv_fused: output widths and row strides must be multiples of 8";
    // one rank cap for both halves: shrink and expand see the same items of every segment
    const int cap = used ? std::min(std::min(sa.a_rank_dim[g], ea.b_rank_dim[g]), kMaxRank) : 0;
    s.a[g] = used ? sa.a[g] : sa.a[0];
    s.a_rank_dim[g] = used ? sa.a_rank_dim[g] : 0;
    s.rank_cap[g] = e.rank_cap[g] = cap;
    e.b[g] = used ? ea.b[g] : ea.b[0];
    e.b_rank_dim[g] = used ? ea.b_rank_dim[g] : 0;
    e.y[g] = used ? ea.y[g] : ea.y[0];
    e.y_row_stride[g] = used ? ea.y_row_stride[g] : 0;
    e.out_features[g] = used ? ea.out_features[g] : 0;
    rank_sum += cap;
    vecs += used ? ea.out_features[g] / 8 : 0;
  }
  s.rank_pad = e.rank_pad = rank_pad_of(s.rank_cap, sa.seg.num_groups);
  const int cap = sa.seg.capacity;
  p.eprefix_offset = table_ints(cap);
  const int eprefix_ints = (cap + 1 + 31) / 32 * 32;
  s.work_offset = e.work_offset = (table_ints(cap) + eprefix_ints) * 4;
  p.done_shrink = counters;
  p.done_expand = counters + cap;
  const int smem = s.work_offset + kShrinkRows * kShrinkRanksLong * kThreads * 4;
  const int64_t items =
      static_cast<int64_t>(row_chunks_bound(sa.seg, kShrinkRows)) *
          ceil_div(rank_sum, std::min(kShrinkRanksN, s.decode_ranks)) +
      static_cast<int64_t>(row_chunks_bound(sa.seg, kExpandRows)) * ceil_div(vecs, kExpandVecs);
  const int max_items = static_cast<int>(std::min<int64_t>(items, 1 << 30));
  // No per-SM cap below the occupancy unless blocks_per_sm asks for one: launch() takes
  // min(occupancy, cap) per SM, so the grid is at most what is resident at once (see the kernel).
  return launch(sgmv_fused_kernel<T>, p, max_items, per_sm_cap(opt, kThreads), smem, opt, device, stream);
}

}  // namespace

const char* sgmv_shrink(DType dtype, const ShrinkArgs& args, const LaunchOptions& options, int device, void* stream) {
  if (const char* err = check_segments(args.seg)) return err;
  if (args.in_features < 8 || args.in_features % 8 != 0) return "sgmv_shrink: in_features must be a multiple of 8";
  if (args.x == nullptr || args.v == nullptr) return "sgmv_shrink: null x or v";
  if (decode_ranks_of(options) == 0) return "sgmv: decode_ranks must be 0, 1, 2 or 4";
  if (args.seg.num_rows == 0) return nullptr;
  DeviceScope scope(device);
  if (!scope.ok()) return "sgmv_shrink: cannot select the tensors' CUDA device";
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dtype == DType::kBFloat16 ? shrink_typed<__nv_bfloat16>(args, options, device, s)
                                   : shrink_typed<__half>(args, options, device, s);
}

const char* rms_norm_rows(DType dtype, const NormArgs& args, bool pdl, int max_blocks, int device, void* stream) {
  if (const char* err = check_norm(args)) return err;
  if (args.rows == 0) return nullptr;
  DeviceScope scope(device);
  if (!scope.ok()) return "rms_norm: cannot select the tensors' CUDA device";
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dtype == DType::kBFloat16 ? norm_typed<__nv_bfloat16>(args, pdl, max_blocks, device, s)
                                   : norm_typed<__half>(args, pdl, max_blocks, device, s);
}

const char* sgmv_norm_shrink(DType dtype, const NormArgs& norm, const ShrinkArgs& args, const LaunchOptions& options,
                             int device, void* stream) {
  if (const char* err = check_norm(norm)) return err;
  if (const char* err = check_segments(args.seg)) return err;
  if (norm.cols != args.in_features || norm.rows != args.seg.num_rows)
    return "sgmv_norm_shrink: the norm's rows and the shrink's input differ in shape";
  if (args.v == nullptr) return "sgmv_norm_shrink: null v";
  if (decode_ranks_of(options) == 0) return "sgmv: decode_ranks must be 0, 1, 2 or 4";
  if (norm.rows == 0) return nullptr;
  DeviceScope scope(device);
  if (!scope.ok()) return "sgmv_norm_shrink: cannot select the tensors' CUDA device";
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dtype == DType::kBFloat16 ? shrink_typed<__nv_bfloat16>(args, options, device, s, &norm)
                                   : shrink_typed<__half>(args, options, device, s, &norm);
}

const char* sgmv_expand(DType dtype, const ExpandArgs& args, const LaunchOptions& options, int device, void* stream) {
  if (const char* err = check_segments(args.seg)) return err;
  if (args.v == nullptr) return "sgmv_expand: null v";
  if (args.seg.num_rows == 0) return nullptr;
  DeviceScope scope(device);
  if (!scope.ok()) return "sgmv_expand: cannot select the tensors' CUDA device";
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dtype == DType::kBFloat16 ? expand_typed<__nv_bfloat16>(args, options, device, s)
                                   : expand_typed<__half>(args, options, device, s);
}

const char* sgmv_fused(DType dtype, const ShrinkArgs& sargs, const ExpandArgs& eargs, int* counters,
                       const LaunchOptions& options, int device, void* stream) {
  if (const char* err = check_segments(sargs.seg)) return err;
  if (sargs.seg.capacity != eargs.seg.capacity || sargs.seg.num_rows != eargs.seg.num_rows ||
      sargs.seg.num_groups != eargs.seg.num_groups || sargs.v != eargs.v || sargs.v_rank_dim != eargs.v_rank_dim)
    return "sgmv_fused: shrink and expand must share the segment table, T, G and v";
  if (sargs.in_features < 8 || sargs.in_features % 8 != 0) return "sgmv_fused: in_features must be a multiple of 8";
  if (sargs.x == nullptr || sargs.v == nullptr) return "sgmv_fused: null x or v";
  if (decode_ranks_of(options) == 0) return "sgmv: decode_ranks must be 0, 1, 2 or 4";
  if (sargs.seg.num_rows == 0) return nullptr;
  if (counters == nullptr) return "sgmv_fused: null counters";
  DeviceScope scope(device);
  if (!scope.ok()) return "sgmv_fused: cannot select the tensors' CUDA device";
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dtype == DType::kBFloat16 ? fused_typed<__nv_bfloat16>(sargs, eargs, counters, options, device, s)
                                   : fused_typed<__half>(sargs, eargs, counters, options, device, s);
}

}  // namespace lorafleet
