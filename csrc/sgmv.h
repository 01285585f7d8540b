// SGMV launchers: the per-segment LoRA add-on y += (x @ A[slot]^T) @ B[slot], as shrink then expand.
//
// Torch-free on purpose: the kernels (sgmv.cu) take raw pointers, sizes and a stream; the torch
// binding (sgmv_binding.cpp) validates tensors and fills these structs. Semantics, for every segment i
// with slot s = slots[i] in [0, num_slots) and every projection g < num_groups:
//
//   rows = indptr[i] : indptr[i+1]
//   r    = ranks[g * num_slots + s]                       (0: projection g not adapted by slot s)
//   shrink: v[rows, g, :r] = x[rows] @ a[g][s, :r, :]^T    fp32 accumulate, fp32 store
//   expand: y[g][rows]    += v[rows, g, :r] @ b[g][s, :r, :]
//
// Rows of segments with slot -1 (or out of range) and entries v[:, g, r:] are never read or written.
#pragma once

#include <cstdint>

namespace lorafleet {

constexpr int kMaxGroup = 3;         // projections sharing one input per launch (q,k,v; gate,up)
constexpr int kMaxRank = 128;        // largest supported LoRA rank (and pool rank dimension)
constexpr int kMaxSegments = 1024;   // largest segment-table capacity of one launch

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// The per-step segment table and the per-(projection, slot) rank table, all int32 on the device.
struct SegmentArgs {
  const int32_t* indptr = nullptr;  // [capacity + 1], non-decreasing row offsets
  const int32_t* slots = nullptr;   // [capacity], -1 = no adapter
  const int32_t* ranks = nullptr;   // [num_groups, num_slots]
  int capacity = 0;                 // segments in the table (trailing ones empty)
  int num_slots = 0;                // S
  int num_rows = 0;                 // T
  int num_groups = 0;               // G, 1..kMaxGroup
};

struct ShrinkArgs {
  SegmentArgs seg;
  const void* x = nullptr;               // [T, in_features] contiguous, fp16/bf16
  const void* a[kMaxGroup] = {};         // [S, a_rank_dim[g], in_features] contiguous
  int a_rank_dim[kMaxGroup] = {};        // pool rank dimension R_g of a[g] (ranks are clamped to it)
  int in_features = 0;                   // multiple of 8
  float* v = nullptr;                    // [T, G, v_rank_dim] contiguous fp32
  int v_rank_dim = 0;                    // >= every a_rank_dim[g]
  // Optional (quant_out != nullptr): the same launch also quantizes every row of x, adapted or not, to e4m3
  // with one scale per row, bit for bit quantize_rows_e4m3 (quant.h): an FP8 projection's input quantized
  // without a launch of its own. sgmv_shrink only (sgmv_fused ignores it).
  uint8_t* quant_out = nullptr;          // [T, in_features] contiguous
  float* quant_scale = nullptr;          // [T]
};

// An RMSNorm of rows, Hugging Face's op for op (runner/model/ops.py rms_norm / add_rms_norm): with `res`,
// r = T(h + res) (written to res_out: the new residual), else r = h; rs = rsqrt(sum(r^2) / cols + eps) in fp32;
// x = T(w * T(r * rs)) (offset 0, Llama) or T((r * rs) * (offset + w)) (Gemma's 1 + w); optionally x's e4m3
// rows and scales as quantize_rows_e4m3 makes them from x. The outputs never alias the inputs.
struct NormArgs {
  const void* h = nullptr;        // [rows, cols] contiguous
  const void* res = nullptr;      // optional [rows, cols] contiguous
  void* res_out = nullptr;        // [rows, cols] contiguous, with res
  const void* w = nullptr;        // [cols]
  void* x_out = nullptr;          // [rows, cols] contiguous
  uint8_t* quant_out = nullptr;   // optional [rows, cols] contiguous e4m3
  float* quant_scale = nullptr;   // [rows], with quant_out
  float eps = 1e-6f;
  float offset = 0.f;
  int rows = 0;
  int cols = 0;                   // multiple of 8
  // rms_norm_rows: let the next kernel start at once (griddepcontrol.launch_dependents first), as with quant_out:
  // only where every kernel that may follow waits for this one before it reads x_out or res_out (the wgmma products'
  // WeightFirstMainloop), or is launched without programmatic dependent launch
  bool early = false;
};

struct ExpandArgs {
  SegmentArgs seg;
  const float* v = nullptr;              // [T, G, v_rank_dim] contiguous fp32
  int v_rank_dim = 0;
  const void* b[kMaxGroup] = {};         // [S, b_rank_dim[g], out_features[g]] contiguous
  int b_rank_dim[kMaxGroup] = {};
  void* y[kMaxGroup] = {};               // [T, out_features[g]], unit column stride
  int64_t y_row_stride[kMaxGroup] = {};  // elements, multiple of 8
  int out_features[kMaxGroup] = {};      // multiple of 8
  // The add-on on its own: y[g] are fp32 (16-byte aligned, row strides multiples of 8) and receive
  // v[rows, g, :r] @ b[g][s, :r, :] in fp32 (y is not read), the very sums the default mode adds to its
  // fp16/bf16 y before rounding once: T(y_bf16 + y_f32) later is bit for bit that mode's result. Rows of
  // segments with slot -1 and projections a slot does not adapt are not written (the caller zeroes them).
  // sgmv_expand only (sgmv_fused refuses it).
  bool write_f32 = false;
};

struct LaunchOptions {
  // Segments with at least this many rows take the tensor-core path; shorter ones the CUDA-core
  // path. Both are exact for any segment; the threshold only moves speed. >= 1.
  int mma_min_rows = 128;
  // Programmatic dependent launch (sm_90+): the kernel is scheduled while the previous kernel in the
  // stream still runs and reads the segment table, the rank table and its first A (shrink) or B
  // (expand) tile meanwhile; it waits for that kernel before reading x, v or y and before any write.
  // So nothing may write the tables or the pools in the kernel launched right before either one.
  bool pdl = true;
  // At most this many blocks (0: the launcher's own bound). Every block takes items blockIdx.x,
  // blockIdx.x + gridDim.x, ..., so results never depend on it; a small grid leaves SMs to a kernel that
  // runs at the same time on another stream (a shrink beside the GEMM that shares its input).
  int max_blocks = 0;
  // At most this many resident blocks per SM in the grid (0: the launcher's own bound: 4 for the shrink,
  // the occupancy for the expand and the fused launch). Like max_blocks it moves only speed, never a
  // bit of the results (applied before max_blocks; the grid stays at most what can be resident).
  int blocks_per_sm = 0;
  // Rank rows per CUDA-core shrink item of one-row segments (decode): 1, 2 or 4 (0: the default, 2 in
  // the CUDA-core-only shrink of decode steps, 4 in the tensor-core capable shrink and the fused launch).
  // Shrink and fused launches; anything else is an error. Each (row, rank row) dot product is reduced
  // in the same order whatever the item shape, so results never depend on it: fewer rank rows per item
  // give more, shorter items (more blocks busy on few rows), more give fewer x re-reads.
  int decode_ranks = 0;
  // Shrink only: the kernel launched right before this one (the base GEMM that reads the same x) neither writes x
  // nor reads or writes v, and lets this launch start only once every kernel before it is complete (a kernel
  // launched normally, as cuBLAS's and torch's are; never one of this file's kernels, which let their dependents
  // start at once). The items then read x and write v without waiting for that kernel (under programmatic
  // dependent launch the whole shrink can run while the GEMM drains); the launch still waits for it before
  // finishing, so whatever follows the shrink sees both complete. Never changes a bit of v. Ignored by the fused
  // and norm launches.
  bool x_ready = false;
  // Shrink only: segments shorter than the long-segment threshold (96 rows) are cut into one-row items too, of
  // decode_ranks rank rows each, as one-row segments are (a decode step's rows of one adapter then take as many
  // items as distinct adapters' rows would, instead of half as many of 2 rows x 2 rank rows). A launch shape:
  // never changes a bit of v. Ignored by the fused and norm launches.
  bool row_items = false;
};

// Enqueue one launch on `stream` (a cudaStream_t) of device `device`. No host synchronisation, no
// allocation: capturable in a CUDA graph. The grid depends only on T, capacity, G, the pool shapes and
// the device, never on the table contents. Returns nullptr on success, else a static error message.
const char* sgmv_shrink(DType dtype, const ShrinkArgs& args, const LaunchOptions& options, int device,
                        void* stream);
const char* sgmv_expand(DType dtype, const ExpandArgs& args, const LaunchOptions& options, int device,
                        void* stream);

// The RMSNorm of NormArgs, one block per row (a grid of at most `max_blocks`, 0: the launcher's bound).
const char* rms_norm_rows(DType dtype, const NormArgs& args, bool pdl, int max_blocks, int device, void* stream);

// The RMSNorm of `norm` and the shrink of `sargs` in ONE launch: sargs.x names norm.x_out, and the shrink's
// items (every segment on the CUDA-core path, options.mma_min_rows ignored) compute each row's normalized
// values themselves (the norm's row reduction per item), so v is bit for bit sgmv_shrink's on the x the
// launch writes; after its items each block writes the norm's outputs of rows blockIdx.x, + gridDim.x, ...
// (sargs.quant_out is ignored: norm.quant_out quantizes). The grid is at least min(rows, what fits).
const char* sgmv_norm_shrink(DType dtype, const NormArgs& norm, const ShrinkArgs& sargs, const LaunchOptions& options,
                             int device, void* stream);

// A device's properties the launchers size their grids by, read once per device (cached; thread-safe; host-only, so
// safe during graph capture). nullptr on success.
struct DeviceInfo {
  int sms = 0;
  int major = 0;
  int smem_optin = 0;  // largest dynamic shared memory one block may opt in to (bytes)
};
const char* device_info(int device, DeviceInfo* info);

// Shrink then expand of one projection group in ONE launch, every segment on the CUDA-core path
// (the decode case; `options.mma_min_rows` is ignored). `sargs` and `eargs` must share the segment
// table, T, G and v. `counters` is 2 * capacity int32 on the device, all zero before the first
// call; each launch leaves them zero again. Launches that share `counters` must not run
// concurrently (one stream). Same results, bit for bit, as sgmv_shrink + sgmv_expand with every
// segment below the tensor-core thresholds.
const char* sgmv_fused(DType dtype, const ShrinkArgs& sargs, const ExpandArgs& eargs, int* counters,
                       const LaunchOptions& options, int device, void* stream);

}  // namespace lorafleet
