// decode_attention (see decode_attn.h). The CUDA-core kernel (decode_attention_kernel; the tensor-core kernel for e4m3
// pages, decode_attention_mma_kernel, is described where it begins): one CTA of 4 warps per (request, K/V head,
// worker). A lane holds DPL
// dimensions of a token's K/V row (one 4- to 16-byte load each), LPT = D / DPL lanes make a token, a warp takes
// TPW = 32 / LPT tokens per load and kUnroll such loads at once, so every lane has 2 kUnroll loads in flight
// (the next pass's, during this pass's math; their page ids were loaded a pass earlier still; the stream of passes
// runs on across the CTA's chunks). The lane keeps the G query heads' DPL dims of q and of the output in fp32
// registers; DPL is chosen so that G * DPL <= 32 where the head allows (the wider 16-byte loads where G is small).
//
// kStages (DecodeAttnArgs::stages; one query head per K/V head): the lane's K/V rows of the next kStages - 1 passes
// are in flight at once, copied by cp.async into the lane's own slots of a ring in shared memory (kStages passes of
// 2 kUnroll loads per thread) instead of into registers one pass ahead, so that the bytes in flight per SM are not
// bounded by registers. Each lane copies exactly the bytes it later reads, so no barrier orders the ring; the math,
// and so every bit, is the register version's.
//
// DecodeAttnArgs::pdl (a programmatic dependent launch; with stages only, so that the register version keeps the
// instruction stream and the plain launch it was measured with: q read first, no grid-dependency instruction): a CTA
// reads its request's page table (written before the step's first kernel) and the page ids of its first passes
// before it waits for the kernel before it (rope_kv, which writes q and the newest K/V row and lets this kernel start
// early), q and every K/V row only after; it lets the next kernel start once its chunks are done (that kernel waits
// for this one's end before it reads the output).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <type_traits>
#include <utility>

#include "decode_attn.h"
#include "half_pair.cuh"
#include "pdl.h"

namespace lorafleet {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 2;  // loads per lane of K (and of V) in flight
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

// Dims per lane for head size D, group bucket G and K/V element bytes: at most 16 bytes per load, G * DPL <= 32
// where that still leaves at most 32 lanes per token.
template <int D, int G, int KVB>
struct Shape {
  static constexpr int kByBytes = 16 / KVB;
  static constexpr int kByRegs = 32 / G;
  static constexpr int kNarrow = kByBytes < kByRegs ? kByBytes : kByRegs;
  static constexpr int DPL = kNarrow < D / 32 ? D / 32 : kNarrow;
  static constexpr int LPT = D / DPL;
  static constexpr int TPW = 32 / LPT;
  static constexpr int BYTES = DPL * KVB;
  static_assert(LPT >= 1 && LPT <= 32 && 32 % LPT == 0 && DPL % 2 == 0, "decode_attention: bad lane shape");
};

template <int N>
struct Raw;
template <>
struct Raw<16> {
  using V = uint4;
};
template <>
struct Raw<8> {
  using V = uint2;
};
template <>
struct Raw<4> {
  using V = uint32_t;
};

// cp.async of N bytes (4, 8 or 16) into shared memory, zeros where !ok (nothing is read then); the groups of them.
template <int N>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool ok) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = ok ? N : 0;
  if constexpr (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(gmem), "n"(N), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// until at most N of this thread's groups are pending
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// fp32 of e4m3 byte 3 - I of w, exactly: its sign, exponent and mantissa bits placed as an fp32's (sign, the low 4
// exponent bits, the top 3 mantissa bits; a code with exponent 0 becomes an fp32 subnormal of the same fraction), then
// times 2^120 (the two formats' exponent biases apart; a product of a power of two, exact, subnormals kept: no ftz).
// The two NaN codes read as -+480.
template <int I>
__device__ __forceinline__ float e4m3_byte_to_float(uint32_t w) {
  const uint32_t x = w << (8 * I);  // the byte at bits 24-31
  const uint32_t bits = (x & 0x80000000u) | ((x >> 4) & 0x07f00000u);
  float f;
  asm("mul.rn.f32 %0, %1, 0f7B800000;" : "=f"(f) : "f"(__uint_as_float(bits)));  // 0f7B800000 = 2^120
  return f;
}

// DPL values of one load in fp32: e4m3 pairs through the exact fp16 conversion (kIntCvt: by integer ops,
// e4m3_byte_to_float, the same values), or T pairs.
template <typename T, bool KV8, int DPL, bool kIntCvt = false, typename L>
__device__ __forceinline__ void unpack(const L& raw, float f[DPL]) {
  if constexpr (KV8 && kIntCvt) {
    static_assert(DPL % 4 == 0, "decode_attention: the integer conversion takes whole 32-bit words");
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw);
#pragma unroll
    for (int e = 0; e < DPL / 4; ++e) {  // little-endian: byte 0 of w[e] is element 4e
      f[4 * e] = e4m3_byte_to_float<3>(w[e]);
      f[4 * e + 1] = e4m3_byte_to_float<2>(w[e]);
      f[4 * e + 2] = e4m3_byte_to_float<1>(w[e]);
      f[4 * e + 3] = e4m3_byte_to_float<0>(w[e]);
    }
  } else if constexpr (KV8) {
    const __nv_fp8x2_storage_t* p = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
#pragma unroll
    for (int e = 0; e < DPL / 2; ++e) {
      const float2 t = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(p[e], __NV_E4M3)));
      f[2 * e] = t.x;
      f[2 * e + 1] = t.y;
    }
  } else {
    const typename Pair<T>::V* p = reinterpret_cast<const typename Pair<T>::V*>(&raw);
#pragma unroll
    for (int e = 0; e < DPL / 2; ++e) {
      const float2 t = Pair<T>::get(p[e]);
      f[2 * e] = t.x;
      f[2 * e + 1] = t.y;
    }
  }
}

// (m, l, acc) <- the merge of itself with (mo, lo, ao): m the running max of log2-scaled scores, l the sum of
// exp2(s - m), acc the sum of exp2(s - m) v. Two empty states (m = -inf) stay empty.
template <int DPL>
__device__ __forceinline__ void merge_state(float& m, float& l, float acc[DPL], float mo, float lo,
                                            const float ao[DPL]) {
  const float mx = fmaxf(m, mo);
  if (mx == -INFINITY) return;
  const float ca = exp2f(m - mx), cb = exp2f(mo - mx);
  l = l * ca + lo * cb;
#pragma unroll
  for (int i = 0; i < DPL; ++i) acc[i] = acc[i] * ca + ao[i] * cb;
  m = mx;
}

