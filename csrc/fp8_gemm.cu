// fp8_gemm (see fp8_gemm.h). Fragment layouts of mma.sync.m16n8k32 with 8-bit operands (PTX ISA): lane =
// 4 * g + t; A (16 x 32, row-major): register 0 holds row g, k 4t..4t+3; 1: row g + 8, same k; 2: row g,
// k 16+4t..; 3: row g + 8, k 16+4t..; B (32 x 8, column-major): register 0 holds k 4t..4t+3 of column g,
// 1: k 16+4t..; C (16 x 8 fp32): c0, c1 row g, columns 2t, 2t+1; c2, c3 row g + 8.
//
// A is the weight (16 of its rows), B the activations (8 tokens per tile). A dot product does not depend
// on the order of k, so each lane loads 16 contiguous bytes of its rows (k0 + 16t .. k0 + 16t + 15) and
// hands bytes 0-7 to one mma and 8-15 to the next: the k-slot -> k map is the same for A and B, and one
// warp covers 64 consecutive k per step with 64-byte runs per weight row.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "fp8_gemm.h"

namespace lorafleet {
namespace {

constexpr int kWarps = 8;
constexpr int kKStep = 64;  // k per warp step

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

template <int NT, int MT>  // NT tiles of 8 tokens (M <= 8 * NT); MT tiles of 16 weight rows per block
__global__ void __launch_bounds__(kWarps * 32) fp8_gemm_kernel(Fp8GemmArgs a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 16 * MT;
  const int64_t K = a.k;
  const uint8_t* w_lo[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) w_lo[mt] = a.w + (n0 + 16 * mt + g) * K + 16 * t;
  const uint8_t* xs[NT];
  bool live[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = nt * 8 + g;
    live[nt] = tok < a.m;
    xs[nt] = a.x + (live[nt] ? tok : 0) * K + 16 * t;
  }
  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
#pragma unroll 2
  for (int64_t k0 = static_cast<int64_t>(warp) * kKStep; k0 < K; k0 += kWarps * kKStep) {
    uint4 wl[MT], wh[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {  // streamed: every weight byte is read once
      wl[mt] = __ldcs(reinterpret_cast<const uint4*>(w_lo[mt] + k0));
      wh[mt] = __ldcs(reinterpret_cast<const uint4*>(w_lo[mt] + 8 * K + k0));
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint4 xv = live[nt] ? __ldg(reinterpret_cast<const uint4*>(xs[nt] + k0)) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_e4m3(acc[mt][nt], wl[mt].x, wh[mt].x, wl[mt].y, wh[mt].y, xv.x, xv.y);
        mma_e4m3(acc[mt][nt], wl[mt].z, wh[mt].z, wl[mt].w, wh[mt].w, xv.z, xv.w);
      }
    }
  }
  constexpr int kTile = NT * 128;  // fp32 partial sums of one 16-row tile per warp
  __shared__ __align__(16) float part[kWarps][MT * kTile];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      *reinterpret_cast<float4*>(&part[warp][mt * kTile + nt * 128 + lane * 4]) =
          make_float4(acc[mt][nt][0], acc[mt][nt][1], acc[mt][nt][2], acc[mt][nt][3]);
  __syncthreads();
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out);
  for (int e = threadIdx.x; e < MT * kTile; e += kWarps * 32) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += part[w][e];
    const int mt = e / kTile, r = e % kTile;
    const int nt = r >> 7, l = (r >> 2) & 31, i = r & 3;
    const int row = n0 + 16 * mt + (l >> 2) + (i >= 2 ? 8 : 0);
    const int tok = nt * 8 + 2 * (l & 3) + (i & 1);
    if (tok < a.m) out[static_cast<int64_t>(tok) * a.n + row] = __float2bfloat16_rn(s * a.x_scale[tok] * a.w_scale[row]);
  }
}

}  // namespace

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
  e = cudaFuncGetAttributes(&fa, fp8_gemm_kernel<1, 1>);
  const char* refusal = nullptr;
  if (e != cudaSuccess) refusal = cudaGetErrorString(e);
  else if (!kMmaCompiled) refusal = "fp8_gemm: built by a CUDA compiler older than 12.4 (no e4m3 MMA)";
  else if (fa.binaryVersion < 89) refusal = "fp8_gemm: needs FP8 tensor cores (compute capability 8.9 or higher)";
  if (refusal != nullptr) {
    if (prev != device) cudaSetDevice(prev);
    return refusal;
  }
  auto s = static_cast<cudaStream_t>(stream);
  // Two 16-row tiles per block where the weight has rows enough for >= 256 blocks (activations are read once
  // per block, so wider blocks read them less often per weight byte); at most 32 tokens then (shared memory).
  const bool wide = a.n % 32 == 0 && a.n >= 8192 && a.m <= 32;
  const dim3 grid(static_cast<unsigned>(a.n / (wide ? 32 : 16))), block(kWarps * 32);
  if (wide) {
    if (a.m <= 8) fp8_gemm_kernel<1, 2><<<grid, block, 0, s>>>(a);
    else if (a.m <= 16) fp8_gemm_kernel<2, 2><<<grid, block, 0, s>>>(a);
    else fp8_gemm_kernel<4, 2><<<grid, block, 0, s>>>(a);
  } else if (a.m <= 8) fp8_gemm_kernel<1, 1><<<grid, block, 0, s>>>(a);
  else if (a.m <= 16) fp8_gemm_kernel<2, 1><<<grid, block, 0, s>>>(a);
  else if (a.m <= 32) fp8_gemm_kernel<4, 1><<<grid, block, 0, s>>>(a);
  else fp8_gemm_kernel<8, 1><<<grid, block, 0, s>>>(a);
  e = cudaGetLastError();
  if (prev != device) cudaSetDevice(prev);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace lorafleet
