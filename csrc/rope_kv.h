// Rotary embedding of q and k, and the K/V cache write, of one decoder layer in ONE launch.
//
// Torch-free like sgmv.h (the binding is in sgmv_binding.cpp). For every token t < T and position
// p = positions[t] (rotate-half / "neox" pairing of element i with i + D/2, angles from an fp32
// cos/sin cache [P, D]: cos in the first D/2 columns, sin in the last D/2):
//
//   q_out[t, h, :]          = rope(qkv[t, h * D : (h + 1) * D], p)                  h < Hq
//   k_cache[slots[t], h, :] = rope(qkv[t, (Hq + h) * D : ...], p)                   h < Hkv
//   v_cache[slots[t], h, :] = qkv[t, (Hq + Hkv + h) * D : ...]                      h < Hkv
//
// rope(x)[i] = x[i] * cos[i] - x[i + D/2] * sin[i], rope(x)[i + D/2] = x[i + D/2] * cos[i] + x[i] * sin[i]
// for i < D/2, in fp32, rounded once to the storage type. Positions outside [0, P) are clamped;
// slots < 0 skip the cache write of that token (q_out is still written). With `cache_e4m3` the K/V caches
// hold float8_e4m3fn with unit scale: each k / v element is rounded to the storage type first, then cast to
// e4m3 saturating at +-448 (round to nearest even; NaN stays NaN), the bits of the torch K/V writer's
// `to_e4m3` of its bf16 / fp16 rows.
#pragma once

#include <cstdint>

#include "sgmv.h"  // DType

namespace lorafleet {

// Optional: the LoRA expand of the qkv rows (decode CUDA graphs), added to each row before it is
// rotated or written, so that the expand needs no launch of its own:
//   qkv[t, cols of projection g] += v[t, g, :r] @ b[g][s, :r, cols]     s = row_slot[t], r = ranks[g, s]
// (g = 0, 1, 2: q, k, v), with r clamped to [0, min(b_rank_dim[g], 128)] and rows whose slot is < 0 or
// >= num_slots left alone. Each element is summed in the order of the SGMV CUDA-core expand (rank rows
// k = j, j + 4, ... into four fp32 chains j = 0..3 with fmaf, then (c0 + c2) + (c1 + c3)) and added to
// the bf16/fp16 value in fp32, rounded once: the same bits as sgmv_expand followed by rope_kv.
struct RopeKvLora {
  const float* v = nullptr;            // [T, 3, v_rank_dim] fp32 (the shrink's output); nullptr: no LoRA
  int64_t v_row_stride = 0;            // elements
  int v_rank_dim = 0;
  const void* b[3] = {};               // [S, b_rank_dim[g], out_g]; out = Hq * D, Hkv * D, Hkv * D
  int b_rank_dim[3] = {};
  const int32_t* ranks = nullptr;      // [3, S]
  const int32_t* row_slot = nullptr;   // [T]
  int num_slots = 0;                   // S
};

struct RopeKvArgs {
  const void* qkv = nullptr;        // [T, (Hq + 2 Hkv) * D] rows, unit column stride
  int64_t qkv_row_stride = 0;       // elements
  const int64_t* positions = nullptr;  // [T]
  const int64_t* slots = nullptr;      // [T] token slots of the cache (page * page_size + offset)
  const float* cos_sin = nullptr;      // [P, D]
  int64_t num_positions = 0;           // P
  void* q_out = nullptr;               // [T, Hq, D] contiguous
  void* k_cache = nullptr;             // [num_slots, Hkv, D] contiguous
  void* v_cache = nullptr;             // [num_slots, Hkv, D] contiguous
  int64_t num_cache_slots = 0;         // slots >= this are skipped too
  int num_tokens = 0;                  // T
  int num_heads = 0;                   // Hq
  int num_kv_heads = 0;                // Hkv
  int head_dim = 0;                    // D, a multiple of 4, at most 512
  bool cache_e4m3 = false;             // the K/V caches are float8_e4m3fn (unit scale), not the storage type
  // launched with programmatic stream serialization (sm_90+): the grid may start while the kernel before it (qkv's
  // product or epilogue) still runs, if that kernel lets it; every block waits for it first (the same bits)
  bool pdl = false;
  RopeKvLora lora;                     // optional (lora.v == nullptr: none)
};

// Enqueue on `stream`; no synchronisation or allocation (capturable). nullptr on success.
const char* rope_kv(DType dtype, const RopeKvArgs& args, int device, void* stream);

}  // namespace lorafleet
