// sm90_gemm.cuh: the kernels behind fp8_gemm_sm90.h, shared by fp8_gemm_sm90.cu (the e4m3 operands and the
// entry points) and fp8_gemm_sm90_bf16.cu (the bf16 operands), so that the two halves compile side by side.
//
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
// With bf16 operands (Fp8Sm90Args::bf16) the same kernels run CUTLASS's plain sm90 collective: a k-tile of 128
// elements (256 bytes, as with e4m3), the tensor cores accumulating in fp32 throughout.
//
// A token's column of D' is the same whatever else is in the step: every tile shape here shares one k-tile
// (256) and the same order over K, and a column's sums involve no other column. The binding checks the
// alignment TMA needs (16-byte rows and base addresses).
//
// Without CUTLASS's headers (found through flashinfer at build time, runner/kernels.py) the entry points report
// that the kernel is not built; on a device other than compute capability 9.0 (whose machine code here is not
// sm_90a's) the launcher refuses with an error.
#pragma once

#include "fp8_gemm_sm90.h"

#include "quant.h"

#if defined(LORAFLEET_CUTLASS) && __has_include(<cutlass/cutlass.h>)
#define LORAFLEET_SM90_GEMM 1
#endif

#ifdef LORAFLEET_SM90_GEMM
// CUTLASS's device-side asserts are calls that ptxas cannot inline, and a call inside the main loop makes it
// serialize every wgmma (warning C7510): this file is built without them.
#ifndef NDEBUG
#define NDEBUG
#endif
// Programmatic dependent launch, done here rather than by CUTLASS's kernels (CUTLASS_ENABLE_GDC_FOR_SM90 stays
// undefined, so their own waits and triggers compile to nothing): the kernel may start while the kernel before it
// still runs, and its producer fills the pipeline's stages with the weight's first k-tiles before it waits for that
// kernel (WeightFirstMainloop); every consumer warp group lets the next kernel start after its last MMA (the FP8
// epilogue's launch, or, with the epilogue inside, whatever follows: see fp8_gemm_sm90.h), and the fused epilogue
// waits for the kernel before it before its own reads.
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/epilogue/collective/detail.hpp"

#include "fp8_epilogue.cuh"
#include "pdl.h"
#endif

namespace lorafleet {

#ifdef LORAFLEET_SM90_GEMM
namespace {

using namespace cute;

// One CUTLASS GEMM's checks and launch on `stream` (no workspace); nullptr on success.
template <class Gemm>
const char* launch(const typename Gemm::Arguments& args, bool pdl, void* stream) {
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    return "fp8_gemm_sm90(_fused): CUTLASS cannot run these sizes";
  if (Gemm::get_workspace_size(args) != 0) return "fp8_gemm_sm90(_fused): unexpected workspace";
  if (gemm.initialize(args, nullptr, static_cast<cudaStream_t>(stream)) != cutlass::Status::kSuccess)
    return "fp8_gemm_sm90(_fused): CUTLASS initialization failed";
  if (gemm.run(static_cast<cudaStream_t>(stream), nullptr, pdl) != cutlass::Status::kSuccess)
    return "fp8_gemm_sm90(_fused): launch failed";
  return nullptr;
}

// The rows' LoRA shrink on a product's own consumer warps (Fp8EpilogueLora::sync), before their main loop: v for the
// epilogue inside the same kernel (FusedEpilogue, kShrink) or for the FP8 epilogue's launch after it
// (ShrinkFirstMainloop). T: x's and A's element (bf16).
template <typename T>
struct RowShrink {
  // Output (row i, span g, rank row k) is a dot product of x's row
  // i and A's rank row k of span g for the row's slot; the row's outputs are numbered q = g * a_rank_max + k. Ticket t
  // holds rank rows [b * per, (b + 1) * per) of row t / blocks, b = t % blocks (per = shrink_per, blocks the row's
  // outputs over per, rounded up): the launcher makes the tickets at most as many as the consumer warps of one CTA
  // per SM, so that they spread over the first wave. Each consumer warp takes one ticket from the call site's first
  // counter as it starts (shrink_rows) and does its work before the main loop; an epilogue that finds work
  // unfinished first takes the tickets still untaken and does them itself (drain_shrink), and only then waits: every
  // ticket it waits for is held by a warp that runs and waits for nothing but the kernel before, however few SMs the
  // grid gets. Lane j sums its 8-element vectors j, j + 32, ... in order, then the warp's xor tree: the same bits
  // whichever warp takes the output and however many it takes at once, and a row's v depends on its own x and A only.
  __device__ static const T* shrink_a(const Fp8EpilogueArgs& a, int row, int q, int& g, int& k) {
    const Fp8EpilogueLora& l = a.lora;
    g = q / l.a_rank_max;
    k = q - g * l.a_rank_max;
    const int rank_dim = g == 0 ? l.a_rank_dim[0] : g == 1 ? l.a_rank_dim[1] : l.a_rank_dim[2];
    const int s = fp8_epi::lora_slot(l, row);
    if (s < 0 || k >= rank_dim || k >= fp8_epi::slot_rank(l, s, g)) return nullptr;
    const void* ag = g == 0 ? l.a[0] : g == 1 ? l.a[1] : l.a[2];
    return static_cast<const T*>(ag) + (static_cast<int64_t>(s) * rank_dim + k) * l.k;
  }

