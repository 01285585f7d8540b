// decode_attention (see decode_attn.h): one CTA of 4 warps per (request, K/V head, worker). A lane holds DPL
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
#include <type_traits>

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

  const int p0 = p.indptr[b], np = p.indptr[b + 1] - p0;
  const int last_len = min(max(p.last_page_len[b], 1), p.page_size);
  const int kv_len = np > 0 ? (np - 1) * p.page_size + last_len : 0;
  const int start = p.window_left >= 0 && kv_len - 1 - p.window_left > 0 ? kv_len - 1 - p.window_left : 0;
  const int n = kv_len - start;
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.num_heads + head0) * D;
  if (n <= 0) {  // no keys: zeros, from the first worker
    if constexpr (kStaged) pdl_wait();
    if (worker == 0)
      for (int e = tid; e < g * D; e += kThreads) out[e] = Pair<T>::round(0.f);
    return;
  }
  int chunk = p.chunk, nchunks = (n + chunk - 1) / chunk;
  if (nchunks > p.max_chunks) {
    chunk = ((n + p.max_chunks - 1) / p.max_chunks + 15) & ~15;
    nchunks = (n + chunk - 1) / chunk;
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

  // This warp's passes over its chunks c = worker, worker + workers, ... form one stream: a pass is (chunk, first
  // token), the next is kPass tokens on in the same chunk, else the first of the warp's tokens in its next chunk
  // that has any. Loads run ahead along the stream across chunk ends, so a chunk's first pass is in flight during
  // the previous chunk's last one (and its merge).
  constexpr int kPass = kWarps * TPW * kUnroll;  // tokens of one pass of the CTA
  auto chunk_end = [&](int c) { return min(start + (c + 1) * chunk, kv_len); };
  // (c, base) <- the pass after it; c = nchunks where the stream ends
  auto advance = [&](int& c, int& base) {
    base += kPass;
    if (base < chunk_end(c)) return;
    for (c += p.workers; c < nchunks; c += p.workers) {
      base = start + c * chunk + warp * TPW;
      if (base < chunk_end(c)) return;
    }
    c = nchunks;
  };
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
  int nc = worker, nb = start + worker * chunk + warp * TPW;
  if (nb >= chunk_end(nc)) {
    nb -= kPass;
    advance(nc, nb);
  }
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
    __syncthreads();
    for (int e = tid; e < g * D; e += kThreads) {
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
        a = fmaf(sm_acc[w][j][d], cw, a);
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
  // (the next kernel waits for this one's end, merges included, before its reads; only where this launch is a
  // programmatic one itself, so that the default launch leaves the kernels after it as they were)
  if constexpr (kStaged) {
    if (p.pdl) pdl_launch_dependents();
  }
  if (nchunks == 1) return;

  // the CTA that completes the request's last chunk merges the partials in chunk order
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

// One kernel's launch: a plain <<<>>> launch (the register version's, as measured), or with stages and pdl through
// cudaLaunchKernelEx with the programmatic-serialization attribute.
template <typename K>
cudaError_t launch_one(K kernel, const DecodeAttnArgs& a, dim3 grid, cudaStream_t stream, int major) {
  if (!a.pdl) {
    kernel<<<grid, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  set_pdl(cfg, attr, true, major);
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, a);
  if (err != cudaSuccess) cudaGetLastError();  // (cleared, as a <<<>>> launch's check would: reported here once)
  return err;
}

// (stages: one query head per K/V head only; grouped heads take the register version, whose bits are the same)
template <typename T, bool KV8, int D>
const char* launch_group(const DecodeAttnArgs& a, int group, dim3 grid, cudaStream_t stream, int major) {
  cudaError_t err;
  auto go = [&](auto kernel) { return launch_one(kernel, a, grid, stream, major); };
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
const char* launch_dim(const DecodeAttnArgs& a, int group, dim3 grid, cudaStream_t stream, int major) {
  switch (a.head_dim) {
    case 64: return launch_group<T, KV8, 64>(a, group, grid, stream, major);
    case 128: return launch_group<T, KV8, 128>(a, group, grid, stream, major);
    default: return launch_group<T, KV8, 256>(a, group, grid, stream, major);
  }
}

template <typename T>
const char* launch_typed(const DecodeAttnArgs& a, int group, dim3 grid, cudaStream_t stream, int major) {
  return a.kv_e4m3 ? launch_dim<T, true>(a, group, grid, stream, major)
                   : launch_dim<T, false>(a, group, grid, stream, major);
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
  if (a.pdl && (a.stages == 0 || a.num_heads != a.num_kv_heads))
    return "decode_attention: a programmatic launch needs stages 3 or 5 and one query head per K/V head";
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
  return dtype == DType::kFloat16 ? launch_typed<__half>(a, group, grid, s, major)
                                  : launch_typed<__nv_bfloat16>(a, group, grid, s, major);
}

}  // namespace lorafleet
