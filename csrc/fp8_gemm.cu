// fp8_gemm (see fp8_gemm.h). Fragment layouts of mma.sync.m16n8k16 with f16 operands (PTX ISA): lane =
// 4 * g + t; A (16 x 16, row-major): register 0 holds row g, k 2t, 2t+1; 1: row g + 8, same k; 2: row g,
// k 8+2t, 9+2t; 3: row g + 8, same k; B (16 x 8, column-major): register 0 holds k 2t, 2t+1 of column g,
// 1: k 8+2t, 9+2t; C (16 x 8 fp32): c0, c1 row g, columns 2t, 2t+1; c2, c3 row g + 8.
//
// A is the weight (16 of its rows), B the activations (8 tokens per tile). A dot product does not depend
// on the order of k, so each lane loads 16 contiguous e4m3 bytes of its rows and of its token (k0 + 16t ..
// k0 + 16t + 15), converts them to 8 f16 pairs and hands pairs 2j, 2j + 1 to the j-th of four MMAs: the
// k-slot -> k map is the same for A and B, and one warp covers 64 consecutive k per step with 64-byte runs
// per weight row. (Hopper has no 8-bit mma.sync: ptxas would emulate one with conversions per call.)
//
// Work split. A block of 4 warps owns 128 weight rows (32 per warp: two 16-row MMA tiles sharing each
// activation fragment) and one K range (`split`); the K ranges are chosen from N, K and the number of SMs
// only (never from M), to fill one wave of blocks. The block streams its rows and the activations 128 k at a
// time into a ring of shared-memory stages with cp.async, kStages - 1 stages in flight while one is
// multiplied, so that the loads never wait on the arithmetic and enough bytes are in flight to keep HBM
// busy. Shared rows are 128 bytes, their 16-byte chunks swizzled by the row's parity (chunk ^ 4 on odd rows)
// so that the fragment loads of lanes g, g + 1 (one row apart) fall in different banks. With one K range the
// block writes bf16; with several, each writes its fp32 partial sums to the workspace and the last block of
// a row tile to finish (a counter per tile) adds the partials in range order and writes bf16, so the result
// does not depend on which block ran first, nor on M.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "fp8_gemm.h"

namespace lorafleet {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 32;                        // two 16-row MMA tiles
constexpr int kRowsPerBlock = kRowsPerWarp * kWarps;    // weight rows per block
constexpr int kKStep = 64;                              // k per warp step (two MMAs)
constexpr int kStageK = 128;                            // k per pipeline stage: one 128-byte shared row
constexpr int kMaxStages = 4;
// Blocks per SM: 4 by default (16 warps; the kernel is latency-bound: at 2 blocks, 8 warps per SM, Nsight Compute
// saw 34 % of DRAM and 39 % of the SM's throughput on 70B's down GEMM); LORAFLEET_FP8_GEMM_BLOCKS_PER_SM=2 or 3
// keeps more pipeline stages per block instead.
constexpr int kBlocksPerSm = 4;
int blocks_per_sm() {
  static const int b = [] {
    const char* v = std::getenv("LORAFLEET_FP8_GEMM_BLOCKS_PER_SM");
    const int n = v ? std::atoi(v) : kBlocksPerSm;
    return n == 2 || n == 3 ? n : kBlocksPerSm;
  }();
  return b;
}
constexpr size_t kCounterAlign = 256;

// Shared bytes of one stage for NT tiles of 8 tokens: 128 weight rows and 8 * NT activation rows of 128 k
// (one byte each in e4m3, two in bf16); as many stages (2 to 4) as let BPS blocks share an SM.
constexpr int stage_bytes(int nt, bool a16) { return kRowsPerBlock * kStageK + 8 * nt * kStageK * (a16 ? 2 : 1); }
constexpr int stages_for(int nt, bool a16, int bps) {
  int st = kMaxStages;
  while (st > 2 && bps * st * stage_bytes(nt, a16) > 227 * 1024) --st;
  return st;
}
constexpr int smem_bytes(int nt, bool a16, int bps) { return stages_for(nt, a16, bps) * stage_bytes(nt, a16); }
static_assert(4 * smem_bytes(8, true, 4) <= 227 * 1024 || 3 * smem_bytes(8, true, 3) <= 227 * 1024,
              "blocks per SM at 64 bf16 tokens");

// The e4m3 -> f16 conversion needs PTX ISA 8.4 (CUDA 12.4) and compute capability 8.9. Built without it (an
// older compiler, or the sm_80 image of the library) the kernel traps instead of returning zeros, and the launcher refuses
// before launching (kMmaCompiled, the kernel image's binary version).
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
constexpr bool kMmaCompiled = true;
#else
constexpr bool kMmaCompiled = false;
#endif

// Hopper has no 8-bit mma.sync (ptxas emulates the e4m3 one, converting both operands for every call), so
// each operand fragment is converted once, exactly (every e4m3 value is an f16 and a bf16), and multiplied on
// the f16 (kBf16: bf16) tensor cores: the same fp32 sums of exact products as an FP8 MMA.
template <bool kBf16>
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kBf16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// Four e4m3 bytes -> two f16x2 words: bytes 0-1 in `lo`, 2-3 in `hi`.
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t v, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(v));
#else
  lo = hi = v;
  __trap();
