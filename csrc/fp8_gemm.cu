// fp8_gemm (see fp8_gemm.h). Fragment layouts of mma.sync.m16n8k32 with 8-bit operands (PTX ISA): lane =
// 4 * g + t; A (16 x 32, row-major): register 0 holds row g, k 4t..4t+3; 1: row g + 8, same k; 2: row g,
// k 16+4t..; 3: row g + 8, k 16+4t..; B (32 x 8, column-major): register 0 holds k 4t..4t+3 of column g,
// 1: k 16+4t..; C (16 x 8 fp32): c0, c1 row g, columns 2t, 2t+1; c2, c3 row g + 8.
//
// A is the weight (16 of its rows), B the activations (8 tokens per tile). A dot product does not depend
// on the order of k, so each lane loads 16 contiguous bytes of its rows (k0 + 16t .. k0 + 16t + 15) and
// hands bytes 0-7 to one mma and 8-15 to the next: the k-slot -> k map is the same for A and B, and one
// warp covers 64 consecutive k per step with 64-byte runs per weight row.
//
// Work split. A block of 8 warps owns 128 weight rows (16 per warp) and one K range (`split`); the blocks'
// K ranges are chosen from N, K and the number of SMs only (never from M), about two blocks per SM. Each
// block stages the activations of 256 k at a time in shared memory (read from L2 once per block, not once
// per warp), while every warp streams its weight rows straight into registers, the next 256 k loaded
// before the current ones are multiplied. With one K range the block writes bf16; with several, each
// writes its fp32 partial sums to the workspace and the last block of a row tile to finish (a counter per
// tile) adds the partials in range order and writes bf16, so the result does not depend on which block
// ran first, nor on M.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "fp8_gemm.h"

namespace lorafleet {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerBlock = 16 * kWarps;  // weight rows per block
constexpr int kKStep = 64;                  // k per warp step
constexpr int kDepth = 4;                   // steps per stage: 256 k
constexpr int kStageK = kDepth * kKStep;
// Shared rows of 256 + 64 bytes: the 16-byte fragment loads of lanes g, g + 1 (tokens one row apart) fall
// in different banks.
constexpr int kXStride = kStageK + 64;
constexpr size_t kCounterAlign = 256;

// The e4m3 MMA needs PTX ISA 8.4 (CUDA 12.4) and compute capability 8.9. Built without it (an older compiler,
// or the sm_80 image of the library) the kernel traps instead of returning zeros, and the launcher refuses
// before launching (kMmaCompiled, the kernel image's binary version).
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
constexpr bool kMmaCompiled = true;
#else
constexpr bool kMmaCompiled = false;
#endif

__device__ __forceinline__ void mma_e4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

struct Plan {
  int tiles = 0;    // blocks along N (128 weight rows each)
  int splits = 1;   // blocks along K
  int k_chunk = 0;  // k per split (a multiple of 64; the last split may hold less)
};

Plan make_plan(int n, int k, int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    cudaGetLastError();
    sms = 108;
  }
  Plan p;
  p.tiles = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  const int steps = k / kKStep;
  int s = (2 * sms) / p.tiles;  // at most two blocks per SM: one wave (a second, partial one would run on few SMs)
  s = std::max(1, std::min(s, std::max(1, steps / kDepth)));  // at least one stage of k per split
  const int chunk_steps = (steps + s - 1) / s;
  p.splits = (steps + chunk_steps - 1) / chunk_steps;  // no empty split
  p.k_chunk = chunk_steps * kKStep;
  return p;
}

size_t counter_bytes(int tiles) {
  return (static_cast<size_t>(tiles) * sizeof(int) + kCounterAlign - 1) / kCounterAlign * kCounterAlign;
}