// tanh to a few ulp without a slow-path call (CUDA's tanhf divides with one, which spills here): expm1 of 2|x| (|x|
// clamped to 10, where tanh is 1 in fp32) over itself plus 2.
__device__ __forceinline__ float tanh_fast(float x) {
  const float e = expm1f(2.f * fminf(fabsf(x), 10.f));
  return copysignf(__fdividef(e, e + 2.f), x);
}

// The keys of request b (see decode_attn.h): [start, kv_len), cut into nchunks chunks of `chunk` tokens (more when
// n_b would need more than max_chunks). p0 / np: its entries of `indices`.
struct KeyCut {
  int p0, np, kv_len, start, n, chunk, nchunks;
};
__device__ __forceinline__ KeyCut cut_keys(const DecodeAttnArgs& p, int b) {
  KeyCut k;
  k.p0 = p.indptr[b];
  k.np = p.indptr[b + 1] - k.p0;
  const int last_len = min(max(p.last_page_len[b], 1), p.page_size);
  k.kv_len = k.np > 0 ? (k.np - 1) * p.page_size + last_len : 0;
  k.start = p.window_left >= 0 && k.kv_len - 1 - p.window_left > 0 ? k.kv_len - 1 - p.window_left : 0;
  k.n = k.kv_len - k.start;
  k.chunk = p.chunk;
  k.nchunks = (k.n + k.chunk - 1) / k.chunk;
  if (k.nchunks > p.max_chunks) {
    k.chunk = ((k.n + p.max_chunks - 1) / p.max_chunks + 15) & ~15;
    k.nchunks = (k.n + k.chunk - 1) / k.chunk;
  }
  return k;
}

// A warp's passes over its chunks c = worker, worker + workers, ... as one stream: a pass is (chunk, first token),
// the next is `pass` tokens on in the same chunk, else the warp's first token (`lead` into a chunk) in its next
// chunk that has any. Loads run ahead along the stream across chunk ends, so a chunk's first pass is in flight
// during the previous chunk's last one (and its merge).
struct PassStream {
  KeyCut k;
  int workers, lead, pass;
  __device__ __forceinline__ int end(int c) const { return min(k.start + (c + 1) * k.chunk, k.kv_len); }
  // (c, base) <- the pass after it; c = nchunks where the stream ends
  __device__ __forceinline__ void advance(int& c, int& base) const {
    base += pass;
    if (base < end(c)) return;
    for (c += workers; c < k.nchunks; c += workers) {
      base = k.start + c * k.chunk + lead;
      if (base < end(c)) return;
    }
    c = k.nchunks;
  }
  // (c, base) <- the stream's first pass from chunk `worker` on
  __device__ __forceinline__ void first(int worker, int& c, int& base) const {
    c = worker;
    base = k.start + worker * k.chunk + lead;
    if (base >= end(c)) {
      base -= pass;
      advance(c, base);
    }
  }
};

// A chunk's end, every warp's (m, l, acc) of the group's g heads in shared memory: the warps merged in order, then
// the output written (a request of one chunk) or the chunk's partial; the shared state is free again after it.
// (DS > D: a row of sm_acc padded by one float per 16, dim d at d + d / 16, against bank conflicts in its writes)
template <typename T, int G, int D, int DS = D>
__device__ __forceinline__ void finish_chunk(const DecodeAttnArgs& p, const float (&sm_acc)[kWarps][G][DS],
                                             const float (&sm_m)[kWarps][G], const float (&sm_l)[kWarps][G], int g,
                                             int b, int head0, int c, int nchunks, T* out) {
  __syncthreads();
  for (int e = threadIdx.x; e < g * D; e += kThreads) {
    const int j = e / D, d = e - j * D;
    float mx = sm_m[0][j];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w][j]);
    float sum = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (sm_m[w][j] == -INFINITY) continue;
      const float cw = exp2f(sm_m[w][j] - mx);
      sum = fmaf(sm_l[w][j], cw, sum);
      a = fmaf(sm_acc[w][j][DS == D ? d : d + (d >> 4)], cw, a);
    }
    if (nchunks == 1) {
      out[e] = Pair<T>::round(__fdividef(a, sum));  // sum is in [1, n]: the fast division is exact to 2 ulp
    } else {
      const int64_t pi = (static_cast<int64_t>(b) * p.num_heads + head0 + j) * p.max_chunks + c;
      p.partial_o[pi * D + d] = a;
      if (d == 0) {
        p.partial_ml[2 * pi] = mx;
        p.partial_ml[2 * pi + 1] = sum;
      }
    }
  }
  __syncthreads();  // the shared state is the next chunk's
}

// After a CTA's last chunk of a request with nchunks > 1 (`done` of them by this CTA): the CTA that completes the
// request's last chunk merges the partials in chunk order.
template <typename T, int D>
__device__ __forceinline__ void merge_partials(const DecodeAttnArgs& p, int b, int kvh, int head0, int g,
                                               int nchunks, int done, T* out, int& sm_last) {
  const int tid = threadIdx.x;
  __threadfence();
  __syncthreads();
  int32_t* counter = p.counters + static_cast<int64_t>(b) * p.num_kv_heads + kvh;
  if (tid == 0) sm_last = atomicAdd(counter, done) + done == nchunks;
  __syncthreads();
  if (!sm_last) return;
  __threadfence();
  for (int e = tid; e < g * D; e += kThreads) {
    const int j = e / D, d = e - j * D;
    const int64_t pi0 = (static_cast<int64_t>(b) * p.num_heads + head0 + j) * p.max_chunks;
    float mx = -INFINITY;
    for (int c = 0; c < nchunks; ++c) mx = fmaxf(mx, __ldcg(p.partial_ml + 2 * (pi0 + c)));
    float sum = 0.f, a = 0.f;
    for (int c = 0; c < nchunks; ++c) {
      const float cw = exp2f(__ldcg(p.partial_ml + 2 * (pi0 + c)) - mx);
      sum = fmaf(__ldcg(p.partial_ml + 2 * (pi0 + c) + 1), cw, sum);
      a = fmaf(__ldcg(p.partial_o + (pi0 + c) * D + d), cw, a);
    }
    out[e] = Pair<T>::round(__fdividef(a, sum));  // sum is in [1, n]: the fast division is exact to 2 ulp
  }
  if (tid == 0) *counter = 0;
}