  // The warps of a CTA that take tickets: the producer warp group's three that issue no copies (warps 1-3: the
  // mainloop's copies are warp 0's, CUTLASS's one-CTA-a-tile kernel gives the others no role), which then run beside
  // the main loop (Fp8EpilogueLora::shrink_producer), else the consumer warp group's four, before their main loop.
  static constexpr int kProducerWarps = 3;
  __device__ static bool takes_tickets(const Fp8EpilogueLora& l) {
    return l.shrink_producer ? threadIdx.x >= 32 && threadIdx.x < cutlass::NumThreadsPerWarpGroup
                             : threadIdx.x >= cutlass::NumThreadsPerWarpGroup;
  }

  // The warp's next ticket (the first counter; every lane gets it).
  __device__ static unsigned take_ticket(const Fp8EpilogueLora& l) {
    unsigned ticket = 0;
    if ((threadIdx.x & 31) == 0) ticket = atomicAdd(l.sync, 1u);
    return __shfl_sync(0xffffffffu, ticket, 0);
  }

  // Ticket `ticket`'s outputs into v, then the warp's count in the second counter: P outputs at a time, which share
  // x's row, U vectors of each in flight per lane, so that one round trip to memory serves P * U vectors of A.
  // `waited`: the wait for the kernel before is behind; else the ticket's A rows are asked of L2 and the first
  // vectors of A loaded before that wait (no kernel writes A or the tables within a step), x's only after it.
  // (P = 3, U = 8 before the main loop; 1 and 1 in the epilogue, where more would go to the stack.)
  template <int P, int U, bool kCount = true>
  __device__ static void shrink_ticket(const Fp8EpilogueArgs& a, int ticket, bool waited) {
    const Fp8EpilogueLora& l = a.lora;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const int vecs = l.k / 8, per_row = a.num_groups * l.a_rank_max, per = l.shrink_per;
    const int blocks = (per_row + per - 1) / per, row = ticket / blocks;
    const int first = (ticket - row * blocks) * per, last = min(first + per, per_row);
    const T* xp = static_cast<const T*>(l.x) + static_cast<int64_t>(row) * l.k;
    if (!waited) {
      for (int q = first; q < last; ++q) {
        int g, k;
        const T* ap = shrink_a(a, row, q, g, k);
        if (ap != nullptr)
          for (int j = lane + (q < first + P ? U * 32 : 0); j < vecs; j += 32)  // (the first P: U loaded below)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(ap + j * 8));
      }
    }
    for (int q0 = first; q0 < last; q0 += P) {
      const T* ap[P];
      int g[P], k[P];
      bool any = false;
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < P; ++p) {
        ap[p] = q0 + p < last ? shrink_a(a, row, q0 + p, g[p], k[p]) : nullptr;
        any = any || ap[p] != nullptr;
      }
      float acc[P];
      uint4 av[P][U], xv[U];
      auto load_a = [&](int j0) {
        CUTLASS_PRAGMA_UNROLL
        for (int p = 0; p < P; ++p)
          CUTLASS_PRAGMA_UNROLL
          for (int u = 0; u < U; ++u) {
            const int j = j0 + u * 32;
            av[p][u] = ap[p] != nullptr && j < vecs ? __ldg(reinterpret_cast<const uint4*>(ap[p] + j * 8))
                                                    : make_uint4(0, 0, 0, 0);
          }
      };
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < P; ++p) acc[p] = 0.f;
      if (any) load_a(lane);
      if (!waited && q0 == first) pdl_wait();  // x comes from the kernel before (every lane, with or without work)
      if (!any) continue;
      for (int j0 = lane; j0 < vecs; j0 += U * 32) {
        if (j0 != lane) load_a(j0);
        CUTLASS_PRAGMA_UNROLL
        for (int u = 0; u < U; ++u) {
          const int j = j0 + u * 32;
          xv[u] = j < vecs ? __ldcg(reinterpret_cast<const uint4*>(xp + j * 8)) : make_uint4(0, 0, 0, 0);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int u = 0; u < U; ++u) {
          if (j0 + u * 32 < vecs) {
            float xf[8];
            unpack8<T>(xv[u], xf);
            CUTLASS_PRAGMA_UNROLL
            for (int p = 0; p < P; ++p) {
              float af[8];
              unpack8<T>(av[p][u], af);
              CUTLASS_PRAGMA_UNROLL
              for (int e = 0; e < 8; ++e) acc[p] = fmaf(xf[e], af[e], acc[p]);
            }
          }
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < P; ++p) {
        CUTLASS_PRAGMA_UNROLL
        for (int off = 16; off > 0; off >>= 1) acc[p] += __shfl_xor_sync(0xffffffffu, acc[p], off);
        if (lane == 0 && ap[p] != nullptr) const_cast<float*>(fp8_epi::lora_v(l, row, g[p]))[k[p]] = acc[p];
      }
    }
    if constexpr (kCount) {
      __syncwarp();
      if (lane == 0) {
        __threadfence();  // this warp's v before its count
        atomicAdd(l.sync + 1, 1u);
      }
    }
  }

