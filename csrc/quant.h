// Dynamic per-row FP8 (e4m3) quantization of activations, in one launch.
//
// Torch-free like sgmv.h (the binding is in sgmv_binding.cpp). For every row i < rows of x (bf16/fp16,
// `cols` elements, unit column stride):
//
//   scale[i]  = max(absmax(x[i, :]) * fp32(1 / 448), 1e-12)              fp32 (how torch divides by a scalar)
//   out[i, j] = e4m3(clamp(x[i, j] / scale[i], -448, 448))               round to nearest even
//
// the same bits as runner/model/fp8.py quantize_tokens (x.float(), amax, division, clamp, cast).
#pragma once

#include <cstdint>

#include "sgmv.h"  // DType

namespace lorafleet {

struct QuantizeRowsArgs {
  const void* x = nullptr;      // [rows, cols]
  int64_t x_row_stride = 0;     // elements
  void* out = nullptr;          // [rows, cols] float8_e4m3fn, contiguous
  float* scale = nullptr;       // [rows]
  int rows = 0;
  int cols = 0;
};

// Enqueue on `stream`; no synchronisation or allocation (capturable). nullptr on success.
const char* quantize_rows_e4m3(DType dtype, const QuantizeRowsArgs& args, int device, void* stream);

}  // namespace lorafleet