template <typename T, bool KV8, int D, int G, int kStages, bool kIntCvt = false>
__global__ void __launch_bounds__(kThreads, kStages > 0 ? 4 : 2) decode_attention_kernel(const DecodeAttnArgs p) {
  using S = Shape<D, G, KV8 ? 1 : 2>;
  constexpr int DPL = S::DPL, LPT = S::LPT, TPW = S::TPW;
  constexpr bool kStaged = kStages > 0;
  using KvT = std::conditional_t<KV8, uint8_t, T>;
  using Ld = typename Raw<S::BYTES>::V;
  using V2 = typename Pair<T>::V;
  __shared__ float sm_acc[kWarps][G][D];
  __shared__ float sm_m[kWarps][G], sm_l[kWarps][G];
  __shared__ int sm_last;
  // the cp.async ring (kStaged): stage, K or V, load u, thread (consecutive threads' slots side by side)
  __shared__ __align__(16) unsigned char sm_ring[kStaged ? kStages * 2 * kUnroll * kThreads * S::BYTES : 16];

  const int worker = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int g = p.num_heads / p.num_kv_heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int part = lane % LPT, slot = lane / LPT;
  const int head0 = kvh * g;

  const KeyCut cut = cut_keys(p, b);
  const int p0 = cut.p0, start = cut.start, chunk = cut.chunk, nchunks = cut.nchunks;
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.num_heads + head0) * D;
  if (cut.n <= 0) {  // no keys: zeros, from the first worker
    if constexpr (kStaged) pdl_wait();
    if (worker == 0)
      for (int e = tid; e < g * D; e += kThreads) out[e] = Pair<T>::round(0.f);
    return;
  }
  if (worker >= nchunks) return;

  // this lane's dims of the group's queries: first thing for the register version (never a programmatic launch);
  // with stages after the page ids of the first passes, behind the wait for the kernel before (rope_kv writes q)
  float q[G][DPL];
  auto load_q = [&] {
    if constexpr (kStaged) pdl_wait();
    const T* qrow = static_cast<const T*>(p.q) + (static_cast<int64_t>(b) * p.num_heads + head0) * D + part * DPL;
#pragma unroll
    for (int j = 0; j < G; ++j) {
#pragma unroll
      for (int e = 0; e < DPL / 2; ++e) {
        float2 t = make_float2(0.f, 0.f);
        if (j < g) t = Pair<T>::get(reinterpret_cast<const V2*>(qrow + j * D)[e]);
        q[j][2 * e] = t.x;
        q[j][2 * e + 1] = t.y;
      }
    }
  };
  if constexpr (!kStaged) load_q();
  const bool capped = p.soft_cap > 0.f;
  const float scale_log2 = p.sm_scale * kLog2e;
  const float cap_in = capped ? p.sm_scale / p.soft_cap : 0.f, cap_out = p.soft_cap * kLog2e;
  const int64_t tok_stride = static_cast<int64_t>(p.num_kv_heads) * D;  // elements from one slot to the next
  const KvT* kbase = static_cast<const KvT*>(p.k_cache) + static_cast<int64_t>(kvh) * D + part * DPL;
  const KvT* vbase = static_cast<const KvT*>(p.v_cache) + static_cast<int64_t>(kvh) * D + part * DPL;
  const int ps = p.page_size, ps_shift = __ffs(ps) - 1;
  const bool ps_pow2 = (ps & (ps - 1)) == 0;
  const int64_t last_page = p.num_pages - 1;

  constexpr int kPass = kWarps * TPW * kUnroll;  // tokens of one pass of the CTA
  const PassStream st{cut, p.workers, warp * TPW, kPass};
  auto chunk_end = [&](int c) { return st.end(c); };
  auto advance = [&](int& c, int& base) { st.advance(c, base); };
  // The page ids of this lane's kUnroll tokens of the pass (c, base), as stored (0 past the chunk's end or outside
  // `indices`): loaded one pass before the K/V loads that need them, so that a pass waits for one load, not for an
  // id and then the row it names.
  auto locate = [&](int c, int base, int32_t (&ids)[kUnroll]) {
    const int end = c < nchunks ? chunk_end(c) : 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = base + u * kWarps * TPW + slot;
      const int pi = ps_pow2 ? t >> ps_shift : t / ps;
      const int64_t at = static_cast<int64_t>(p0) + pi;
      ids[u] = t < end && at >= 0 && at < p.num_indices ? p.indices[at] : 0;
    }
  };
  // this lane's rows of the kUnroll tokens of the pass (c, base) (zeros past the chunk's end), from their page ids
  auto fetch = [&](int c, int base, const int32_t (&ids)[kUnroll], Ld (&kr)[kUnroll], Ld (&vr)[kUnroll],
                   bool (&valid)[kUnroll]) {
    const int end = chunk_end(c);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = base + u * kWarps * TPW + slot;
      valid[u] = t < end;
      kr[u] = Ld{};
      vr[u] = Ld{};
      if (valid[u]) {
        const int64_t pg = ids[u] < 0 ? 0 : (ids[u] > last_page ? last_page : ids[u]);
        const int64_t off = (pg * ps + (ps_pow2 ? t & (ps - 1) : t % ps)) * tok_stride;
        kr[u] = *reinterpret_cast<const Ld*>(kbase + off);
        vr[u] = *reinterpret_cast<const Ld*>(vbase + off);
      }
    }
  };
  // kStaged: this thread's slot of load u of K (kv 0) or V (kv 1) in stage s of the ring, and the copies of the
  // pass (c, base) into stage s (zeros past the chunk's end)
  auto ring = [&](int s, int kv, int u) {
    return sm_ring + ((((s * 2 + kv) * kUnroll + u) * kThreads) + tid) * S::BYTES;
  };
  auto fetch_async = [&](int s, int c, int base, const int32_t (&ids)[kUnroll]) {
    const int end = chunk_end(c);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = base + u * kWarps * TPW + slot;
      const bool ok = t < end;
      int64_t off = 0;
      if (ok) {
        const int64_t pg = ids[u] < 0 ? 0 : (ids[u] > last_page ? last_page : ids[u]);
        off = (pg * ps + (ps_pow2 ? t & (ps - 1) : t % ps)) * tok_stride;
      }
      cp_async<S::BYTES>(ring(s, 0, u), kbase + off, ok);
      cp_async<S::BYTES>(ring(s, 1, u), vbase + off, ok);
    }
  };
  Ld kr[kUnroll], vr[kUnroll], kn[kUnroll], vn[kUnroll];
  bool valid[kUnroll], vnext[kUnroll];
  int32_t ids[kUnroll];  // the page ids of the pass after the last one whose K/V loads are in flight
  // the stream's first pass (its loads into kr / vr; kStaged: the first kStages - 1 passes' copies into the ring, their
  // ids first, all at once) and the one after them (its ids), before any chunk
  int nc, nb;
  st.first(worker, nc, nb);
  int wstage = 0, rstage = 0;  // kStaged: the ring's stage copied into next, and the one read next
  if constexpr (kStaged) {
    int32_t first[kStages > 1 ? kStages - 1 : 1][kUnroll];
    int lc = nc, lb = nb;
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) {
      if (lc < nchunks) {
        locate(lc, lb, first[j]);
        advance(lc, lb);
      }
    }
    load_q();
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) {
      if (nc < nchunks) {
        fetch_async(j, nc, nb, first[j]);
        advance(nc, nb);
      }
      cp_async_commit();  // (one group per pass, empty past the stream's end)
    }
    wstage = kStages - 1;
    if (nc < nchunks) locate(nc, nb, ids);
  } else {
    if (nc < nchunks) {
      locate(nc, nb, ids);
      fetch(nc, nb, ids, kr, vr, valid);
      advance(nc, nb);
      locate(nc, nb, ids);
    }
  }

  int done = 0;
  for (int c = worker; c < nchunks; c += p.workers, ++done) {
    const int t0 = start + c * chunk, t1 = chunk_end(c);
    float m[G], l[G], acc[G][DPL];
#pragma unroll
    for (int j = 0; j < G; ++j) {
      m[j] = -INFINITY;
      l[j] = 0.f;
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[j][i] = 0.f;
    }
    for (int base = t0 + warp * TPW; base < t1; base += kPass) {
      if constexpr (kStaged) {
        // the pass kStages - 1 on into the stage this thread read last (its values are in registers by now), then
        // this pass's group landed (at most kStages - 1 pending), read from the thread's own slots
        if (nc < nchunks) {
          fetch_async(wstage, nc, nb, ids);
          advance(nc, nb);
          locate(nc, nb, ids);
        }
        cp_async_commit();
        wstage = wstage + 1 == kStages ? 0 : wstage + 1;
        cp_async_wait<kStages - 1>();
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          kr[u] = *reinterpret_cast<const Ld*>(ring(rstage, 0, u));
          vr[u] = *reinterpret_cast<const Ld*>(ring(rstage, 1, u));
          valid[u] = base + u * kWarps * TPW + slot < t1;
        }
        rstage = rstage + 1 == kStages ? 0 : rstage + 1;
      } else if (nc < nchunks) {  // the next pass's loads fly during this one's math, the ids of the one after them
        fetch(nc, nb, ids, kn, vn, vnext);
        advance(nc, nb);
        locate(nc, nb, ids);
      }
      float s[kUnroll][G];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float kf[DPL];
        unpack<T, KV8, DPL, kIntCvt>(kr[u], kf);
#pragma unroll
        for (int j = 0; j < G; ++j) {
          float d = 0.f;
#pragma unroll
          for (int i = 0; i < DPL; ++i) d = fmaf(q[j][i], kf[i], d);
#pragma unroll
          for (int off = LPT / 2; off >= 1; off >>= 1) d += __shfl_xor_sync(kFull, d, off);
          s[u][j] = !valid[u] ? -INFINITY : capped ? tanh_fast(d * cap_in) * cap_out : d * scale_log2;
        }
      }
      float vf[kUnroll][DPL];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) unpack<T, KV8, DPL, kIntCvt>(vr[u], vf[u]);