#endif
}

// Four e4m3 bytes -> two bf16x2 words (bytes 0-1 in `lo`, 2-3 in `hi`), exactly: each byte's sign, exponent
// and mantissa bits moved to a bf16's places are the value times 2^-120 (a bf16 subnormal where the e4m3 one
// is), and one multiply by 2^120 (an FMA adding -0) restores it.
__device__ __forceinline__ void e4m3x4_to_bf16(uint32_t v, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t ul = __byte_perm(v, 0u, 0x1404), uh = __byte_perm(v, 0u, 0x3424);  // byte b as b << 8 per half
  const uint32_t bl = (ul & 0x80008000u) | ((ul >> 4) & 0x07f007f0u);
  const uint32_t bh = (uh & 0x80008000u) | ((uh >> 4) & 0x07f007f0u);
  asm("fma.rn.bf16x2 %0, %2, %4, %5;\nfma.rn.bf16x2 %1, %3, %4, %5;\n"
      : "=r"(lo), "=r"(hi)
      : "r"(bl), "r"(bh), "r"(0x7b807b80u), "r"(0x80008000u));
#else
  lo = hi = v;
#endif
}

// 16 e4m3 bytes (k .. k + 15 of one row) -> 8 f16x2 (or bf16x2) words, two consecutive k each.
template <bool kBf16>
__device__ __forceinline__ void e4m3x16_to(const uint4& v, uint32_t (&h)[8]) {
  if constexpr (kBf16) {
    e4m3x4_to_bf16(v.x, h[0], h[1]);
    e4m3x4_to_bf16(v.y, h[2], h[3]);
    e4m3x4_to_bf16(v.z, h[4], h[5]);
    e4m3x4_to_bf16(v.w, h[6], h[7]);
  } else {
    e4m3x4_to_f16(v.x, h[0], h[1]);
    e4m3x4_to_f16(v.y, h[2], h[3]);
    e4m3x4_to_f16(v.z, h[4], h[5]);
    e4m3x4_to_f16(v.w, h[6], h[7]);
  }
}

// 16 bytes global -> shared, asynchronously; `bytes` 0 fills the 16 shared bytes with zeros (src unread).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Byte offset of 16-byte chunk `c` (0-7) of a 128-byte shared row `r` (weights, e4m3 activations) ...
__device__ __forceinline__ int swz(int r, int c) { return r * kStageK + ((c ^ ((r & 1) << 2)) << 4); }
// ... and of chunk `c` (0-15) of a 256-byte row of bf16 activations, where a lane reads chunks 2j, 2j + 1.
__device__ __forceinline__ int swz16(int r, int c) { return r * 2 * kStageK + ((c ^ (r & 1)) << 4); }

struct Plan {
  int tiles = 0;    // blocks along N (128 weight rows each)
  int splits = 1;   // blocks along K
  int k_chunk = 0;  // k per split (a multiple of 128 unless it is all of K; the last split may hold less)
};