  // Before the main loop: tickets while they last (one each where the launcher could make them no more than the
  // warps; where the rows alone outnumber the warps, a small grid's, the warps take the rest too, rather than leave
  // them to the epilogues' one-vector-at-a-time drain).
  // With shrink_producer, the warp's exit (its last draw behind it) is then counted in the fourth counter, which the
  // launch's last epilogue waits for before it zeroes the counters (FusedEpilogue::count_out): a producer warp's draws
  // are not ordered before any epilogue otherwise.
  __device__ static void shrink_rows(const Fp8EpilogueArgs& a) {
    const unsigned all = static_cast<unsigned>(a.lora.shrink_tickets);
    bool waited = false;
    for (unsigned t = take_ticket(a.lora); t < all; t = take_ticket(a.lora), waited = true)
      shrink_ticket<3, 8>(a, static_cast<int>(t), waited);
    if (a.lora.shrink_producer && (threadIdx.x & 31) == 0) {
      __threadfence();  // (the draw past the tickets before the exit's count)
      atomicAdd(a.lora.sync + 3, 1u);
    }
  }

  // The whole shrink on the product's consumer warps, for a launch whose v only the next kernel reads
  // (ShrinkFirstMainloop): every consumer warp takes tickets until none is left, with no counts (the next kernel's
  // wait for this one's end orders v), and the warp whose draw is the launch's last (each consumer warp draws once
  // past the tickets: `warps` draws past them in all) zeroes the first counter for the next launch.
  __device__ static void alone(const Fp8EpilogueArgs& a, unsigned warps) {
    const unsigned all = static_cast<unsigned>(a.lora.shrink_tickets);
    bool waited = false;
    unsigned t = take_ticket(a.lora);
    for (; t < all; t = take_ticket(a.lora), waited = true) shrink_ticket<3, 8, false>(a, static_cast<int>(t), waited);
    if ((threadIdx.x & 31) == 0 && t == all + warps - 1) atomicExch(a.lora.sync, 0u);
  }
};

// A CUTLASS sm90 TMA mainloop (one CTA per cluster) whose producer asks for the weight's (A's) first k-tiles, as
// many as the pipeline has stages, before it waits for the kernel before this one, and for the activations' (B's)
// tiles only after that wait: the weight is never written within a step, the activations are (by that kernel: the
// quantization, the LoRA shrink or the norm), and each stage's barrier expects both tiles' bytes, so a consumer
// starts on a stage only once its activations' tile has landed too. The kernel before lets this one start early
// (its griddepcontrol.launch_dependents), so the weight streams in while it runs. The consumers' trigger for the
// next kernel follows their last MMA (mma_tail). The tiles, stages, barriers and MMAs are the collective's own:
// the same sums as without it.
template <class Base>
struct WeightFirstMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  static_assert(cute::size(typename Base::DispatchPolicy::ClusterShape{}) == 1, "one CTA per cluster: no multicast");

  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState state,
                           cute::tuple<TensorA, TensorB> const& inputs, BlockCoord const& blk, KTileIterator k_tile,
                           int k_tiles, int, uint32_t, TensorStorage& storage) {
    using namespace cute;
    if (!elect_one_sync()) return;  // one lane of the producer warp issues every copy
    Tensor sA = make_tensor(make_smem_ptr(storage.smem_A.data()), typename Base::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(storage.smem_B.data()), typename Base::SmemLayoutB{});
    auto tma_a = params.tma_load_a.get_slice(0);
    auto tma_b = params.tma_load_b.get_slice(0);
    auto [m, n, k, l] = blk;
    Tensor gA = tma_a.partition_S(get<0>(inputs)(_, _, m, _, l));  // (TMA, TMA_M, TMA_K, k)
    Tensor sA_ = tma_a.partition_D(sA);                             // (TMA, TMA_M, TMA_K, stage)
    Tensor gB = tma_b.partition_S(get<1>(inputs)(_, _, n, _, l));
    Tensor sB_ = tma_b.partition_D(sB);
    using Barrier = typename MainloopPipeline::ProducerBarrierType;
    const int early = min(k_tiles, Base::DispatchPolicy::Stages);
    PipelineState w_state = state;
    KTileIterator w_tile = k_tile;
    for (int i = 0; i < early; ++i, ++w_tile, ++w_state) {  // the weight's first k-tiles, one stage each
      pipeline.producer_acquire(w_state);
      Barrier* bar = pipeline.producer_get_barrier(w_state);
      copy(params.tma_load_a.with(*bar, uint16_t(0)), gA(_, _, _, *w_tile), sA_(_, _, _, w_state.index()));
    }
    pdl_wait();  // the activations come from the kernel before
    for (int i = 0; i < k_tiles; ++i, ++k_tile, ++state) {
      if (i >= early) pipeline.producer_acquire(state);
      Barrier* bar = pipeline.producer_get_barrier(state);
      if (i >= early)
        copy(params.tma_load_a.with(*bar, uint16_t(0)), gA(_, _, _, *k_tile), sA_(_, _, _, state.index()));
      copy(params.tma_load_b.with(*bar, uint16_t(0)), gB(_, _, _, *k_tile), sB_(_, _, _, state.index()));
    }
  }

  CUTLASS_DEVICE void mma_tail(MainloopPipeline pipeline, PipelineState release, int k_tiles) {
    Base::mma_tail(pipeline, release, k_tiles);
    pdl_launch_dependents();
  }
};