#pragma unroll
      for (int j = 0; j < G; ++j) {
        if (j >= g) continue;
        float mx = m[j];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) mx = fmaxf(mx, s[u][j]);
        if (mx == -INFINITY) continue;
        const float corr = exp2f(m[j] - mx);
        float pu[kUnroll];
        float sum = l[j] * corr;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          pu[u] = exp2f(s[u][j] - mx);
          sum += pu[u];
        }
        l[j] = sum;
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
          float a = acc[j][i] * corr;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) a = fmaf(pu[u], vf[u][i], a);
          acc[j][i] = a;
        }
        m[j] = mx;
      }
      if constexpr (!kStaged) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          kr[u] = kn[u];
          vr[u] = vn[u];
          valid[u] = vnext[u];
        }
      }
    }
    // the warp's token slots, then the warps in order
#pragma unroll
    for (int off = LPT; off < 32; off <<= 1) {
#pragma unroll
      for (int j = 0; j < G; ++j) {
        float ao[DPL];
#pragma unroll
        for (int i = 0; i < DPL; ++i) ao[i] = __shfl_xor_sync(kFull, acc[j][i], off);
        const float mo = __shfl_xor_sync(kFull, m[j], off), lo = __shfl_xor_sync(kFull, l[j], off);
        merge_state<DPL>(m[j], l[j], acc[j], mo, lo, ao);
      }
    }
    if (slot == 0) {
#pragma unroll
      for (int j = 0; j < G; ++j) {
        if (j >= g) continue;
        if (part == 0) {
          sm_m[warp][j] = m[j];
          sm_l[warp][j] = l[j];
        }
#pragma unroll
        for (int i = 0; i < DPL; ++i) sm_acc[warp][j][part * DPL + i] = acc[j][i];
      }
    }
    finish_chunk<T, G, D>(p, sm_acc, sm_m, sm_l, g, b, head0, c, nchunks, out);
  }
  // (the next kernel waits for this one's end, merges included, before its reads; only where this launch is a
  // programmatic one itself, so that the default launch leaves the kernels after it as they were)
  if constexpr (kStaged) {
    if (p.pdl) pdl_launch_dependents();
  }
  if (nchunks == 1) return;

  merge_partials<T, D>(p, b, kvh, head0, g, nchunks, done, out, sm_last);
}