template <int NT>  // NT tiles of 8 tokens (M <= 8 * NT)
__global__ void __launch_bounds__(kThreads, NT <= 4 ? 2 : 1)
    fp8_gemm_kernel(Fp8GemmArgs a, int k_chunk, int splits, int* counters, float* partial) {
  __shared__ __align__(16) uint8_t xs[NT * 8][kXStride];
  __shared__ int finisher;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, split = blockIdx.y;
  const int r0 = tile * kRowsPerBlock + warp * 16;
  const bool live = r0 < a.n;  // N is a multiple of 16: a warp's rows are all in or all out
  const int64_t K = a.k;
  const int kb = split * k_chunk, ke = min(a.k, kb + k_chunk);
  const uint8_t* wlo = a.w + static_cast<int64_t>(live ? r0 + g : 0) * K + 16 * t;
  const uint8_t* whi = wlo + 8 * K;

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  uint4 wl[kDepth], wh[kDepth];
  auto load_weights = [&](int k0, int steps) {  // streamed: every weight byte is read once
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (live && d < steps) {
        wl[d] = __ldcs(reinterpret_cast<const uint4*>(wlo + k0 + d * kKStep));
        wh[d] = __ldcs(reinterpret_cast<const uint4*>(whi + k0 + d * kKStep));
      }
    }
  };
  int k0 = kb;
  int steps = min(kDepth, (ke - k0) / kKStep);
  load_weights(k0, steps);
  while (k0 < ke) {
    // This stage's activations (rows past M are zeros), 16 bytes per thread and pass.
    const int per_row = steps * (kKStep / 16);
    for (int c = threadIdx.x; c < NT * 8 * per_row; c += kThreads) {
      const int row = c / per_row, col = (c % per_row) * 16;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row < a.m) v = __ldg(reinterpret_cast<const uint4*>(a.x + row * K + k0 + col));
      *reinterpret_cast<uint4*>(&xs[row][col]) = v;
    }
    __syncthreads();
    uint4 cl[kDepth], ch[kDepth];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      cl[d] = wl[d];
      ch[d] = wh[d];
    }
    const int next = k0 + steps * kKStep;
    const int next_steps = min(kDepth, (ke - next) / kKStep);
    if (next < ke) load_weights(next, next_steps);  // in flight while this stage multiplies
    if (live) {
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        if (d < steps) {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint4 xv = *reinterpret_cast<const uint4*>(&xs[nt * 8 + g][d * kKStep + 16 * t]);
            mma_e4m3(acc[nt], cl[d].x, ch[d].x, cl[d].y, ch[d].y, xv.x, xv.y);
            mma_e4m3(acc[nt], cl[d].z, ch[d].z, cl[d].w, ch[d].w, xv.z, xv.w);
          }
        }
      }
    }
    __syncthreads();  // before the next stage overwrites xs
    k0 = next;
    steps = next_steps;
  }

  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out);
  if (splits == 1) {
    if (!live) return;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = nt * 8 + 2 * t + (i & 1), row = r0 + g + (i >= 2 ? 8 : 0);
        if (tok < a.m)
          out[static_cast<int64_t>(tok) * a.n + row] =
              __float2bfloat16_rn((0.f + acc[nt][i]) * a.x_scale[tok] * a.w_scale[row]);
      }
    return;
  }
  if (live) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = nt * 8 + 2 * t + (i & 1), row = r0 + g + (i >= 2 ? 8 : 0);
        if (tok < a.m) __stcg(&partial[(static_cast<int64_t>(split) * a.m + tok) * a.n + row], acc[nt][i]);
      }
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
  const int row0 = tile * kRowsPerBlock, rows = min(kRowsPerBlock, a.n - row0), total = a.m * rows;
  for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * kGroup) {
    int64_t at[kGroup];
    float s[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const int e = min(e0 + j * kThreads, total - 1);
      at[j] = static_cast<int64_t>(e / rows) * a.n + row0 + e % rows;
      s[j] = 0.f;
    }
    for (int sp = 0; sp < splits; ++sp) {
      const float* base = partial + static_cast<int64_t>(sp) * a.m * a.n;
#pragma unroll
      for (int j = 0; j < kGroup; ++j) s[j] += __ldcg(base + at[j]);
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const int e = e0 + j * kThreads;
      if (e < total) {
        const int tok = e / rows, row = row0 + e % rows;
        out[at[j]] = __float2bfloat16_rn(s[j] * a.x_scale[tok] * a.w_scale[row]);
      }
    }
  }
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
  if (a.x == nullptr || a.w == nullptr || a.x_scale == nullptr || a.w_scale == nullptr || a.out == nullptr)
    return "fp8_gemm: null pointer";
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  // The kernel image this device runs must carry the MMA (an sm_80 image on an sm_89 device would not).
  cudaFuncAttributes fa{};
  e = cudaFuncGetAttributes(&fa, fp8_gemm_kernel<1>);
  const char* refusal = nullptr;
  const Plan p = make_plan(a.n, a.k, device);
  const size_t need = p.splits == 1 ? 0 : counter_bytes(p.tiles) + static_cast<size_t>(p.splits) * a.m * a.n * sizeof(float);
  if (e != cudaSuccess) refusal = cudaGetErrorString(e);
  else if (!kMmaCompiled) refusal = "fp8_gemm: built by a CUDA compiler older than 12.4 (no e4m3 MMA)";
  else if (fa.binaryVersion < 89) refusal = "fp8_gemm: needs FP8 tensor cores (compute capability 8.9 or higher)";
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
    const dim3 grid(static_cast<unsigned>(p.tiles), static_cast<unsigned>(p.splits)), block(kThreads);
    if (a.m <= 8) fp8_gemm_kernel<1><<<grid, block, 0, s>>>(a, p.k_chunk, p.splits, counters, partial);
    else if (a.m <= 16) fp8_gemm_kernel<2><<<grid, block, 0, s>>>(a, p.k_chunk, p.splits, counters, partial);
    else if (a.m <= 32) fp8_gemm_kernel<4><<<grid, block, 0, s>>>(a, p.k_chunk, p.splits, counters, partial);
    else fp8_gemm_kernel<8><<<grid, block, 0, s>>>(a, p.k_chunk, p.splits, counters, partial);
    e = cudaGetLastError();
  }
  if (prev != device) cudaSetDevice(prev);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace lorafleet