// WeightFirstMainloop whose consumer warps first compute the rows' LoRA shrink into v (RowShrink::alone), then run the
// main loop: the FP8 product of a decode step whose epilogue is the FP8 epilogue's launch after it, which reads v
// once its wait for this kernel's end returns. The producer has then already filled every stage with the weight's
// first k-tiles. With Fp8EpilogueLora::shrink_producer the producer warp group's warps 1-3 take the tickets instead,
// in load_init (which every thread of the CTA runs before the roles part), beside the consumers' main loop. Arguments
// and Params carry the shrink's (Fp8EpilogueArgs: num_groups and lora, whose sync is nullptr for a launch without
// it).
template <class Base, typename T>
struct ShrinkFirstMainloop : WeightFirstMainloop<Base> {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  struct Arguments : Base::Arguments {
    Fp8EpilogueArgs shrink;
  };
  struct Params : Base::Params {
    Fp8EpilogueArgs shrink;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem, args, workspace);
    p.shrink = args.shrink;
    return p;
  }

  template <class ProblemShape>
  CUTLASS_DEVICE auto load_init(ProblemShape const& problem, Params const& params) const {
    const Fp8EpilogueLora& l = params.shrink.lora;
    if (l.sync != nullptr && l.shrink_producer && RowShrink<T>::takes_tickets(l))  // (each such warp draws once past)
      RowShrink<T>::alone(params.shrink, RowShrink<T>::kProducerWarps * gridDim.x * gridDim.y * gridDim.z);
    return Base::load_init(problem, params);
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState read, FrgTensorC& accum, int k_tiles,
                          int thread_idx, TensorStorage& storage, Params const& params) {
    if (params.shrink.lora.sync != nullptr && !params.shrink.lora.shrink_producer) {
      // (every consumer warp of the grid draws once past the tickets)
      const unsigned warps = (blockDim.x - cutlass::NumThreadsPerWarpGroup) / 32 * gridDim.x * gridDim.y * gridDim.z;
      RowShrink<T>::alone(params.shrink, warps);
    }
    Base::mma(pipeline, read, accum, k_tiles, thread_idx, storage, params);
  }
};

// kPersistent: CUTLASS's persistent ping-pong schedule (one CTA per SM walks the tiles; two consumer warp groups
// take alternate tiles, so one's epilogue runs while the producer already loads the other's k-tiles) instead of one
// CTA per tile. The same mainloop collective: each tile's k-tiles in the same order, the same promotions.
// E: the operands' element, e4m3 (CUTLASS's FP8 collective, with its promotions) or bf16 (its plain collective: the
// tensor cores accumulate in fp32 throughout); a k-tile is 256 bytes of a row either way.
// kShrink (one CTA a tile): the rows' LoRA shrink on the consumer warps before their main loop, or on the producer's
// warps beside it (ShrinkFirstMainloop), given by run's `shrink`; x's bf16 rows are the operand itself with bf16
// operands, the shrink's lora.x with e4m3 ones.
template <int kTokens, bool kPersistent = false, class E = cutlass::float_e4m3_t, bool kShrink = false>
struct Sm90Gemm {
  static_assert(!kShrink || !kPersistent, "the shrink first: one CTA a tile");
  using ElementA = E;  // W [N, K], K-major
  using LayoutA = cutlass::layout::RowMajor;
  using ElementB = E;  // X [M, K], K-major
  using LayoutB = cutlass::layout::ColumnMajor;
  using ElementD = float;                  // D' [N, M] column-major = y [M, N] row-major
  using LayoutD = cutlass::layout::ColumnMajor;
  using ElementAcc = float;
  static constexpr int kAlignAB = 16 / static_cast<int>(sizeof(E));  // 16 bytes
  static constexpr int kAlignD = 4;    // 16 bytes of fp32

  static constexpr int kTileK = 256 / static_cast<int>(sizeof(E));
  // FP8: the accumulators leave the tensor cores for fp32 registers once per k-tile (every 8 wgmma of k = 32);
  // CUTLASS needs the interval to be a multiple of the wgmmas per k-tile. bf16: not read by the collective.
  static constexpr uint32_t kPromotionInterval = sizeof(E) == 1 ? kTileK / 32 : 4;
  using TileShape = Shape<_64, Int<kTokens>, Int<kTileK>>;
  using ClusterShape = Shape<_1, _1, _1>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD, kAlignD, ElementD,
      LayoutD, kAlignD, cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;