// --- the tensor-core kernel for e4m3 pages (DecodeAttnArgs::tensor_cores) ---
//
// One CTA of 4 warps per (request, K/V head, worker), as above; a warp takes tiles of 16 tokens and computes, with
// mma.sync m16n8k16 on f16 operands into fp32 accumulators,
//   S = Q K^T     (m: the group's query heads, rows G..15 zero; n: the tile's tokens, two n-tiles; k: dims)
//   O^T += V^T P^T (m: dims, 16 per m-tile; n: the query heads; k: the tile's 16 tokens)
// with the online softmax between them in fp32. The second product's B operand (P) is the first one's accumulator,
// so P never leaves the lane: lane (gq = lane / 4, tq = lane % 4) holds S[head gq][tokens 2tq, 2tq + 1, 2tq + 8,
// 2tq + 9], exactly P^T's B fragment. A dot product does not depend on the order of its dims, so each operand's dims
// are permuted to suit the loads: for q . k, lane (gq, tq) takes a quarter of each K row (tokens gq and gq + 8 of the
// tile: 16 bytes at 16 tq + 64 cc for each of its D / 64 copies cc, so that the 4 lanes of a row read 64 whole bytes
// a copy), k-step s = 4 cc + e the dims 64 cc + 16 tq + 4e .. + 3 (one 32-bit word of e4m3, two f16x2 operands), q's
// the same; for p v an eighth of each V row (tokens 2tq, 2tq + 1, 2tq + 8, 2tq + 9: VC bytes at VC gq + 8 VC cc),
// m-tile mt's rows gq / gq + 8 two neighbouring dims of word mt / 2, whose pairs of tokens one byte permute puts side
// by side. Each lane copies (cp.async, kStages - 1 tiles ahead, into its own slots of a ring in dynamic shared
// memory) exactly the bytes it reads, as the staged kernel above.
//
// Numerics: e4m3 -> f16 is exact; q is rounded to f16 after each head is scaled by a power of two that puts its
// largest |q| in [2^14, 2^15) (folded back into its score scale: bf16 q exactly, but for values 2^-24 below the
// head's largest); products exact, sums in fp32; the probabilities rounded to f16 for p v (each within 2^-11 of
// itself), their sum l taken from the same rounded values, so the output is a convex combination of the V rows. Not
// the staged kernel's bits: checked against fp64 (tests/gpu/test_decode_attn_cuda.py). The cut into chunks, the
// workers, the merges of warps and chunks are the kernel's above, so a request's bits still depend on nothing else
// in its launch.

// d += a b, m16n8k16, f16 operands, fp32 accumulators (the PTX fragment layouts)
__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The e4m3 pair in the low (H = 0) or high 16 bits of w as f16x2 (the lower byte in the lower half), exactly.
template <int H>
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t w) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> (16 * H)), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