Plan make_plan(int n, int k, int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    cudaGetLastError();
    sms = 108;
  }
  Plan p;
  p.tiles = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  const int stages = (k + kStageK - 1) / kStageK;
  // One wave of kBlocksPerSm blocks per SM (a second, partial one would run on few SMs), at least two
  // stages of k per split so that each block's pipeline has something to overlap.
  int s = (blocks_per_sm() * sms) / p.tiles;
  s = std::max(1, std::min(s, std::max(1, stages / 2)));
  const int chunk_stages = (stages + s - 1) / s;
  p.splits = (stages + chunk_stages - 1) / chunk_stages;  // no empty split
  p.k_chunk = p.splits == 1 ? k : chunk_stages * kStageK;
  return p;
}

size_t counter_bytes(int tiles) {
  return (static_cast<size_t>(tiles) * sizeof(int) + kCounterAlign - 1) / kCounterAlign * kCounterAlign;
}

// NT tiles of 8 tokens (M <= 8 * NT); A16: x in bf16 (products on the bf16 tensor cores, no x_scale), else e4m3.
template <int NT, bool A16, int BPS>
__global__ void __launch_bounds__(kThreads, BPS)
    fp8_gemm_kernel(Fp8GemmArgs a, int k_chunk, int splits, int* counters, float* partial) {
  constexpr int kStages = stages_for(NT, A16, BPS);
  constexpr int kXElem = A16 ? 2 : 1;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int finisher;
  constexpr int kXRows = 8 * NT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, split = blockIdx.y;
  const int row0 = tile * kRowsPerBlock;
  const int r0 = row0 + warp * kRowsPerWarp;
  const int live_tiles = max(0, min(2, (a.n - r0) / 16));  // N is a multiple of 16
  const int64_t K = a.k;
  const int kb = split * k_chunk, ke = min(a.k, kb + k_chunk);
  const int n_stages = (ke - kb + kStageK - 1) / kStageK;

  // Stage `s` (k from kb + s * 128) into ring slot s % kStages: 128 weight rows (zeros past N) and the
  // activation rows (zeros past M), 16 bytes per copy; a last stage of 64 k copies half of each row.
  auto load_stage = [&](int s) {
    uint8_t* ws = smem + (s % kStages) * stage_bytes(NT, A16);
    uint8_t* xs = ws + kRowsPerBlock * kStageK;
    const int k0 = kb + s * kStageK;
    const int sh = ke - k0 >= kStageK ? 3 : 2;  // log2 of the 16-byte chunks per row: 8, or 4 at a 64-k tail
    for (int c = threadIdx.x; c < (kRowsPerBlock << sh); c += kThreads) {
      const int r = c >> sh, ch = c & ((1 << sh) - 1);
      const bool in = row0 + r < a.n;
      cp_async16(ws + swz(r, ch), a.w + (in ? (row0 + r) * K + k0 + 16 * ch : 0), in ? 16 : 0);
    }
    const int shx = sh + (A16 ? 1 : 0);  // bf16 rows have twice the chunks
    for (int c = threadIdx.x; c < (kXRows << shx); c += kThreads) {
      const int r = c >> shx, ch = c & ((1 << shx) - 1);
      const bool in = r < a.m;
      cp_async16(xs + (A16 ? swz16(r, ch) : swz(r, ch)), a.x + (in ? (r * K + k0) * kXElem + 16 * ch : 0),
                 in ? 16 : 0);
    }
  };

  float acc[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_stages) load_stage(s);
    cp_async_commit();  // empty groups keep the count of outstanding groups uniform
  }
  for (int s = 0; s < n_stages; ++s) {
    cp_async_wait<kStages - 2>();  // stage s has landed (this thread's copies) ...
    __syncthreads();               // ... everyone's; and slot (s - 1) % kStages is free to refill
    if (s + kStages - 1 < n_stages) load_stage(s + kStages - 1);
    cp_async_commit();
    const uint8_t* ws = smem + (s % kStages) * stage_bytes(NT, A16);
    const uint8_t* xs = ws + kRowsPerBlock * kStageK;
    const int steps = min(kStageK, ke - kb - s * kStageK) / kKStep;  // 2, or 1 at a 64-k tail
#pragma unroll
    for (int d = 0; d < kStageK / kKStep; ++d) {
      if (d < steps) {
        // Lane (g, t) holds k 16t .. 16t + 15 of this step for weight rows g, g + 8 and token g; the j-th
        // f16 MMA (k16) takes words 2j, 2j + 1 of each as its k slots 2t, 2t + 1 and 2t + 8, 2t + 9. The
        // same k -> slot map for both operands, so each dot product is over the right pairs.
        uint32_t lo[2][8], hi[2][8];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int r = warp * kRowsPerWarp + mt * 16 + g;
          e4m3x16_to<A16>(*reinterpret_cast<const uint4*>(ws + swz(r, 4 * d + t)), lo[mt]);
          e4m3x16_to<A16>(*reinterpret_cast<const uint4*>(ws + swz(r + 8, 4 * d + t)), hi[mt]);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t xh[8];
          if constexpr (A16) {  // k 16t .. 16t + 15 of token g: 32 bytes, already pairs of consecutive k
            const uint4 x0 = *reinterpret_cast<const uint4*>(xs + swz16(nt * 8 + g, 2 * (4 * d + t)));
            const uint4 x1 = *reinterpret_cast<const uint4*>(xs + swz16(nt * 8 + g, 2 * (4 * d + t) + 1));
            xh[0] = x0.x, xh[1] = x0.y, xh[2] = x0.z, xh[3] = x0.w, xh[4] = x1.x, xh[5] = x1.y, xh[6] = x1.z,
            xh[7] = x1.w;
          } else {
            e4m3x16_to<false>(*reinterpret_cast<const uint4*>(xs + swz(nt * 8 + g, 4 * d + t)), xh);
          }
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            if (mt < live_tiles) {
#pragma unroll
              for (int j = 0; j < 4; ++j)
                mma_16816<A16>(acc[mt][nt], lo[mt][2 * j], hi[mt][2 * j], lo[mt][2 * j + 1], hi[mt][2 * j + 1],
                               xh[2 * j], xh[2 * j + 1]);
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out);
  if (splits == 1) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tok = nt * 8 + 2 * t + (i & 1), row = r0 + mt * 16 + g + (i >= 2 ? 8 : 0);
          if (mt < live_tiles && tok < a.m)
            out[static_cast<int64_t>(tok) * a.n + row] =
                __float2bfloat16_rn((0.f + acc[mt][nt][i]) * (A16 ? 1.f : a.x_scale[tok]) * a.w_scale[row]);
        }
    return;
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = nt * 8 + 2 * t + (i & 1), row = r0 + mt * 16 + g + (i >= 2 ? 8 : 0);
        if (mt < live_tiles && tok < a.m)
          __stcg(&partial[(static_cast<int64_t>(split) * a.m + tok) * a.n + row], acc[mt][nt][i]);
      }
  __threadfence();  // this block's partial sums visible device-wide before it is counted
  __syncthreads();
  if (threadIdx.x == 0) finisher = atomicAdd(&counters[tile], 1) == splits - 1;
  __syncthreads();
  if (!finisher) return;
  __threadfence();
  // Four elements per thread at a time, so that their partials' loads overlap; each element's partials are
  // still added in split order.
  constexpr int kGroup = 4;
  const int rows = min(kRowsPerBlock, a.n - row0), total = a.m * rows;
  for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * kGroup) {
    int64_t at[kGroup];
    float sum[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const int e = min(e0 + j * kThreads, total - 1);
      at[j] = static_cast<int64_t>(e / rows) * a.n + row0 + e % rows;
      sum[j] = 0.f;
    }
    for (int sp = 0; sp < splits; ++sp) {
      const float* base = partial + static_cast<int64_t>(sp) * a.m * a.n;
#pragma unroll
      for (int j = 0; j < kGroup; ++j) sum[j] += __ldcg(base + at[j]);
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const int e = e0 + j * kThreads;
      if (e < total) {
        const int tok = e / rows, row = row0 + e % rows;
        out[at[j]] = __float2bfloat16_rn(sum[j] * (A16 ? 1.f : a.x_scale[tok]) * a.w_scale[row]);
      }
    }
  }
}