  using MainloopBase = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignAB, ElementB, LayoutB,
      kAlignAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      std::conditional_t<kPersistent, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelTmaWarpSpecialized>>::CollectiveOp;
  using Mainloop = std::conditional_t<kShrink, ShrinkFirstMainloop<MainloopBase, __nv_bfloat16>,
                                      WeightFirstMainloop<MainloopBase>>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const Fp8Sm90Args& a, int sm_count = 0,
                                            const Fp8EpilogueArgs* shrink = nullptr) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    using StrideD = typename Gemm::GemmKernel::StrideD;
    const int n = a.n, m = a.m, k = a.k, s = a.splits, ks = a.k / a.splits;
    // K split into `s` equal ranges as a batch: range l of W and X starts at column l * ks (batch stride ks, rows
    // still w_ld and k apart), its partial sums go to out[l] (batch stride m * n).
    StrideA sa = cutlass::make_cute_packed_stride(StrideA{}, {n, k, 1});
    StrideB sb = cutlass::make_cute_packed_stride(StrideB{}, {m, k, 1});
    cute::get<0>(sa) = a.w_ld > 0 ? a.w_ld : k;
    cute::get<2>(sa) = ks;
    cute::get<2>(sb) = ks;
    const StrideD sd = cutlass::make_cute_packed_stride(StrideD{}, {n, m, s});
    typename Mainloop::Arguments mainloop{};
    static_cast<typename MainloopBase::Arguments&>(mainloop) = typename MainloopBase::Arguments{
        reinterpret_cast<const ElementA*>(a.w), sa, reinterpret_cast<const ElementB*>(a.x), sb, kPromotionInterval};
    if constexpr (kShrink) {
      if (shrink != nullptr) mainloop.shrink = *shrink;
    }
    typename Gemm::Arguments args{
        s > 1 ? cutlass::gemm::GemmUniversalMode::kBatched : cutlass::gemm::GemmUniversalMode::kGemm,
        {n, m, ks, s},
        mainloop,
        // alpha and beta as values: with programmatic dependent launch only the producer warp waits for the kernel
        // before, and the consumers would read device-side alpha / beta pointers before that wait.
        {{1.0f, 0.0f}, nullptr, sd, a.out, sd}};
    // the persistent schedule's grid: one CTA per SM (the count given, read once per device by the caller)
    args.hw_info.device_id = a.device;
    args.hw_info.sm_count = sm_count;
    return args;
  }

  static const char* run(const Fp8Sm90Args& a, void* stream, int sm_count = 0,
                         const Fp8EpilogueArgs* shrink = nullptr) {
    return launch<Gemm>(arguments(a, sm_count, shrink), a.pdl, stream);
  }
};

// The fused epilogue (fp8_gemm_sm90_fused): the FP8 epilogue of quant.h (scales, bias, the rows' LoRA expand) on the
// tile's accumulators, inside the product's kernel. The consumer warp group (128 threads) puts its fp32 sums into
// shared memory (the mainloop's, free after its last MMA), then each thread takes chunks of 8 weight rows of one
// token, as the separate epilogue's threads do, and runs fp8_epi::finish on them: the same bits as the product into
// fp32 followed by fp8_epilogue, without the fp32 round trip and the second launch. The row slots are loaded by the
// constructor, before the mainloop; everything else only after it (whose loads start after the producer's wait for
// the kernel before).
// kPairs: the thread's chunks in groups of two where it has two (at 32 tokens). With bf16 operands ptxas holds the
// consumers to 232 registers and puts two chunks' loads on the stack (208 bytes): one at a time there.
// kShrink (bf16 operands, Sm90GemmFused's): with
// Fp8EpilogueLora::sync the rows' LoRA shrink runs inside the kernel too (shrink_rows): the consumer warps compute v
// before their main loop (or the producer's warps 1-3 beside it), and every epilogue waits until all of v is written.
// kPersistent (e4m3 operands): in CUTLASS's persistent ping-pong kernel (one CTA per SM over the tiles, two consumer
// warp groups taking alternate tiles, a group's epilogue beside the other's main loop while the producer goes on
// loading): the tokens' tile is then the only one (the launcher's kTokens >= M). Not with kShrink: the bf16 products
// in that kernel, with the shrink as the second group's, measured slower (docs/benchmarks.md section 13.13).
template <typename T, int kTokens, bool kPairs = true, bool kShrink = false, bool kPersistent = false>
class FusedEpilogue {
 public:
  using EpilogueSchedule = cutlass::gemm::EpilogueDefault;
  using DispatchPolicy = EpilogueSchedule;
  struct ThreadEpilogueOp {};  // none: the whole epilogue is operator() below
  using ElementC = cutlass::bfloat16_t;  // nominal: there is no C, and D is written by operator()
  using ElementD = cutlass::bfloat16_t;
  using StrideC = cutlass::detail::TagToStrideC_t<cutlass::layout::ColumnMajor>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  static constexpr int kRows = 64;        // weight rows per tile
  static constexpr int kPitch = kRows + 4;  // fp32 per token in shared memory: the accumulator stores hit 32 banks
  struct SharedStorage {
    alignas(16) float tile[kTokens][kPitch];
  };
  using TensorStorage = SharedStorage;
  using Arguments = Fp8EpilogueArgs;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE
  explicit FusedEpilogue(Params const& params) : params_(params), grid_(&params) {
#if defined(__CUDA_ARCH__)
    // With LoRA, the consumer warp groups' threads (threadIdx.x 128 .. 255, and 256 .. 383 in the persistent kernel)
    // issue the loads of their chunks' row slots here, before the main loop, and first use them after it (the
    // persistent kernel's for every tile: the tokens' tile is the only one): the one load of the LoRA chain whose
    // address needs nothing else. (The tables are written before the step's first kernel, never by the kernel right
    // before: the rule under which the separate epilogue loads B before its wait.)
    // (the thread's index in its consumer warp group, or -1 in the producer's)
    const int t = threadIdx.x >= kThreads ? static_cast<int>(threadIdx.x) % kThreads : -1;
    const int tok0 = kPersistent ? 0 : static_cast<int>(blockIdx.y) * kTokens;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kPer; ++i) {
      slot_[i] = -1;
      const int row = tok0 + (i * kThreads + t) / kPerRow;
      if (t >= 0 && params.lora.v != nullptr && row < params.m)
        asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(slot_[i]) : "l"(params.lora.row_slot + row));
    }
    if constexpr (kShrink) {  // (the consumer warps before their main loop, or the producer's warps 1-3 beside it)
      if (params.lora.sync != nullptr && RowShrink<T>::takes_tickets(params.lora)) RowShrink<T>::shrink_rows(params);
    }