__device__ __forceinline__ uint32_t f16x2_rn(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The tensor-core kernel's ring: stages (2 at D = 256, so that it fits 99 KB GPUs with 8 heads a group) and bytes.
__host__ __device__ constexpr int mma_stages(int D) { return D > 128 ? 2 : 3; }
__host__ __device__ constexpr int mma_ring_bytes(int D) { return mma_stages(D) * kThreads * D; }

// (registers for 3 CTAs per SM at D <= 128, 2 at D = 256)
template <typename T, int D, int kG>
__global__ void __launch_bounds__(kThreads, D > 128 ? 2 : 3)
    decode_attention_mma_kernel(const DecodeAttnArgs p) {
  constexpr int kStages = mma_stages(D);
  constexpr int kTile = 16, kPass = kWarps * kTile;
  // A lane's bytes of a K row: 16 at 16 tq + 64 cc for copy cc (the 4 lanes of a row read 64 whole bytes each
  // copy); of a V row: VC at VC gq + 8 VC cc (the 8 lanes of a row likewise).
  constexpr int KB = D / 4, VB = D / 8;
  constexpr int kKC = KB / 16;                          // 16-byte copies of a K row (two rows a tile)
  constexpr int VC = VB < 16 ? VB : 16, kVC = VB / VC;  // V: bytes per copy, copies of a row (four rows a tile)
  constexpr int kSteps = D / 16;                        // k-steps of q . k, m-tiles of p v
  constexpr int kKRing = 2 * kKC * kThreads * 16;       // a stage's K slots, then its V slots
  constexpr int kStageBytes = kThreads * D;
  constexpr int kDS = D + D / 16;                       // sm_acc's padded row (finish_chunk)
  static_assert(kG <= 8 && KB % 16 == 0 && VB % VC == 0 && (VC == 8 || VC == 16), "decode_attention_mma: shape");
  static_assert(kStages * kStageBytes == mma_ring_bytes(D), "decode_attention_mma: ring");
  extern __shared__ __align__(16) unsigned char sm_ring[];
  __shared__ float sm_acc[kWarps][kG][kDS];
  __shared__ float sm_m[kWarps][kG], sm_l[kWarps][kG];
  __shared__ int sm_last;

  const int worker = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int g = p.num_heads / p.num_kv_heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  const int head0 = kvh * g;
  const KeyCut cut = cut_keys(p, b);
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.num_heads + head0) * D;
  if (cut.n <= 0) {  // no keys: zeros, from the first worker
    pdl_wait();
    if (worker == 0)
      for (int e = tid; e < g * D; e += kThreads) out[e] = Pair<T>::round(0.f);
    return;
  }
  if (worker >= cut.nchunks) return;
  const int nchunks = cut.nchunks;
  const PassStream st{cut, p.workers, warp * kTile, kPass};

  const bool capped = p.soft_cap > 0.f;
  const uint32_t tok_stride = static_cast<uint32_t>(p.num_kv_heads) * D;  // bytes from one slot to the next
  const uint32_t koff = kvh * D + 16 * tq, voff = kvh * D + VC * gq;  // the lane's bytes in a slot's row
  const int ps = p.page_size, ps_shift = __ffs(ps) - 1;
  const bool ps_pow2 = (ps & (ps - 1)) == 0;
  const int last_page = static_cast<int>(p.num_pages - 1);  // (pages x page_size < 2^31: checked at launch)
  // the lane's tokens of a tile: 0, 1 its K rows (gq, gq + 8), 2..5 its V rows (2tq, 2tq + 1, 2tq + 8, 2tq + 9)
  auto tok = [&](int i) { return i < 2 ? gq + 8 * i : 2 * tq + (i & 1) + 8 * ((i - 2) >> 1); };
  constexpr int kToks = 6;
  // The slot row (page * page_size + slot) of token base + lane % 16 of the tile (c, base): -1 past the chunk's end,
  // page 0 for positions outside `indices`, page ids clamped to the pool. One lookup per lane, a tile before the
  // copies that take each token's row from its lane.
  auto locate = [&](int c, int base) {
    const int end = c < nchunks ? st.end(c) : 0;
    const int t = base + (lane & 15);
    if (t >= end) return -1;
    const int pi = ps_pow2 ? t >> ps_shift : t / ps;
    const int64_t at = static_cast<int64_t>(cut.p0) + pi;
    const int id = at >= 0 && at < p.num_indices ? p.indices[at] : 0;
    return min(max(id, 0), last_page) * ps + (ps_pow2 ? t & (ps - 1) : t - pi * ps);
  };
  auto kslot = [&](int s, int i) { return sm_ring + s * kStageBytes + (i * kThreads + tid) * 16; };
  auto vslot = [&](int s, int i) { return sm_ring + s * kStageBytes + kKRing + (i * kThreads + tid) * VC; };
  // the copies into stage s of the tile whose rows `row` holds (locate's, the warp's lanes'; zeros past the chunk's
  // end)
  auto fetch_async = [&](int s, int row) {
#pragma unroll
    for (int i = 0; i < kToks; ++i) {
      const int r = __shfl_sync(kFull, row, tok(i));
      const bool ok = r >= 0;
      const uint64_t off = static_cast<uint64_t>(static_cast<uint32_t>(ok ? r : 0)) * tok_stride;
      if (i < 2) {
#pragma unroll
        for (int cc = 0; cc < kKC; ++cc)
          cp_async<16>(kslot(s, i * kKC + cc), static_cast<const uint8_t*>(p.k_cache) + (off + koff + 64 * cc), ok);
      } else {
#pragma unroll
        for (int cc = 0; cc < kVC; ++cc)
          cp_async<VC>(vslot(s, (i - 2) * kVC + cc),
                       static_cast<const uint8_t*>(p.v_cache) + (off + voff + 8 * VC * cc), ok);
      }
    }
  };

  // the stream's first kStages - 1 tiles: their page ids, then (behind the wait for the kernel before, which
  // writes q and the newest K/V row) q and their copies, then the next tile's ids
  int nc, nb;
  st.first(worker, nc, nb);
  int row = -1;  // the lane's row of the tile after the last one whose copies are in flight
  {
    int first[kStages - 1];
    int lc = nc, lb = nb;
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) {
      first[j] = -1;
      if (lc < nchunks) {
        first[j] = locate(lc, lb);
        st.advance(lc, lb);
      }
    }
    pdl_wait();
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) {
      if (nc < nchunks) {
        fetch_async(j, first[j]);
        st.advance(nc, nb);
      }
      cp_async_commit();  // (one group per tile, empty past the stream's end)
    }
    if (nc < nchunks) row = locate(nc, nb);
  }

  // q of head gq (zero past the group), the lane's K dims (16 at 16 tq + 64 cc for each copy cc), as the A
  // fragments of q . k: k-step s = 4 cc + e holds dims 64 cc + 16 tq + 4e, + 1 (qa[s][0]) and + 2, + 3 (qa[s][1]);
  // rows gq + 8 are zero. Each head is scaled by 2^-qx (an exact power of two) so that its largest |q| is in
  // [2^14, 2^15), inside f16's normal range whatever the model's magnitudes; 2^qx is folded into its score scale.
  uint32_t qa[kSteps][2];
  float qscale_back;
  {
    float qf[KB];
    float amax = 0.f;
    const T* qrow = static_cast<const T*>(p.q) + (static_cast<int64_t>(b) * p.num_heads + head0 + gq) * D + 16 * tq;
#pragma unroll
    for (int cc = 0; cc < kKC; ++cc)
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float2 t = make_float2(0.f, 0.f);
        if (gq < g) t = Pair<T>::get(reinterpret_cast<const typename Pair<T>::V*>(qrow + 64 * cc)[e]);
        qf[16 * cc + 2 * e] = t.x;
        qf[16 * cc + 2 * e + 1] = t.y;
        amax = fmaxf(amax, fmaxf(fabsf(t.x), fabsf(t.y)));
      }
    amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));  // over the head's 4 lanes
    amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
    const int ex = ((__float_as_int(amax) >> 23) & 0xff) - 127;  // floor(log2 amax) for a normal amax
    const int qx = amax > 0.f ? max(-100, min(ex - 14, 126)) : 0;
    const float qscale = __int_as_float((127 - qx) << 23);
    qscale_back = __int_as_float((127 + qx) << 23);
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      qa[s][0] = f16x2_rn(qf[4 * s] * qscale, qf[4 * s + 1] * qscale);
      qa[s][1] = f16x2_rn(qf[4 * s + 2] * qscale, qf[4 * s + 3] * qscale);
    }
  }
  const float scale_log2 = p.sm_scale * kLog2e * qscale_back;
  const float cap_in = capped ? p.sm_scale / p.soft_cap * qscale_back : 0.f, cap_out = p.soft_cap * kLog2e;

  int wstage = kStages - 1, rstage = 0, done = 0;
  for (int c = worker; c < nchunks; c += p.workers, ++done) {
    const int t1 = st.end(c);
    float m = -INFINITY, l = 0.f;  // head gq's running max (log2 scale) and the lane's part of its sum
    float o[kSteps][4];            // O^T's accumulators: m-tile mt, heads 2tq (0, 2) / 2tq + 1 (1, 3)
#pragma unroll
    for (int mt = 0; mt < kSteps; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
    for (int base = cut.start + c * cut.chunk + warp * kTile; base < t1; base += kPass) {
      // the tile kStages - 1 on into the stage read last, then this tile's group landed
      if (nc < nchunks) {
        fetch_async(wstage, row);
        st.advance(nc, nb);
        row = locate(nc, nb);
      }
      cp_async_commit();
      wstage = wstage + 1 == kStages ? 0 : wstage + 1;
      cp_async_wait<kStages - 1>();
      const int rs = rstage;
      rstage = rstage + 1 == kStages ? 0 : rstage + 1;

      uint32_t vw[4][VB / 4];  // the lane's V words of its 4 tokens
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int cc = 0; cc < kVC; ++cc) {
          const unsigned char* src = vslot(rs, u * kVC + cc);
          if constexpr (VC == 16) {
            const uint4 w = *reinterpret_cast<const uint4*>(src);
            vw[u][4 * cc] = w.x;
            vw[u][4 * cc + 1] = w.y;
            vw[u][4 * cc + 2] = w.z;
            vw[u][4 * cc + 3] = w.w;
          } else {
            const uint2 w = *reinterpret_cast<const uint2*>(src);
            vw[u][2 * cc] = w.x;
            vw[u][2 * cc + 1] = w.y;
          }
        }
      // S = Q K^T for the tile's tokens 0-7 (j = 0) and 8-15 (j = 1), the two chains interleaved
      float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int cc = 0; cc < kKC; ++cc) {
        uint4 kw[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) kw[j] = *reinterpret_cast<const uint4*>(kslot(rs, j * kKC + cc));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int s = 4 * cc + e;
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const uint32_t w = e == 0 ? kw[j].x : e == 1 ? kw[j].y : e == 2 ? kw[j].z : kw[j].w;
            mma_f16(sc[j], qa[s][0], 0u, qa[s][1], 0u, e4m3x2_f16x2<0>(w), e4m3x2_f16x2<1>(w));
          }
        }
      }
      // the online softmax of head gq over the lane's tokens 2tq, 2tq + 1, 2tq + 8, 2tq + 9 (the tile's first token
      // is inside the chunk, so every head's maximum is finite)
      float x[4] = {sc[0][0], sc[0][1], sc[1][0], sc[1][1]};
      float mx = m;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = base + 2 * tq + (i & 1) + 8 * (i >> 1);
        x[i] = t >= t1 ? -INFINITY : capped ? tanh_fast(x[i] * cap_in) * cap_out : x[i] * scale_log2;
        mx = fmaxf(mx, x[i]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
      const float corr = exp2f(m - mx);
      // the probabilities as p v takes them (f16), and their sum from those same values
      const uint32_t pb0 = f16x2_rn(exp2f(x[0] - mx), exp2f(x[1] - mx));
      const uint32_t pb1 = f16x2_rn(exp2f(x[2] - mx), exp2f(x[3] - mx));
      const float2 r0 = __half22float2(*reinterpret_cast<const __half2*>(&pb0));
      const float2 r1 = __half22float2(*reinterpret_cast<const __half2*>(&pb1));
      l = l * corr + ((r0.x + r0.y) + (r1.x + r1.y));
      m = mx;
      // the accumulators' heads 2tq and 2tq + 1 take their heads' factors (held by lanes 8tq and 8tq + 4)
      const float ca = __shfl_sync(kFull, corr, 8 * tq), cb = __shfl_sync(kFull, corr, 8 * tq + 4);
      // (no head's maximum moved in the warp: every factor is exactly 1, the rescale skipped changes no bit)
      if (__any_sync(kFull, corr != 1.f)) {
#pragma unroll
        for (int mt = 0; mt < kSteps; ++mt) {
          o[mt][0] *= ca;
          o[mt][1] *= cb;
          o[mt][2] *= ca;
          o[mt][3] *= cb;
        }
      }
      // O^T += V^T P^T: word wi of the lane's V bytes holds m-tiles 2wi (bytes 0, 1) and 2wi + 1 (bytes 2, 3)
#pragma unroll
      for (int wi = 0; wi < VB / 4; ++wi) {
        // bytes 0 / 1 (lo) or 2 / 3 (hi) of two tokens' words side by side: A0 B0 A1 B1, A2 B2 A3 B3
        const uint32_t lo01 = __byte_perm(vw[0][wi], vw[1][wi], 0x5140);
        const uint32_t hi01 = __byte_perm(vw[0][wi], vw[1][wi], 0x7362);
        const uint32_t lo89 = __byte_perm(vw[2][wi], vw[3][wi], 0x5140);
        const uint32_t hi89 = __byte_perm(vw[2][wi], vw[3][wi], 0x7362);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t w01 = h ? hi01 : lo01, w89 = h ? hi89 : lo89;
          mma_f16(o[2 * wi + h], e4m3x2_f16x2<0>(w01), e4m3x2_f16x2<1>(w01), e4m3x2_f16x2<0>(w89),
                  e4m3x2_f16x2<1>(w89), pb0, pb1);
        }
      }
    }
    // the warp's state: l summed over the lanes of a head, then (m, l) of head gq, O of heads 2tq, 2tq + 1
    l += __shfl_xor_sync(kFull, l, 1);
    l += __shfl_xor_sync(kFull, l, 2);
    if (tq == 0 && gq < g) {
      sm_m[warp][gq] = m;
      sm_l[warp][gq] = l;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int head = 2 * tq + h;
      if (head >= g) continue;
#pragma unroll
      for (int mt = 0; mt < kSteps; ++mt) {
        // m-tile mt's rows gq / gq + 8: dims d, d + 1 of word mt / 2 (copy cc, word e of it), bytes 2 (mt % 2)
        const int wi = mt / 2, cc = wi / (VC / 4), e = wi % (VC / 4);
        const int d = 8 * VC * cc + VC * gq + 4 * e + 2 * (mt % 2);
        sm_acc[warp][head][d + (d >> 4)] = o[mt][h];
        sm_acc[warp][head][d + 1 + ((d + 1) >> 4)] = o[mt][2 + h];
      }
    }
    finish_chunk<T, kG, D, kDS>(p, sm_acc, sm_m, sm_l, g, b, head0, c, nchunks, out);
  }
  if (p.pdl) pdl_launch_dependents();
  if (nchunks == 1) return;
  merge_partials<T, D>(p, b, kvh, head0, g, nchunks, done, out, sm_last);
}