template <int NT, bool A16, int BPS>
cudaError_t launch_bps(const Fp8GemmArgs& a, const Plan& p, int* counters, float* partial, cudaStream_t s) {
  // Above 48 KB of dynamic shared memory a kernel must opt in; a host-side setting, no work on the stream.
  constexpr int bytes = smem_bytes(NT, A16, BPS);
  cudaError_t e = cudaFuncSetAttribute(fp8_gemm_kernel<NT, A16, BPS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       bytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(p.tiles), static_cast<unsigned>(p.splits)), block(kThreads);
  fp8_gemm_kernel<NT, A16, BPS><<<grid, block, bytes, s>>>(a, p.k_chunk, p.splits, counters, partial);
  return cudaGetLastError();
}

template <int NT, bool A16>
cudaError_t launch(const Fp8GemmArgs& a, const Plan& p, int* counters, float* partial, cudaStream_t s) {
  switch (blocks_per_sm()) {
    case 2: return launch_bps<NT, A16, 2>(a, p, counters, partial, s);
    case 3: return launch_bps<NT, A16, 3>(a, p, counters, partial, s);
    default: return launch_bps<NT, A16, kBlocksPerSm>(a, p, counters, partial, s);
  }
}

template <bool A16>
cudaError_t launch_rows(const Fp8GemmArgs& a, const Plan& p, int* counters, float* partial, cudaStream_t s) {
  if (a.m <= 8) return launch<1, A16>(a, p, counters, partial, s);
  if (a.m <= 16) return launch<2, A16>(a, p, counters, partial, s);
  if (a.m <= 32) return launch<4, A16>(a, p, counters, partial, s);
  return launch<8, A16>(a, p, counters, partial, s);
}

}  // namespace