#endif
  }

  // In the epilogue, every consumer warp (after the wait for the kernel before): if v is not complete, the tickets
  // nobody took yet, then (lane 0, acquire loads) until every ticket is counted. A trap after seconds of spinning
  // guards against what cannot happen here (a ticket's warp that never finishes).
  __device__ static void drain_shrink(const Params& a) {
    const Fp8EpilogueLora& l = a.lora;
    const unsigned all = static_cast<unsigned>(l.shrink_tickets);
    auto done = [&] {
      return __shfl_sync(0xffffffffu, (threadIdx.x & 31) == 0 ? ld_acquire(l.sync + 1) : 0u, 0) >= all;
    };
    if (done()) return;
    for (unsigned t = RowShrink<T>::take_ticket(l); t < all; t = RowShrink<T>::take_ticket(l))
      RowShrink<T>::template shrink_ticket<1, 1>(a, static_cast<int>(t), true);
    for (long long spins = 0; !done(); ++spins) {
      if (spins > (1ll << 26)) __trap();
      __nanosleep(64);
    }
  }

  // The counts the third counter takes in a launch: one per tile's epilogue (after its consumer group's barrier, so
  // after every ticket its warps took), one CTA per tile.
  __device__ static unsigned counts_due() { return gridDim.x * gridDim.y * gridDim.z; }

  // One count in the third counter; the last of a launch (every ticket taken, every count in, no warp left to take
  // another) zeroes all three for the next launch. With shrink_producer the producer warps' draws are not behind any
  // epilogue: the last count first waits until every one of them has counted its exit in the fourth (every CTA has
  // started by then, and those warps wait for nothing but the kernel before), and zeroes it too.
  __device__ static void count_out(const Fp8EpilogueLora& l, unsigned due) {
    __threadfence();  // this thread's (and, through the barrier before, its group's) tickets before the count
    if (atomicAdd(l.sync + 2, 1u) == due - 1) {
      if (l.shrink_producer) {
        const unsigned exits = RowShrink<T>::kProducerWarps * due;
        for (long long spins = 0; ld_acquire(l.sync + 3) < exits; ++spins) {
          if (spins > (1ll << 26)) __trap();
          __nanosleep(64);
        }
      }
      __threadfence();  // (every other count, hence every ticket and its count, before the zeroing)
      atomicExch(l.sync, 0u);
      atomicExch(l.sync + 1, 0u);
      atomicExch(l.sync + 2, 0u);
      if (l.shrink_producer) atomicExch(l.sync + 3, 0u);
    }
  }

  __device__ static unsigned ld_acquire(const unsigned* p) {
    unsigned d;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(d) : "l"(p) : "memory");
    return d;
  }

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char* smem) {
    using namespace cute;
    static_assert(size<0>(BlockShapeMNK{}) == kRows && size<1>(BlockShapeMNK{}) == kTokens, "tile shape");
    const auto m_coord = get<0>(blk_coord_mnkl);
    const auto n_coord = get<1>(blk_coord_mnkl);
    // each accumulator's (weight row, token) inside the tile
    Tensor coords = local_tile(make_identity_tensor(make_shape(get<0>(problem_shape_mnkl), get<1>(problem_shape_mnkl))),
                               take<0, 2>(blk_shape_MNK), make_coord(m_coord, n_coord));
    Tensor tCcD = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);
    const int row0 = static_cast<int>(m_coord) * kRows, tok0 = static_cast<int>(n_coord) * kTokens;
    SharedStorage& st = *reinterpret_cast<SharedStorage*>(smem);
    // The kernel before has finished (the producer waited for it before the activations' first load, and these sums
    // come after that load); said here too, so that this thread's reads of x_scale and v do not rest on that
    // ordering alone.
    pdl_wait();
    // every warp of the group past its last MMA before the tile (the mainloop's buffers) is written
    cutlass::arch::NamedBarrier::sync(kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); ++i)
      st.tile[get<1>(tCcD(i)) - tok0][get<0>(tCcD(i)) - row0] = accumulators(i);
    if constexpr (kShrink) {
      if (params_.lora.sync != nullptr) drain_shrink(*grid_);  // all of v written
    }
    cutlass::arch::NamedBarrier::sync(kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
    if constexpr (kShrink) {
      if (params_.lora.sync != nullptr && thread_idx == 0) count_out(grid_->lora, counts_due());
    }
    const Fp8EpilogueArgs& a = params_;
    const Fp8EpilogueLora& l = a.lora;
    // Chunk i of this thread: 8 weight rows of one token, the i-th of the tile's chunks that fall to it (consecutive
    // threads take consecutive chunks: 16-byte stores and B loads side by side). With LoRA, a group of chunks has
    // all its loads in flight at once (the rank, B's first rank rows and v's, none waiting for another; B and v
    // past the rank are read and then ignored), then its arithmetic: one round trip to memory per group. Groups of
    // two chunks at 32 tokens (e4m3: 255 registers, no spill; see kPairs); one at 64 tokens, where two would spill.
    constexpr int kGroup = kPer == 2 && kPairs ? 2 : 1;
    CUTLASS_PRAGMA_UNROLL
    for (int i0 = 0; i0 < kPer; i0 += kGroup) {
      int row[kGroup], c[kGroup], width[kGroup], r[kGroup];
      const T* b[kGroup];
      const float* v[kGroup];
      uint4 bk[kGroup][fp8_epi::kChunk];
      float v0[kGroup][fp8_epi::kChunk];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kGroup; ++i) {
        const int q = (i0 + i) * kThreads + thread_idx;
        row[i] = tok0 + q / kPerRow;
        c[i] = row0 + (q % kPerRow) * fp8_epi::kCols;
        r[i] = 0;
        b[i] = nullptr;
        v[i] = nullptr;
        int g, start;
        fp8_epi::span_of(a, min(c[i], a.n - fp8_epi::kCols), g, start, width[i]);
        const int s = row[i] < a.m && c[i] < a.n && slot_[i0 + i] < l.num_slots ? slot_[i0 + i] : -1;
        if (s >= 0) {
          b[i] = fp8_epi::b_row0<T>(l, s, g, c[i], start, width[i]);
          r[i] = fp8_epi::slot_rank(l, s, g);
          const int rows = min(fp8_epi::b_rank_dim(l, g), fp8_epi::kChunk);
          v[i] = fp8_epi::lora_v(l, row[i], g);
          const int vs = min(l.v_rank_dim, fp8_epi::kChunk);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < fp8_epi::kChunk; ++j) {
            if (j < rows) bk[i][j] = __ldg(reinterpret_cast<const uint4*>(b[i] + static_cast<int64_t>(j) * width[i]));
            if (j < vs) v0[i][j] = __ldcg(v[i] + j);  // (L2: see lora_chunk)
          }
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kGroup; ++i) {
        if (row[i] >= a.m || c[i] >= a.n) continue;
        const int q = (i0 + i) * kThreads + thread_idx;
        const float* t = &st.tile[q / kPerRow][(q % kPerRow) * fp8_epi::kCols];
        const float4 y0 = *reinterpret_cast<const float4*>(t), y1 = *reinterpret_cast<const float4*>(t + 4);
        const float y[fp8_epi::kCols] = {y0.x, y0.y, y0.z, y0.w, y1.x, y1.y, y1.z, y1.w};
        float o[fp8_epi::kCols];
        fp8_epi::finish<T>(a, row[i], c[i], width[i], y, bk[i], b[i], r[i], v0[i], v[i], o);
        fp8_epi::store8<T>(static_cast<T*>(a.out) + static_cast<int64_t>(row[i]) * a.n + c[i], o);
      }
    }
  }

 private:
  static constexpr int kThreads = 128;  // the consumer warp group
  static constexpr int kPerRow = kRows / fp8_epi::kCols;  // chunks per token
  static constexpr int kPer = kTokens * kPerRow / kThreads;  // chunks per thread: 1, 2 or 4
  static_assert(kTokens * kPerRow % kThreads == 0, "every thread takes the same number of chunks");
  Params params_;
  // the kernel's own (grid-constant) copy, which the shrink's functions read by reference: a reference to params_
  // would put all of it on the stack (CUTLASS hands the constructor the kernel parameter's member by reference)
  const Params* grid_;
  int slot_[kPer];  // with LoRA: the row slots of this thread's chunks (loaded by the constructor), else -1
};

