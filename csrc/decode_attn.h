// Decode attention over paged K/V of the project's own: one query row per request, its K/V pages read once at their
// byte cost, in bf16 / fp16 or float8_e4m3fn (FP8 pages, unit scale, as rope_kv writes them).
//
// Torch-free like sgmv.h (the binding is in sgmv_binding.cpp). For request b < B, K/V head h < Hkv and each of its
// G = Hq / Hkv query heads j (query head h * G + j, the grouping of grouped-query attention):
//
//   n_b    = (indptr[b + 1] - indptr[b] - 1) * page_size + last_page_len[b]   (0 when the request has no page)
//   keys   = [start, n_b), start = max(0, n_b - 1 - window_left) with window_left >= 0, else 0
//   s_t    = q[b, h G + j] . k_t * sm_scale, or soft_cap * tanh(that / soft_cap) with soft_cap > 0   (fp32)
//   out[b, h G + j] = sum_t softmax(s)_t v_t, rounded once to the storage type
//
// where k_t / v_t is token t's row of head h in page indices[indptr[b] + t / page_size], slot t % page_size. A bad
// table gives wrong numbers, never a fault: page ids are clamped to [0, num_pages), positions outside `indices` read
// page 0, last_page_len is clamped to [1, page_size]. A request without keys (indptr[b + 1] <= indptr[b]) gets zeros.
//
// How it is cut (a request's bits depend on nothing else in its launch): the keys are cut into chunks of
// `chunk` tokens from `start` (more when n_b would need more than max_chunks chunks: then ceil(n_b / max_chunks)
// rounded up to 16), so the cut depends only on n_b and the two constants. Each chunk is one CTA's pass: its 4 warps
// take interleaved tokens, each lane a fixed part of a token's row, with an online softmax per lane, merged over the
// warp's token slots and then over the warps in a fixed order (the tensor-core kernel, `tensor_cores`: each warp
// 16-token tiles, an online softmax per tile, then the warps merged in the same order). A request of one chunk writes
// out directly; with more, every chunk writes its unnormalized partial (the max and sum of its exponentials with it)
// and the CTA that completes the request's last chunk merges them in chunk order. `workers` CTAs per (request, K/V
// head) take chunks c, c + workers, ...: the grid's shape never changes a bit.
#pragma once

#include <cstdint>

#include "sgmv.h"  // DType

namespace lorafleet {

struct DecodeAttnArgs {
  const void* q = nullptr;                 // [B, Hq, D] contiguous, the storage type
  void* out = nullptr;                     // [B, Hq, D] contiguous, the storage type
  const void* k_cache = nullptr;           // [num_pages, page_size, Hkv, D] contiguous: the storage type or e4m3
  const void* v_cache = nullptr;           // the same
  const int32_t* indptr = nullptr;         // [B + 1]
  const int32_t* indices = nullptr;        // page ids, request b's at [indptr[b], indptr[b + 1])
  const int32_t* last_page_len = nullptr;  // [B], in [1, page_size]
  float* partial_o = nullptr;              // [B, Hq, max_chunks, D] fp32 (requests of one chunk never touch it)
  float* partial_ml = nullptr;             // [B, Hq, max_chunks, 2] fp32
  int32_t* counters = nullptr;             // [B, Hkv] int32, zero before the first launch; each launch leaves them zero
  int64_t num_pages = 0;
  int64_t num_indices = 0;                 // entries of `indices` (positions outside it read page 0)
  int batch = 0;                           // B
  int num_heads = 0;                       // Hq, a multiple of Hkv
  int num_kv_heads = 0;                    // Hkv
  int head_dim = 0;                        // D: 64, 128 or 256
  int page_size = 0;
  int chunk = 256;                         // tokens per chunk, a positive multiple of 16
  int max_chunks = 16;                     // chunks per request at most (the partials' capacity)
  int workers = 1;                         // CTAs per (request, K/V head), at least 1
  float sm_scale = 1.f;
  float soft_cap = 0.f;                    // <= 0: none
  int window_left = -1;                    // a query sees its last window_left + 1 keys; < 0: all
  bool kv_e4m3 = false;                    // the pages hold float8_e4m3fn, not the storage type
  int stages = 0;                          // 0, or 3 / 5: each lane's next K/V rows copied that many passes minus one
                                           // ahead through shared memory (one query head per K/V head; the same bits)
  bool pdl = false;                        // a programmatic dependent launch (sm_90+; stages 3 / 5 only): the page
                                           // tables read before the wait for the kernel before, q and K/V after
  bool int_convert = false;                // e4m3 pages with stages 3 and one query head per K/V head: each byte to
                                           // fp32 by integer ops and one exact multiply instead of the cvt
                                           // instructions (the same values for every code but the two NaNs, read as
                                           // -+480; so the same bits)
  bool tensor_cores = false;               // e4m3 pages, stages 3 (its own ring: 2 at D = 256), any group: q . k
                                           // and p v on the tensor cores (mma.sync, f16 operands, fp32 sums; q and
                                           // p rounded to f16): not the CUDA-core kernel's bits, within the fp64
                                           // reference's tolerance
};

// Whether `stages` is one the kernel is built for (0, 3 or 5).
bool decode_attention_stages_ok(int stages);

// Whether a launch can take this head size and number of query heads per K/V head (group): D in {64, 128, 256} and
// group in [1, 8].
bool decode_attention_supports(int head_dim, int group);

// Enqueue on `stream`; no synchronisation or allocation (capturable). Launches sharing `counters` must not run
// concurrently (one stream). nullptr on success.
const char* decode_attention(DType dtype, const DecodeAttnArgs& args, int device, void* stream);

}  // namespace lorafleet