size_t fp8_gemm_workspace(int m, int n, int k, int device) {
  if (m <= 0 || n <= 0 || k <= 0 || k % kKStep != 0 || n % 16 != 0) return 0;
  const Plan p = make_plan(n, k, device);
  if (p.splits == 1) return 0;
  return counter_bytes(p.tiles) + static_cast<size_t>(p.splits) * m * n * sizeof(float);
}

const char* fp8_gemm(const Fp8GemmArgs& a, int device, void* stream) {
  if (a.m == 0 || a.n == 0) return nullptr;
  if (a.m < 0 || a.m > kFp8GemmMaxRows) return "fp8_gemm: at most 64 rows";
  if (a.k <= 0 || a.k % kKStep != 0) return "fp8_gemm: K must be a positive multiple of 64";
  if (a.n % 16 != 0) return "fp8_gemm: N must be a multiple of 16";
  if (a.x == nullptr || a.w == nullptr || (a.x_scale == nullptr && !a.x_bf16) || a.w_scale == nullptr ||
      a.out == nullptr)
    return "fp8_gemm: null pointer";
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  // The kernel image this device runs must carry the MMA (an sm_80 image on an sm_89 device would not).
  cudaFuncAttributes fa{};
  e = cudaFuncGetAttributes(&fa, fp8_gemm_kernel<1, false, kBlocksPerSm>);
  const char* refusal = nullptr;
  const Plan p = make_plan(a.n, a.k, device);
  const size_t need = p.splits == 1 ? 0 : counter_bytes(p.tiles) + static_cast<size_t>(p.splits) * a.m * a.n * sizeof(float);
  if (e != cudaSuccess) refusal = cudaGetErrorString(e);
  else if (!kMmaCompiled && !a.x_bf16) refusal = "fp8_gemm: built by a CUDA compiler older than 12.4 (no e4m3 conversion)";
  else if (fa.binaryVersion < (a.x_bf16 ? 80 : 89))
    refusal = a.x_bf16 ? "fp8_gemm: needs compute capability 8.0 or higher"
                       : "fp8_gemm: needs FP8 tensor cores (compute capability 8.9 or higher)";
  else if (a.workspace_bytes < need || (need > 0 && a.workspace == nullptr))
    refusal = "fp8_gemm: workspace smaller than fp8_gemm_workspace(m, n, k, device)";
  if (refusal != nullptr) {
    if (prev != device) cudaSetDevice(prev);
    return refusal;
  }
  auto s = static_cast<cudaStream_t>(stream);
  int* counters = nullptr;
  float* partial = nullptr;
  if (p.splits > 1) {
    counters = static_cast<int*>(a.workspace);
    partial = reinterpret_cast<float*>(static_cast<char*>(a.workspace) + counter_bytes(p.tiles));
    e = cudaMemsetAsync(counters, 0, static_cast<size_t>(p.tiles) * sizeof(int), s);
  }
  if (e == cudaSuccess) {
    e = a.x_bf16 ? launch_rows<true>(a, p, counters, partial, s) : launch_rows<false>(a, p, counters, partial, s);
  }
  if (prev != device) cudaSetDevice(prev);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace lorafleet