// The product with the fused epilogue: Sm90Gemm's mainloop (the same stages, so the same sums), FusedEpilogue; with
// kPersistent (e4m3 operands) in CUTLASS's persistent ping-pong kernel (the grid one CTA per SM at most: `sms`).
// The rows' LoRA shrink inside (FusedEpilogue's kShrink) is built for bf16 operands (e4m3 products take the shrink
// first, Sm90Gemm's kShrink, and the FP8 epilogue's launch).
template <typename T, int kTokens, class E = cutlass::float_e4m3_t, bool kPersistent = false>
struct Sm90GemmFused {
  using G = Sm90Gemm<kTokens, kPersistent, E>;
  static constexpr bool kShrink = sizeof(E) == 2;
  // (kPairs with e4m3 operands only where the one-CTA-a-tile kernel's consumers have their 255 registers: the
  // persistent kernel's two consumer groups get fewer, and two chunks at once there spill; so does the shrink's code)
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
      FusedEpilogue<T, kTokens, sizeof(E) == 1 && !kPersistent && !kShrink, kShrink, kPersistent>>;
  static_assert(sizeof(E) == 1 || !kPersistent, "bf16 operands in the one-CTA-a-tile kernel only");
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, typename G::Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(sizeof(typename Kernel::SharedStorage) <= 227 * 1024, "the kernel's shared memory fits an SM");