// One kernel's launch: a plain <<<>>> launch (the register version's, as measured), or with stages and pdl through
// cudaLaunchKernelEx with the programmatic-serialization attribute.
// `smem` bytes of dynamic shared memory allowed to `kernel` on `device`, once per kernel and device.
const char* allow_smem(const void* kernel, int smem, int device) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({kernel, device})) return nullptr;
  int optin = 0;
  cudaFuncAttributes attr = {};
  cudaError_t err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, kernel);
  if (err == cudaSuccess && static_cast<size_t>(smem) + attr.sharedSizeBytes > static_cast<size_t>(optin))
    return "decode_attention: the tensor-core kernel needs more shared memory per CTA than this GPU allows";
  if (err == cudaSuccess) err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) {
    cudaGetLastError();  // (reported here, not left for a later launch's check)
    return cudaGetErrorString(err);
  }
  done.insert({kernel, device});
  return nullptr;
}

template <typename K>
cudaError_t launch_one(K kernel, const DecodeAttnArgs& a, dim3 grid, cudaStream_t stream, int major, int smem = 0) {
  if (!a.pdl) {
    kernel<<<grid, kThreads, smem, stream>>>(a);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  set_pdl(cfg, attr, true, major);
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, a);
  if (err != cudaSuccess) cudaGetLastError();  // (cleared, as a <<<>>> launch's check would: reported here once)
  return err;
}

