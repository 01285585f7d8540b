// fp8_gemm_sm90 (see fp8_gemm_sm90.h): the unit-scale FP8 product of decode-sized steps on Hopper's
// `wgmma`, through CUTLASS's sm90 collectives (TMA loads into a multistage shared-memory ring, a producer
// warp and consumer warp groups).
//
// The operands are swapped: the kernel computes D' = W @ X^T with the weight W [N, K] as the MMA's M side
// (64 weight rows per tile, wgmma's native M) and the tokens X [M, K] as its narrow N side (16, 32 or 64
// per tile), so a decode step of 32 tokens does not pad 32 rows to a 64- or 128-row tile. D' [N, M] is
// written column-major, which is y [M, N] row-major: the layout the caller reads. The accumulation is
// promoted out of the tensor cores into fp32 registers once per k-tile of 256 (CUTLASS's non-"FastAccum" FP8
// schedule); inside a k-tile the tensor cores accumulate with fewer bits than fp32.
//
// With `splits` > 1 the K range is cut into equal parts, run as a batch (more tiles for the GPU where N alone
// gives fewer than its SMs: the 7B o and down weights have 64 row tiles for 132 SMs); part l's partial sums
// go to out[l], and the caller adds them in part order.
//
// A token's column of D' is the same whatever else is in the step: every tile shape here shares one k-tile
// (256) and the same order over K, and a column's sums involve no other column. The binding checks the
// alignment TMA needs (16-byte rows and base addresses).
//
// Without CUTLASS's headers (found through flashinfer at build time, runner/kernels.py) the entry points report
// that the kernel is not built; on a device other than compute capability 9.0 (whose machine code here is not
// sm_90a's) the launcher refuses with an error.
#include "fp8_gemm_sm90.h"

#if defined(LORAFLEET_CUTLASS) && __has_include(<cutlass/cutlass.h>)
#define LORAFLEET_SM90_GEMM 1
#endif

#ifdef LORAFLEET_SM90_GEMM
// CUTLASS's device-side asserts are calls that ptxas cannot inline, and a call inside the main loop makes it
// serialize every wgmma (warning C7510): this file is built without them.
#ifndef NDEBUG
#define NDEBUG
#endif
// Programmatic dependent launch: the kernel may start while the previous kernel drains (its producer waits for that
// kernel before the first load), and lets the next one (the FP8 epilogue) start after its main loop.
#define CUTLASS_ENABLE_GDC_FOR_SM90 1
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#endif

namespace lorafleet {

#ifdef LORAFLEET_SM90_GEMM
namespace {

using namespace cute;

template <int kTokens>
struct Sm90Fp8Gemm {
  using ElementA = cutlass::float_e4m3_t;  // W [N, K], K-major
  using LayoutA = cutlass::layout::RowMajor;
  using ElementB = cutlass::float_e4m3_t;  // X [M, K], K-major
  using LayoutB = cutlass::layout::ColumnMajor;
  using ElementD = float;                  // D' [N, M] column-major = y [M, N] row-major
  using LayoutD = cutlass::layout::ColumnMajor;
  using ElementAcc = float;
  static constexpr int kAlignAB = 16;  // 16 bytes of e4m3
  static constexpr int kAlignD = 4;    // 16 bytes of fp32

  static constexpr int kTileK = 256;
  // The accumulators leave the tensor cores for fp32 registers once per k-tile (every 8 wgmma of k = 32); CUTLASS
  // needs the interval to be a multiple of the wgmmas per k-tile.
  static constexpr uint32_t kPromotionInterval = kTileK / 32;
  using TileShape = Shape<_64, Int<kTokens>, Int<kTileK>>;
  using ClusterShape = Shape<_1, _1, _1>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD, kAlignD, ElementD,
      LayoutD, kAlignD, cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignAB, ElementB, LayoutB,
      kAlignAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecialized>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const Fp8Sm90Args& a) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    using StrideD = typename Gemm::GemmKernel::StrideD;
    const int n = a.n, m = a.m, k = a.k, s = a.splits, ks = a.k / a.splits;
    // K split into `s` equal ranges as a batch: range l of W and X starts at column l * ks (batch stride ks, rows
    // still k apart), its partial sums go to out[l] (batch stride m * n).
    StrideA sa = cutlass::make_cute_packed_stride(StrideA{}, {n, k, 1});
    StrideB sb = cutlass::make_cute_packed_stride(StrideB{}, {m, k, 1});
    cute::get<2>(sa) = ks;
    cute::get<2>(sb) = ks;
    const StrideD sd = cutlass::make_cute_packed_stride(StrideD{}, {n, m, s});
    typename Gemm::Arguments args{
        s > 1 ? cutlass::gemm::GemmUniversalMode::kBatched : cutlass::gemm::GemmUniversalMode::kGemm,
        {n, m, ks, s},
        {reinterpret_cast<const ElementA*>(a.w), sa, reinterpret_cast<const ElementB*>(a.x), sb, kPromotionInterval},
        // alpha and beta as values: with programmatic dependent launch only the producer warp waits for the kernel
        // before, and the consumers would read device-side alpha / beta pointers before that wait.
        {{1.0f, 0.0f}, nullptr, sd, a.out, sd}};
    return args;
  }

  static const char* run(const Fp8Sm90Args& a, void* stream) {
    const typename Gemm::Arguments args = arguments(a);
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "fp8_gemm_sm90: CUTLASS cannot run these sizes";
    if (Gemm::get_workspace_size(args) != 0) return "fp8_gemm_sm90: unexpected workspace";
    if (gemm.initialize(args, nullptr, static_cast<cudaStream_t>(stream)) != cutlass::Status::kSuccess)
      return "fp8_gemm_sm90: CUTLASS initialization failed";
    if (gemm.run(static_cast<cudaStream_t>(stream), nullptr, a.pdl) != cutlass::Status::kSuccess)
      return "fp8_gemm_sm90: launch failed";
    return nullptr;
  }
};

}  // namespace

bool fp8_gemm_sm90_built() { return true; }

const char* fp8_gemm_sm90(const Fp8Sm90Args& a, void* stream) {
  if (a.m <= 0 || a.m > kFp8Sm90MaxRows || a.n <= 0 || a.k <= 0) return "fp8_gemm_sm90: sizes out of range";
  if (a.splits < 1 || a.k % (16 * a.splits) != 0 || a.n % 4 != 0)
    return "fp8_gemm_sm90: K must be a multiple of 16 * splits and N of 4";
  if (a.device < 0) return "fp8_gemm_sm90: no device given";
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess && prev != a.device) e = cudaSetDevice(a.device);
  int major = 0, minor = 0;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, a.device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, a.device);
  const char* err = e != cudaSuccess ? cudaGetErrorString(e)
                    : major != 9 || minor != 0 ? "fp8_gemm_sm90: needs a compute capability 9.0 GPU"
                    : a.m <= 16 ? Sm90Fp8Gemm<16>::run(a, stream)
                    : a.m <= 32 ? Sm90Fp8Gemm<32>::run(a, stream)
                                : Sm90Fp8Gemm<64>::run(a, stream);
  if (prev >= 0 && prev != a.device) cudaSetDevice(prev);
  if (e != cudaSuccess) cudaGetLastError();  // reported here, not left for the next unrelated check
  return err;
}

#else

bool fp8_gemm_sm90_built() { return false; }

const char* fp8_gemm_sm90(const Fp8Sm90Args&, void*) {
  return "fp8_gemm_sm90: not built (needs CUTLASS's headers, found through flashinfer, and sm_90a)";
}

#endif

}  // namespace lorafleet
