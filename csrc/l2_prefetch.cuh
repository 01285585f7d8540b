// Warming L2 with the first bytes of the next product's weight rows, from a kernel that runs before that product
// and moves few bytes itself (the activations' quantization): DRAM is idle during such a kernel, and the product,
// which streams its weight, then finds its first k-tiles in L2. A hint only: no value read or written changes.
#pragma once

#include <cstdint>

namespace lorafleet {

// `rows` rows of `row_bytes` bytes each, row r of part p at base + p * part_stride + r * row_stride (bytes). The
// product's weight W [N, K] (e4m3, K contiguous) cut into `parts` equal K ranges: rows = N, row_stride = K,
// part_stride = K / parts, row_bytes = its first k-tiles of each range. Nothing where base is null or row_bytes 0.
struct L2Prefetch {
  const void* base = nullptr;
  int64_t row_stride = 0;
  int64_t part_stride = 0;
  int rows = 0;
  int parts = 1;
  int row_bytes = 0;  // a multiple of 16; base, row_stride and part_stride 16-byte aligned (l2_prefetch_check)
};

#ifdef __CUDACC__
// Thread `t` of `threads` (all the grid's threads) asks for its share of the rows, one request per row and part.
__device__ __forceinline__ void l2_prefetch(const L2Prefetch& p, int t, int threads) {
  if (p.base == nullptr || p.row_bytes <= 0) return;
  const int total = p.rows * p.parts;
  for (int i = t; i < total; i += threads) {
    const char* at = static_cast<const char*>(p.base) + static_cast<int64_t>(i / p.rows) * p.part_stride +
                     static_cast<int64_t>(i % p.rows) * p.row_stride;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(__cvta_generic_to_global(at)), "r"(p.row_bytes));
#else
    for (int b = 0; b < p.row_bytes; b += 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(__cvta_generic_to_global(at + b)));
#endif
  }
}
#endif

// nullptr where `p` can be taken (or asks for nothing), else why not.
inline const char* l2_prefetch_check(const L2Prefetch& p) {
  if (p.base == nullptr || p.row_bytes == 0) return nullptr;
  if (p.rows < 0 || p.parts < 1 || p.row_bytes < 0 || p.row_bytes % 16 != 0)
    return "l2 prefetch: rows >= 0, parts >= 1 and row_bytes a multiple of 16";
  if (reinterpret_cast<uintptr_t>(p.base) % 16 != 0 || p.row_stride % 16 != 0 || p.part_stride % 16 != 0)
    return "l2 prefetch: base, row_stride and part_stride must be 16-byte aligned";
  if (p.row_bytes > p.part_stride || p.parts * p.part_stride > p.row_stride)
    return "l2 prefetch: a row's parts must lie within the row";
  if (static_cast<int64_t>(p.rows) * p.parts > (int64_t{1} << 30)) return "l2 prefetch: too many rows";
  return nullptr;
}

}  // namespace lorafleet