  static const char* run(const Fp8Sm90Args& a, const Fp8EpilogueArgs& e, void* stream, int sms = 0) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    StrideA sa = cutlass::make_cute_packed_stride(StrideA{}, {a.n, a.k, 1});
    cute::get<0>(sa) = a.w_ld > 0 ? a.w_ld : a.k;
    const StrideB sb = cutlass::make_cute_packed_stride(StrideB{}, {a.m, a.k, 1});
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {a.n, a.m, a.k, 1},
        {reinterpret_cast<const typename G::ElementA*>(a.w), sa, reinterpret_cast<const typename G::ElementB*>(a.x),
         sb, G::kPromotionInterval},
        e};
    args.hw_info.device_id = a.device;
    args.hw_info.sm_count = sms;
    return launch<Gemm>(args, a.pdl, stream);
  }
};

// The tile of tokens for M rows: 16, 32 or 64.
constexpr int token_tile(int m) { return m <= 16 ? 16 : m <= 32 ? 32 : 64; }

template <class E, bool kPersistent>
const char* plain(const Fp8Sm90Args& a, void* stream, int sms) {
  switch (token_tile(a.m)) {
    case 16: return Sm90Gemm<16, kPersistent, E>::run(a, stream, sms);
    case 32: return Sm90Gemm<32, kPersistent, E>::run(a, stream, sms);
    default: return Sm90Gemm<64, kPersistent, E>::run(a, stream, sms);
  }
}

// The product into fp32 with the rows' LoRA shrink first (Sm90Gemm's kShrink; `shrink` planned by the launcher).
// (A template: instantiated only where called, fp8_gemm_sm90.cu for e4m3 operands, fp8_gemm_sm90_bf16.cu for bf16.)
template <class E = cutlass::float_e4m3_t>
const char* plain_shrink(const Fp8Sm90Args& a, const Fp8EpilogueArgs& shrink, void* stream) {
  switch (token_tile(a.m)) {
    case 16: return Sm90Gemm<16, false, E, true>::run(a, stream, 0, &shrink);
    case 32: return Sm90Gemm<32, false, E, true>::run(a, stream, 0, &shrink);
    default: return Sm90Gemm<64, false, E, true>::run(a, stream, 0, &shrink);
  }
}

template <class E, bool kPersistent = false>
const char* fused(const Fp8Sm90Args& a, const Fp8EpilogueArgs& e, void* stream, int sms = 0) {
  switch (token_tile(a.m)) {
    case 16: return Sm90GemmFused<__nv_bfloat16, 16, E, kPersistent>::run(a, e, stream, sms);
    case 32: return Sm90GemmFused<__nv_bfloat16, 32, E, kPersistent>::run(a, e, stream, sms);
    default: return Sm90GemmFused<__nv_bfloat16, 64, E, kPersistent>::run(a, e, stream, sms);
  }
}

}  // namespace

// The bf16 operands' instantiations (fp8_gemm_sm90_bf16.cu): plain<bfloat16_t, false>, plain_shrink<bfloat16_t>
// and fused<bfloat16_t>, one CTA a tile (fp8_gemm_sm90.cu holds the e4m3 operands' plain and fused, both also
// persistent, and plain_shrink).
const char* sm90_bf16_plain(const Fp8Sm90Args& a, void* stream);
const char* sm90_bf16_plain_shrink(const Fp8Sm90Args& a, const Fp8EpilogueArgs& shrink, void* stream);
const char* sm90_bf16_fused(const Fp8Sm90Args& a, const Fp8EpilogueArgs& e, void* stream);
#endif

}  // namespace lorafleet