// (stages: one query head per K/V head only; grouped heads take the register version, whose bits are the same;
// the tensor-core kernel takes any group)
template <typename T, bool KV8, int D>
const char* launch_group(const DecodeAttnArgs& a, int group, dim3 grid, cudaStream_t stream, int major,
                         int device) {
  cudaError_t err;
  auto go = [&](auto kernel) { return launch_one(kernel, a, grid, stream, major); };
  if constexpr (KV8) {  // (the tensor-core kernel: e4m3 pages only; its ring in dynamic shared memory)
    if (a.tensor_cores) {
      auto kernel = group <= 1 ? decode_attention_mma_kernel<T, D, 1>
                    : group <= 4 ? decode_attention_mma_kernel<T, D, 4> : decode_attention_mma_kernel<T, D, 8>;
      const char* refused = allow_smem(reinterpret_cast<const void*>(kernel), mma_ring_bytes(D), device);
      if (refused != nullptr) return refused;
      err = launch_one(kernel, a, grid, stream, major, mma_ring_bytes(D));
      return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
    }
  }
  // (int_convert: e4m3 pages only, checked before; with KV8 false the branch's kernel is the plain one, never taken)
  if (KV8 && group <= 1 && a.stages == 3 && a.int_convert) err = go(decode_attention_kernel<T, KV8, D, 1, 3, KV8>);
  else if (group <= 1 && a.stages == 3) err = go(decode_attention_kernel<T, KV8, D, 1, 3>);
  else if (group <= 1 && a.stages == 5) err = go(decode_attention_kernel<T, KV8, D, 1, 5>);
  else if (group <= 1) err = go(decode_attention_kernel<T, KV8, D, 1, 0>);
  else if (group <= 2) err = go(decode_attention_kernel<T, KV8, D, 2, 0>);
  else if (group <= 4) err = go(decode_attention_kernel<T, KV8, D, 4, 0>);
  else err = go(decode_attention_kernel<T, KV8, D, 8, 0>);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename T, bool KV8>
const char* launch_dim(const DecodeAttnArgs& a, int group, dim3 grid, cudaStream_t stream, int major, int device) {
  switch (a.head_dim) {
    case 64: return launch_group<T, KV8, 64>(a, group, grid, stream, major, device);
    case 128: return launch_group<T, KV8, 128>(a, group, grid, stream, major, device);
    default: return launch_group<T, KV8, 256>(a, group, grid, stream, major, device);
  }
}

template <typename T>
const char* launch_typed(const DecodeAttnArgs& a, int group, dim3 grid, cudaStream_t stream, int major,
                         int device) {
  return a.kv_e4m3 ? launch_dim<T, true>(a, group, grid, stream, major, device)
                   : launch_dim<T, false>(a, group, grid, stream, major, device);
}

}  // namespace

bool decode_attention_supports(int head_dim, int group) {
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && group >= 1 && group <= 8;
}

bool decode_attention_stages_ok(int stages) { return stages == 0 || stages == 3 || stages == 5; }

const char* decode_attention(DType dtype, const DecodeAttnArgs& a, int device, void* stream) {
  if (a.batch <= 0) return nullptr;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0)
    return "decode_attention: the query heads must be a positive multiple of the K/V heads";
  if (!decode_attention_supports(a.head_dim, a.num_heads / a.num_kv_heads))
    return "decode_attention: head_dim must be 64, 128 or 256 and at most 8 query heads share a K/V head";
  if (!decode_attention_stages_ok(a.stages)) return "decode_attention: stages must be 0, 3 or 5";
  if (a.tensor_cores && (!a.kv_e4m3 || a.stages != 3 || a.int_convert))
    return "decode_attention: the tensor-core kernel takes e4m3 pages and stages 3 (not the integer conversion)";
  if (a.tensor_cores && a.num_pages * static_cast<int64_t>(a.page_size) > INT32_MAX)
    return "decode_attention: the tensor-core kernel takes fewer than 2^31 K/V slots (pages x page_size)";
  if (a.pdl && (a.stages == 0 || (a.num_heads != a.num_kv_heads && !a.tensor_cores)))
    return "decode_attention: a programmatic launch needs stages 3 or 5 and one query head per K/V head (any group "
           "with tensor_cores)";
  if (a.int_convert && (!a.kv_e4m3 || a.stages != 3 || a.num_heads != a.num_kv_heads))
    return "decode_attention: the integer conversion takes e4m3 pages, stages 3 and one query head per K/V head";
  if (a.page_size <= 0 || a.num_pages <= 0 || a.chunk <= 0 || a.chunk % 16 != 0 || a.max_chunks <= 0 ||
      a.workers <= 0)
    return "decode_attention: page_size, num_pages, max_chunks and workers must be positive, chunk a multiple of 16";
  if (a.batch > 65535 || a.num_kv_heads > 65535) return "decode_attention: too many requests or K/V heads";
  cudaError_t err = cudaSetDevice(device);
  int major = 0;
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  const dim3 grid(a.workers, a.num_kv_heads, a.batch);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int group = a.num_heads / a.num_kv_heads;
  return dtype == DType::kFloat16 ? launch_typed<__half>(a, group, grid, s, major, device)
                                  : launch_typed<__nv_bfloat16>(a, group, grid, s, major, device);
}

}  // namespace lorafleet
