// Torch binding of the SGMV launchers (sgmv.h). It validates every input and then enqueues the
// kernels on the CUDA stream that Python passes in as an integer (no c10/cuda headers needed).
//
//   shrink(v, x, a, ranks, indptr, slots, mma_min_rows, pdl, stream, max_blocks=0, blocks_per_sm=0,
//          decode_ranks=0, quant_out=None, quant_scale=None, x_ready=False, row_items=False):
//       v[rows, g, :r] = x[rows] @ a[g][s, :r, :].T        for every segment (rows, s >= 0) and g;
//       with quant_out / quant_scale also every row of x quantized as quantize_e4m3 does, in the same launch;
//       max_blocks > 0 caps the grid (to leave SMs to a kernel on another stream), blocks_per_sm > 0
//       the resident blocks per SM (0: 4), decode_ranks (1, 2 or 4; 0: 2, or 4 when the launch can take
//       tensor cores) sets the rank rows per CUDA-core item of one-row segments; x_ready: the kernel launched
//       right before (the base GEMM on the same x) neither writes x nor touches v, so the items need not
//       wait for it (sgmv.h LaunchOptions::x_ready); row_items: segments below 96 rows also as one-row items of
//       decode_ranks rank rows (sgmv.h LaunchOptions::row_items). None of the five changes a bit of v.
//   expand(ys, v, b, ranks, indptr, slots, mma_min_rows, pdl, stream, blocks_per_sm=0, write_f32=false):
//       ys[g][rows] += v[rows, g, :r] @ b[g][s, :r, :]
//       blocks_per_sm > 0 caps the resident blocks per SM (0: occupancy only); never changes a bit.
//       write_f32 (the "expand_write" mode): the add-on alone into fp32 ys (sgmv.h ExpandArgs::write_f32), for a
//       consumer that adds it to the base product later.
//   add(ys, v, x, a, b, ranks, indptr, slots, counters, shrink_mma_min_rows, expand_mma_min_rows, pdl, stream):
//       shrink then expand; one fused launch when T is below both thresholds (every segment on the
//       CUDA-core path), else the two launches above. counters: int32 [>= 2 * capacity], zero.
//   rope_kv(q_out, k_cache, v_cache, qkv, positions, slots, cos_sin, num_heads, num_kv_heads, stream, pdl=False):
//       rotary embedding of q into q_out and of k into k_cache[slots], v copied to v_cache[slots], one
//       launch (rope_kv.h); caches of qkv's dtype, or float8_e4m3fn (FP8 pages, unit scale). pdl: launched with
//       programmatic dependent launch, its blocks waiting for the kernel before (RopeKvArgs::pdl).
//   rope_kv_lora(..., stream, v, b, ranks, row_slot, pdl=False): the same with the qkv rows' LoRA expand added first
//       (rope_kv.h RopeKvLora), so a decode step needs no separate expand launch for q, k and v.
//   rms_norm(x_out, h, res, res_out, w, eps, offset, quant_out, quant_scale, pdl, stream, max_blocks=0, early=False):
//       the RMSNorm of runner/model/ops.py (res: res_out = h + res, normalized; offset: Gemma's 1 + w), optionally
//       x_out's e4m3 rows and scales as quantize_e4m3 makes them; res, res_out, quant_out, quant_scale may be None.
//       early (or quant_out): the next kernel may start at once (NormArgs::early: only before kernels that wait).
//   norm_shrink(v, x_out, h, res, res_out, w, eps, offset, a, ranks, indptr, slots, pdl, stream, max_blocks=0,
//       decode_ranks=0, quant_out=None, quant_scale=None): rms_norm and the shrink of x_out (CUDA-core items),
//       one launch; v bit for bit shrink's on the x_out it writes.
//   quantize_e4m3(out, scale, x, stream): dynamic per-row FP8 quantization of activations (quant.h),
//       one launch: scale[i] = max(absmax(x[i]) / 448, 1e-12), out[i] = e4m3(x[i] * (1 / scale[i])).
//   fp8_gemm(out, x, x_scale, w, w_scale, stream): out = (x @ w.T) * x_scale[:, None] * w_scale[None, :] in
//       bf16 for at most 64 e4m3 rows x (fp8_gemm.h), the weight streamed once.
//   fp8_gemm_bf16(out, x, w, w_scale, stream): the same for bf16 rows x, unquantized: (x @ w.T) * w_scale.
//   fp8_gemm_sm90(out, x, w, stream, splits=1, pdl=True, persistent=False): out = x @ w.T in fp32 (unit scales) for
//       at most 64 e4m3 rows x on Hopper's wgmma (fp8_gemm_sm90.h, CUTLASS); splits > 1: out [splits, M, N] holds
//       the partial sums of K's equal parts; persistent: CUTLASS's persistent ping-pong schedule (the same bits).
//       x and w may both be bf16 instead (bf16 wgmma; not persistent), here and in fp8_gemm_sm90_fused; w's rows
//       may lie further apart than K (a weight with spare columns: 16-byte aligned rows).
//       With lora_x (x's bf16 rows [M, K]), cols, v, b, ranks, row_slot, a (one A pool [S, R, K] per span) and sync
//       (int32 [>= 1], zero, the call site's own; not persistent; with bf16 operands lora_x is x itself): the rows'
//       LoRA shrink too, into v, on the product's warps before their main loop, for the FP8 epilogue launched after
//       it (with unit scales after bf16 operands) (fp8_gemm_sm90.h
//       Fp8Sm90Args::shrink); shrink_producer=True: on the producer warp group's warps 1-3 beside the main loop
//       (quant.h Fp8EpilogueLora::shrink_producer; the same bits).
//       fp8_gemm_sm90_built(): whether this build holds that kernel.
//   fp8_epilogue(out, y, x_scale, w_scale, bias, cols, v, b, ranks, row_slot, pdl, stream, act=0, early=False):
//       out = the fp32 unit-scale FP8 product y times the token and row scales, plus the bias and the rows' LoRA
//       expand (v @ b[g][row_slot]) over the projections' column spans `cols`, one launch (quant.h); bias and v
//       (with b, ranks, row_slot) may be None. act=1 (SiLU) / 2 (GELU-tanh), with two equal spans (gate, up):
//       out [M, N / 2] = act(gate) * up as flashinfer's act_and_mul computes it from the epilogue's output.
//       y [splits, M, N]: a split-K product's partial sums (fp8_gemm_sm90 with splits), added in part order first.
//       early=True: the next kernel may start at once (quant.h Fp8EpilogueArgs::early; it must wait for this one).
//   fp8_gemm_sm90_fused(out, x, w, x_scale, w_scale, bias, cols, v, b, ranks, row_slot, pdl, stream, a=[], sync=None,
//       persistent=False, shrink_producer=False): the bits of fp8_gemm_sm90 then fp8_epilogue (act 0, one part) in
//       one launch, the epilogue inside the product's kernel; out in bf16. With bf16 operands, a (one A pool
//       [S, R, K] per span) and sync (int32 [>= 3], zero, the call site's own): the rows' shrink of x too, into v,
//       inside the same launch (quant.h Fp8EpilogueLora::sync) instead of a shrink launched before
//       (shrink_producer=True: on the producer warp group's warps 1-3 beside the main loop, sync [>= 4]; the same
//       bits); e4m3 operands take the shrink first in fp8_gemm_sm90 instead. persistent (e4m3 operands): in
//       CUTLASS's persistent ping-pong kernel (the same bits).
//   decode_attention(out, q, k_cache, v_cache, indptr, indices, last_page_len, partial_o, partial_ml, counters,
//       sm_scale, soft_cap, window_left, chunk, max_chunks, workers, stream, stages=0, pdl=False,
//       int_convert=False, tensor_cores=False): attention of one
//       query row per request over its K/V pages (decode_attn.h), one launch; pages of q's dtype or float8_e4m3fn
//       (unit scale). The page table is flashinfer's CSR (indptr, indices, last_page_len) on the device; a
//       request's bits depend on nothing else in the launch (workers only spreads its chunks over CTAs; stages 3
//       or 5 only how far ahead the K/V rows are copied, through shared memory). pdl=True (stages 3 or 5 with one
//       query head per K/V head only): a programmatic dependent launch (the page tables read before the wait for
//       the kernel before, which rope_kv lets start early). int_convert=True (e4m3 pages, stages 3, one query head
//       per K/V head): the bytes to fp32 by integer ops instead of the cvt instructions (the same values).
//       tensor_cores=True (e4m3 pages, stages 3, any group): q . k and p v on the tensor cores (f16 operands, fp32
//       sums; not the CUDA-core kernel's bits).
//       decode_attention_supports(head_dim, group): whether the kernel takes these shapes.
//
// with r = ranks[g, s]. The values inside ranks / indptr / slots live on the device and are not
// inspected here (that would need a synchronisation): the kernels clamp ranks to [0, R_g], skip
// slots outside [0, S) and clamp rows to [0, T), so a bad table gives wrong numbers, never a fault.
#include <torch/extension.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

#include "decode_attn.h"
#include "fp8_gemm.h"
#include "fp8_gemm_sm90.h"
#include "quant.h"
#include "rope_kv.h"
#include "sgmv.h"

namespace {

using torch::Tensor;

constexpr int64_t kInt32Max = 2147483647;

// Error messages are formatted with snprintf and handed to torch as one C string: streaming
// integers through std::ostream from this translation unit has been seen to crash when the
// extension's compiler is newer than the C++ runtime the process loads.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void fail(const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  TORCH_CHECK(false, static_cast<const char*>(msg));
}

#define SGMV_CHECK(cond, ...) \
  do {                        \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

long long ll(int64_t v) { return static_cast<long long>(v); }
const char* dtype_name(const Tensor& t) { return c10::toString(t.scalar_type()); }

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// A tensor name for messages: "x", or "a[1]".
struct Name {
  char text[32];
  Name(const char* base, int64_t index = -1) {
    if (index < 0) std::snprintf(text, sizeof(text), "%s", base);
    else std::snprintf(text, sizeof(text), "%s[%lld]", base, ll(index));
  }
};

lorafleet::DType kernel_dtype(const Tensor& x, const char* name) {
  SGMV_CHECK(x.scalar_type() == torch::kHalf || x.scalar_type() == torch::kBFloat16,
             "sgmv: %s must be float16 or bfloat16, got %s (use TorchSGMV for other dtypes)", name, dtype_name(x));
  return x.scalar_type() == torch::kHalf ? lorafleet::DType::kFloat16 : lorafleet::DType::kBFloat16;
}

// Every tensor must sit on the device of the reference tensor (x for shrink, ys[0] for expand).
void check_device(const Tensor& t, const Name& name, const Tensor& ref) {
  SGMV_CHECK(t.is_cuda(), "sgmv: %s must be a CUDA tensor, got device %s", name.text, t.device().str().c_str());
  SGMV_CHECK(t.device() == ref.device(), "sgmv: %s is on %s but the inputs are on %s", name.text,
             t.device().str().c_str(), ref.device().str().c_str());
}

void check_weight_pool(const Tensor& w, const Name& name, const Tensor& x, int64_t slots, int64_t width,
                       int64_t v_rank) {
  check_device(w, name, x);
  SGMV_CHECK(w.scalar_type() == x.scalar_type(), "sgmv: %s has dtype %s but the inputs have %s", name.text,
             dtype_name(w), dtype_name(x));
  SGMV_CHECK(w.dim() == 3, "sgmv: %s must be [S, R, features], got %lld dimensions", name.text, ll(w.dim()));
  SGMV_CHECK(w.is_contiguous(), "sgmv: %s must be contiguous", name.text);
  SGMV_CHECK(w.size(0) == slots, "sgmv: %s has %lld slots but ranks has %lld", name.text, ll(w.size(0)), ll(slots));
  SGMV_CHECK(w.size(1) >= 1 && w.size(1) <= lorafleet::kMaxRank, "sgmv: %s rank dimension %lld must be in [1, %d]",
             name.text, ll(w.size(1)), lorafleet::kMaxRank);
  SGMV_CHECK(w.size(1) <= v_rank, "sgmv: %s rank dimension %lld exceeds v.size(2) = %lld", name.text,
             ll(w.size(1)), ll(v_rank));
  SGMV_CHECK(w.size(2) == width, "sgmv: %s has %lld features, expected %lld", name.text, ll(w.size(2)), ll(width));
  SGMV_CHECK(aligned16(w), "sgmv: %s must be 16-byte aligned", name.text);
}

// Checks v, ranks and the segment table; `x` gives the device and T (ys[0] for expand).
lorafleet::SegmentArgs check_tables(const Tensor& v, const Tensor& x, int64_t groups, const Tensor& ranks,
                                    const Tensor& indptr, const Tensor& slots) {
  SGMV_CHECK(groups >= 1 && groups <= lorafleet::kMaxGroup, "sgmv: 1 to %d projections per launch, got %lld",
             lorafleet::kMaxGroup, ll(groups));
  check_device(v, Name("v"), x);
  SGMV_CHECK(v.scalar_type() == torch::kFloat, "sgmv: v must be float32, got %s", dtype_name(v));
  SGMV_CHECK(v.dim() == 3 && v.size(0) == x.size(0) && v.size(1) == groups,
             "sgmv: v must be [T, G, R] with T = %lld and G = %lld", ll(x.size(0)), ll(groups));
  SGMV_CHECK(v.size(2) >= 1, "sgmv: v has an empty rank dimension");
  SGMV_CHECK(v.is_contiguous(), "sgmv: v must be contiguous");
  SGMV_CHECK(v.numel() <= kInt32Max, "sgmv: v is too large");

  check_device(ranks, Name("ranks"), x);
  SGMV_CHECK(ranks.scalar_type() == torch::kInt, "sgmv: ranks must be int32, got %s", dtype_name(ranks));
  SGMV_CHECK(ranks.dim() == 2 && ranks.size(0) == groups, "sgmv: ranks must be [G, S] with G = %lld", ll(groups));
  SGMV_CHECK(ranks.size(1) >= 1 && ranks.size(1) <= kInt32Max, "sgmv: ranks must have at least one slot");
  SGMV_CHECK(ranks.is_contiguous(), "sgmv: ranks must be contiguous");

  check_device(indptr, Name("indptr"), x);
  check_device(slots, Name("slots"), x);
  SGMV_CHECK(indptr.scalar_type() == torch::kInt && slots.scalar_type() == torch::kInt,
             "sgmv: indptr and slots must be int32, got %s and %s", dtype_name(indptr), dtype_name(slots));
  SGMV_CHECK(indptr.dim() == 1 && slots.dim() == 1 && indptr.numel() == slots.numel() + 1,
             "sgmv: indptr must be [capacity + 1] and slots [capacity]");
  SGMV_CHECK(slots.numel() >= 1 && slots.numel() <= lorafleet::kMaxSegments,
             "sgmv: segment capacity %lld must be in [1, %d]", ll(slots.numel()), lorafleet::kMaxSegments);
  SGMV_CHECK(indptr.is_contiguous() && slots.is_contiguous(), "sgmv: indptr and slots must be contiguous");

  lorafleet::SegmentArgs s;
  s.indptr = indptr.data_ptr<int32_t>();
  s.slots = slots.data_ptr<int32_t>();
  s.ranks = ranks.data_ptr<int32_t>();
  s.capacity = static_cast<int>(slots.numel());
  s.num_slots = static_cast<int>(ranks.size(1));
  s.num_rows = static_cast<int>(x.size(0));
  s.num_groups = static_cast<int>(groups);
  return s;
}

// The e4m3 rows and scales of x's quantization: out float8_e4m3fn [T, K] and scale float32 [T], contiguous, on x's
// device; `who` and the names prefix the messages.
void check_e4m3_out(const char* who, const Tensor& out, const char* out_name, const Tensor& scale,
                    const char* scale_name, const Tensor& x) {
  check_device(out, Name(out_name), x);
  check_device(scale, Name(scale_name), x);
  SGMV_CHECK(out.scalar_type() == torch::kFloat8_e4m3fn && out.is_contiguous() && out.dim() == 2 &&
                 out.size(0) == x.size(0) && out.size(1) == x.size(1),
             "%s: %s must be contiguous float8_e4m3fn [%lld, %lld]", who, out_name, ll(x.size(0)), ll(x.size(1)));
  SGMV_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == x.size(0),
             "%s: %s must be contiguous float32 with %lld entries", who, scale_name, ll(x.size(0)));
}

void check_x(const Tensor& x) {
  SGMV_CHECK(x.is_cuda(), "sgmv: x must be a CUDA tensor, got device %s", x.device().str().c_str());
  SGMV_CHECK(x.dim() == 2, "sgmv: x must be [T, in_features], got %lld dimensions", ll(x.dim()));
  SGMV_CHECK(x.is_contiguous(), "sgmv: x must be contiguous");
  SGMV_CHECK(x.size(1) >= 8 && x.size(1) % 8 == 0, "sgmv: in_features must be a multiple of 8, got %lld",
             ll(x.size(1)));
  SGMV_CHECK(x.numel() <= kInt32Max, "sgmv: x is too large");
  SGMV_CHECK(aligned16(x), "sgmv: x must be 16-byte aligned");
}

lorafleet::ShrinkArgs shrink_args(const Tensor& v, const Tensor& x, const std::vector<Tensor>& a, const Tensor& ranks,
                                  const Tensor& indptr, const Tensor& slots) {
  check_x(x);
  const int64_t groups = static_cast<int64_t>(a.size());
  lorafleet::ShrinkArgs args;
  args.seg = check_tables(v, x, groups, ranks, indptr, slots);
  args.x = x.data_ptr();
  args.in_features = static_cast<int>(x.size(1));
  args.v = v.data_ptr<float>();
  args.v_rank_dim = static_cast<int>(v.size(2));
  for (int64_t g = 0; g < groups; ++g) {
    check_weight_pool(a[g], Name("a", g), x, ranks.size(1), x.size(1), v.size(2));
    args.a[g] = a[g].data_ptr();
    args.a_rank_dim[g] = static_cast<int>(a[g].size(1));
  }
  return args;
}

lorafleet::LaunchOptions launch_options(int64_t mma_min_rows, bool pdl, int64_t max_blocks = 0,
                                        int64_t blocks_per_sm = 0, int64_t decode_ranks = 0, bool x_ready = false,
                                        bool row_items = false) {
  SGMV_CHECK(mma_min_rows >= 1, "sgmv: mma_min_rows must be >= 1");
  SGMV_CHECK(max_blocks >= 0, "sgmv: max_blocks must be >= 0 (0: no cap)");
  SGMV_CHECK(blocks_per_sm >= 0, "sgmv: blocks_per_sm must be >= 0 (0: the kernel's default), got %lld",
             ll(blocks_per_sm));
  SGMV_CHECK(decode_ranks == 0 || decode_ranks == 1 || decode_ranks == 2 || decode_ranks == 4,
             "sgmv: decode_ranks must be 0, 1, 2 or 4 (0: the kernel default), got %lld", ll(decode_ranks));
  lorafleet::LaunchOptions opt;
  opt.mma_min_rows = static_cast<int>(std::min<int64_t>(mma_min_rows, kInt32Max));
  opt.pdl = pdl;
  opt.max_blocks = static_cast<int>(std::min<int64_t>(max_blocks, kInt32Max));
  opt.blocks_per_sm = static_cast<int>(std::min<int64_t>(blocks_per_sm, kInt32Max));
  opt.decode_ranks = static_cast<int>(decode_ranks);
  opt.x_ready = x_ready;
  opt.row_items = row_items;
  return opt;
}

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

void shrink(Tensor v, Tensor x, std::vector<Tensor> a, Tensor ranks, Tensor indptr, Tensor slots,
            int64_t mma_min_rows, bool pdl, int64_t stream, int64_t max_blocks, int64_t blocks_per_sm,
            int64_t decode_ranks, std::optional<Tensor> quant_out, std::optional<Tensor> quant_scale, bool x_ready,
            bool row_items) {
  const auto dtype = kernel_dtype(x, "x");
  lorafleet::ShrinkArgs args = shrink_args(v, x, a, ranks, indptr, slots);
  SGMV_CHECK(quant_out.has_value() == quant_scale.has_value(), "sgmv: quant_out and quant_scale go together");
  if (quant_out.has_value()) {
    check_e4m3_out("sgmv", *quant_out, "quant_out", *quant_scale, "quant_scale", x);
    args.quant_out = static_cast<uint8_t*>(quant_out->data_ptr());
    args.quant_scale = quant_scale->data_ptr<float>();
  }
  const lorafleet::LaunchOptions opt =
      launch_options(mma_min_rows, pdl, max_blocks, blocks_per_sm, decode_ranks, x_ready, row_items);
  if (x.size(0) == 0) return;
  const char* err = lorafleet::sgmv_shrink(dtype, args, opt, x.get_device(), as_stream(stream));
  SGMV_CHECK(err == nullptr, "sgmv shrink launch failed: %s", err ? err : "");
}

// `write_f32`: ys are fp32 and receive the add-on (ExpandArgs::write_f32); the B pools then set the dtype.
lorafleet::ExpandArgs expand_args(const std::vector<Tensor>& ys, const Tensor& v, const std::vector<Tensor>& b,
                                  const Tensor& ranks, const Tensor& indptr, const Tensor& slots,
                                  bool write_f32 = false) {
  SGMV_CHECK(!ys.empty() && ys.size() == b.size(), "sgmv: expand needs one output per B pool, got %lld and %lld",
             ll(static_cast<int64_t>(ys.size())), ll(static_cast<int64_t>(b.size())));
  const Tensor& y0 = ys[0];
  SGMV_CHECK(y0.is_cuda(), "sgmv: ys[0] must be a CUDA tensor, got device %s", y0.device().str().c_str());
  const int64_t groups = static_cast<int64_t>(b.size());
  SGMV_CHECK(y0.dim() == 2, "sgmv: ys[0] must be [T, out_features], got %lld dimensions", ll(y0.dim()));
  if (write_f32) {
    SGMV_CHECK(y0.scalar_type() == torch::kFloat, "sgmv: expand_write writes fp32 outputs, got ys[0] of %s",
               dtype_name(y0));
    check_device(b[0], Name("b", 0), y0);
  }
  const Tensor& pool_ref = write_f32 ? b[0] : y0;  // the dtype every B pool must have
  lorafleet::ExpandArgs args;
  args.write_f32 = write_f32;
  args.seg = check_tables(v, y0, groups, ranks, indptr, slots);
  args.v = v.data_ptr<float>();
  args.v_rank_dim = static_cast<int>(v.size(2));
  for (int64_t g = 0; g < groups; ++g) {
    const Tensor& y = ys[g];
    const Name name("ys", g);
    check_device(y, name, y0);
    SGMV_CHECK(y.scalar_type() == y0.scalar_type(), "sgmv: %s has dtype %s but ys[0] has %s", name.text,
               dtype_name(y), dtype_name(y0));
    SGMV_CHECK(y.dim() == 2 && y.size(0) == y0.size(0), "sgmv: %s must be [T, out] with T = %lld", name.text,
               ll(y0.size(0)));
    SGMV_CHECK(y.size(1) >= 8 && y.size(1) % 8 == 0, "sgmv: %s width must be a multiple of 8, got %lld", name.text,
               ll(y.size(1)));
    SGMV_CHECK(y.stride(1) == 1, "sgmv: %s must have unit column stride, got %lld", name.text, ll(y.stride(1)));
    SGMV_CHECK(y.size(0) <= 1 || (y.stride(0) >= y.size(1) && y.stride(0) % 8 == 0),
               "sgmv: %s row stride must be a multiple of 8 and at least its width, got %lld", name.text,
               ll(y.stride(0)));
    SGMV_CHECK(aligned16(y), "sgmv: %s must start 16-byte aligned (column offset a multiple of 8)", name.text);
    SGMV_CHECK(y.size(1) <= kInt32Max, "sgmv: %s is too wide", name.text);
    check_weight_pool(b[g], Name("b", g), pool_ref, ranks.size(1), y.size(1), v.size(2));
    args.b[g] = b[g].data_ptr();
    args.b_rank_dim[g] = static_cast<int>(b[g].size(1));
    args.y[g] = y.data_ptr();
    args.y_row_stride[g] = y.size(0) <= 1 ? y.size(1) : y.stride(0);
    args.out_features[g] = static_cast<int>(y.size(1));
  }
  return args;
}

void expand(std::vector<Tensor> ys, Tensor v, std::vector<Tensor> b, Tensor ranks, Tensor indptr, Tensor slots,
            int64_t mma_min_rows, bool pdl, int64_t stream, int64_t blocks_per_sm, bool write_f32) {
  SGMV_CHECK(!ys.empty(), "sgmv: expand needs at least one output");
  // (the write mode, "expand_write": fp32 outputs, so the B pools carry the kernel's dtype; expand_args checks them)
  const auto dtype = write_f32 && !b.empty() ? kernel_dtype(b[0], "b[0]") : kernel_dtype(ys[0], "ys[0]");
  const lorafleet::ExpandArgs args = expand_args(ys, v, b, ranks, indptr, slots, write_f32);
  const lorafleet::LaunchOptions opt = launch_options(mma_min_rows, pdl, 0, blocks_per_sm);
  if (ys[0].size(0) == 0) return;
  const char* err = lorafleet::sgmv_expand(dtype, args, opt, ys[0].get_device(), as_stream(stream));
  SGMV_CHECK(err == nullptr, "sgmv expand launch failed: %s", err ? err : "");
}

void add(std::vector<Tensor> ys, Tensor v, Tensor x, std::vector<Tensor> a, std::vector<Tensor> b, Tensor ranks,
         Tensor indptr, Tensor slots, Tensor counters, int64_t shrink_mma_min_rows, int64_t expand_mma_min_rows,
         bool pdl, int64_t stream) {
  SGMV_CHECK(a.size() == b.size(), "sgmv: add needs as many A pools as B pools, got %lld and %lld",
             ll(static_cast<int64_t>(a.size())), ll(static_cast<int64_t>(b.size())));
  const auto dtype = kernel_dtype(x, "x");
  const lorafleet::ShrinkArgs sargs = shrink_args(v, x, a, ranks, indptr, slots);
  SGMV_CHECK(!ys.empty() && ys[0].size(0) == x.size(0), "sgmv: ys must have the rows of x");
  SGMV_CHECK(ys[0].scalar_type() == x.scalar_type(), "sgmv: ys[0] has dtype %s but x has %s", dtype_name(ys[0]),
             dtype_name(x));
  check_device(ys[0], Name("ys", 0), x);
  const lorafleet::ExpandArgs eargs = expand_args(ys, v, b, ranks, indptr, slots);
  if (x.size(0) == 0) return;
  const int device = x.get_device();
  const int64_t T = x.size(0);
  const char* err = nullptr;
  if (T >= shrink_mma_min_rows || T >= expand_mma_min_rows) {  // a segment may take the tensor-core path
    err = lorafleet::sgmv_shrink(dtype, sargs, launch_options(shrink_mma_min_rows, pdl), device, as_stream(stream));
    if (err == nullptr)
      err = lorafleet::sgmv_expand(dtype, eargs, launch_options(expand_mma_min_rows, pdl), device, as_stream(stream));
  } else {
    check_device(counters, Name("counters"), x);
    SGMV_CHECK(counters.scalar_type() == torch::kInt && counters.is_contiguous() && counters.dim() == 1 &&
                   counters.numel() >= 2 * slots.numel(),
               "sgmv: counters must be contiguous int32 with at least 2 * capacity = %lld entries",
               ll(2 * slots.numel()));
    err = lorafleet::sgmv_fused(dtype, sargs, eargs, counters.data_ptr<int32_t>(), launch_options(1, pdl), device,
                                as_stream(stream));
  }
  SGMV_CHECK(err == nullptr, "sgmv add launch failed: %s", err ? err : "");
}

lorafleet::RopeKvArgs rope_kv_args(Tensor q_out, Tensor k_cache, Tensor v_cache, Tensor qkv, Tensor positions,
                                   Tensor slots, Tensor cos_sin, int64_t num_heads, int64_t num_kv_heads) {
  kernel_dtype(qkv, "qkv");  // fp16 / bf16, or an error
  SGMV_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_kv: qkv must be 2-D with unit column stride");
  const int64_t T = qkv.size(0);
  SGMV_CHECK(num_heads > 0 && num_kv_heads > 0, "rope_kv: head counts must be positive");
  SGMV_CHECK(q_out.dim() == 3 && q_out.is_contiguous() && q_out.size(0) == T && q_out.size(1) == num_heads,
             "rope_kv: q_out must be contiguous [T=%lld, %lld, D]", ll(T), ll(num_heads));
  const int64_t D = q_out.size(2);
  SGMV_CHECK(D % 4 == 0 && D <= 512, "rope_kv: head_dim must be a multiple of 4, at most 512, got %lld", ll(D));
  SGMV_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "rope_kv: qkv has %lld columns, expected %lld",
             ll(qkv.size(1)), ll((num_heads + 2 * num_kv_heads) * D));
  SGMV_CHECK(T <= 1 || qkv.stride(0) % 2 == 0, "rope_kv: qkv row stride must be even");
  SGMV_CHECK(reinterpret_cast<uintptr_t>(qkv.data_ptr()) % 4 == 0, "rope_kv: qkv must be 4-byte aligned");
  for (const Tensor* c : {&k_cache, &v_cache}) {
    SGMV_CHECK(c->dim() == 3 && c->is_contiguous() && c->size(1) == num_kv_heads && c->size(2) == D,
               "rope_kv: the K/V caches must be contiguous [slots, %lld, %lld]", ll(num_kv_heads), ll(D));
    SGMV_CHECK(c->scalar_type() == qkv.scalar_type() || c->scalar_type() == torch::kFloat8_e4m3fn,
               "rope_kv: cache dtype %s is neither qkv's %s nor float8_e4m3fn", dtype_name(*c), dtype_name(qkv));
    SGMV_CHECK(reinterpret_cast<uintptr_t>(c->data_ptr()) % 4 == 0, "rope_kv: the K/V caches must be 4-byte aligned");
    check_device(*c, Name("cache"), qkv);
  }
  SGMV_CHECK(k_cache.size(0) == v_cache.size(0), "rope_kv: K and V caches differ in size");
  SGMV_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "rope_kv: K and V caches differ in dtype");
  SGMV_CHECK(q_out.scalar_type() == qkv.scalar_type(), "rope_kv: q_out dtype %s differs from qkv's %s",
             dtype_name(q_out), dtype_name(qkv));
  for (const Tensor* ix : {&positions, &slots}) {
    SGMV_CHECK(ix->scalar_type() == torch::kLong && ix->dim() == 1 && ix->is_contiguous() && ix->size(0) >= T,
               "rope_kv: positions and slots must be contiguous int64 with at least T=%lld entries", ll(T));
    check_device(*ix, Name("positions/slots"), qkv);
  }
  SGMV_CHECK(cos_sin.scalar_type() == torch::kFloat && cos_sin.dim() == 2 && cos_sin.is_contiguous() &&
                 cos_sin.size(1) == D && cos_sin.size(0) > 0,
             "rope_kv: cos_sin must be contiguous float32 [P, D=%lld]", ll(D));
  check_device(q_out, Name("q_out"), qkv);
  check_device(cos_sin, Name("cos_sin"), qkv);
  SGMV_CHECK(T <= kInt32Max, "rope_kv: too many tokens");
  lorafleet::RopeKvArgs a;
  a.cache_e4m3 = k_cache.scalar_type() == torch::kFloat8_e4m3fn;
  a.qkv = qkv.data_ptr();
  a.qkv_row_stride = T <= 1 ? qkv.size(1) : qkv.stride(0);
  a.positions = positions.data_ptr<int64_t>();
  a.slots = slots.data_ptr<int64_t>();
  a.cos_sin = cos_sin.data_ptr<float>();
  a.num_positions = cos_sin.size(0);
  a.q_out = q_out.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.num_cache_slots = k_cache.size(0);
  a.num_tokens = static_cast<int>(T);
  a.num_heads = static_cast<int>(num_heads);
  a.num_kv_heads = static_cast<int>(num_kv_heads);
  a.head_dim = static_cast<int>(D);
  return a;
}

void launch_rope_kv(const lorafleet::RopeKvArgs& a, const Tensor& qkv, int64_t stream) {
  const char* err = lorafleet::rope_kv(kernel_dtype(qkv, "qkv"), a, qkv.get_device(), as_stream(stream));
  SGMV_CHECK(err == nullptr, "rope_kv launch failed: %s", err ? err : "");
}

void rope_kv(Tensor q_out, Tensor k_cache, Tensor v_cache, Tensor qkv, Tensor positions, Tensor slots, Tensor cos_sin,
             int64_t num_heads, int64_t num_kv_heads, int64_t stream, bool pdl) {
  lorafleet::RopeKvArgs a =
      rope_kv_args(q_out, k_cache, v_cache, qkv, positions, slots, cos_sin, num_heads, num_kv_heads);
  a.pdl = pdl;
  launch_rope_kv(a, qkv, stream);
}

void rope_kv_lora(Tensor q_out, Tensor k_cache, Tensor v_cache, Tensor qkv, Tensor positions, Tensor slots,
                  Tensor cos_sin, int64_t num_heads, int64_t num_kv_heads, int64_t stream, Tensor v,
                  std::vector<Tensor> b, Tensor ranks, Tensor row_slot, bool pdl) {
  lorafleet::RopeKvArgs a =
      rope_kv_args(q_out, k_cache, v_cache, qkv, positions, slots, cos_sin, num_heads, num_kv_heads);
  a.pdl = pdl;
  const int64_t T = qkv.size(0), D = a.head_dim;
  SGMV_CHECK(v.scalar_type() == torch::kFloat && v.dim() == 3 && v.is_contiguous() && v.size(0) >= T && v.size(1) == 3,
             "rope_kv_lora: v must be contiguous float32 [>= T=%lld, 3, R]", ll(T));
  check_device(v, Name("v"), qkv);
  SGMV_CHECK(b.size() == 3, "rope_kv_lora: b must hold the q, k and v pools, got %lld", ll(b.size()));
  const int64_t outs[3] = {num_heads * D, num_kv_heads * D, num_kv_heads * D};
  const int64_t S = b[0].dim() == 3 ? b[0].size(0) : 0;
  for (int g = 0; g < 3; ++g) {
    SGMV_CHECK(b[g].dim() == 3 && b[g].is_contiguous() && b[g].size(0) == S && b[g].size(1) >= 1 &&
                   b[g].size(1) <= v.size(2) && b[g].size(1) <= lorafleet::kMaxRank && b[g].size(2) == outs[g],
               "rope_kv_lora: b[%d] must be contiguous [S=%lld, 1..min(R, %d), %lld]", g, ll(S), lorafleet::kMaxRank,
               ll(outs[g]));
    SGMV_CHECK(b[g].scalar_type() == qkv.scalar_type(), "rope_kv_lora: b[%d] dtype %s differs from qkv's %s", g,
               dtype_name(b[g]), dtype_name(qkv));
    SGMV_CHECK(reinterpret_cast<uintptr_t>(b[g].data_ptr()) % 4 == 0, "rope_kv_lora: b[%d] must be 4-byte aligned", g);
    check_device(b[g], Name("b"), qkv);
    a.lora.b[g] = b[g].data_ptr();
    a.lora.b_rank_dim[g] = static_cast<int>(b[g].size(1));
  }
  SGMV_CHECK(S >= 1 && S <= kInt32Max, "rope_kv_lora: the adapter pool has no slots");
  SGMV_CHECK(ranks.scalar_type() == torch::kInt && ranks.is_contiguous() && ranks.dim() == 2 && ranks.size(0) == 3 &&
                 ranks.size(1) == S,
             "rope_kv_lora: ranks must be contiguous int32 [3, S=%lld]", ll(S));
  SGMV_CHECK(row_slot.scalar_type() == torch::kInt && row_slot.dim() == 1 && row_slot.is_contiguous() &&
                 row_slot.size(0) >= T,
             "rope_kv_lora: row_slot must be contiguous int32 with at least T=%lld entries", ll(T));
  check_device(ranks, Name("ranks"), qkv);
  check_device(row_slot, Name("row_slot"), qkv);
  a.lora.v = v.data_ptr<float>();
  a.lora.v_row_stride = v.stride(0);
  a.lora.v_rank_dim = static_cast<int>(v.size(2));
  a.lora.ranks = ranks.data_ptr<int32_t>();
  a.lora.row_slot = row_slot.data_ptr<int32_t>();
  a.lora.num_slots = static_cast<int>(S);
  launch_rope_kv(a, qkv, stream);
}

bool overlap(const Tensor& a, const Tensor& b) {
  const auto pa = reinterpret_cast<uintptr_t>(a.data_ptr()), pb = reinterpret_cast<uintptr_t>(b.data_ptr());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

// The checks of rms_norm and norm_shrink -> the norm's arguments.
lorafleet::NormArgs norm_args(const Tensor& x_out, const Tensor& h, const std::optional<Tensor>& res,
                              const std::optional<Tensor>& res_out, const Tensor& w, double eps, double offset,
                              const std::optional<Tensor>& quant_out, const std::optional<Tensor>& quant_scale) {
  kernel_dtype(h, "h");
  SGMV_CHECK(h.is_cuda() && h.dim() == 2 && h.is_contiguous(), "rms_norm: h must be a contiguous 2-D CUDA tensor");
  SGMV_CHECK(h.size(1) >= 8 && h.size(1) % 8 == 0, "rms_norm: the width must be a multiple of 8, got %lld",
             ll(h.size(1)));
  SGMV_CHECK(h.numel() <= kInt32Max, "rms_norm: h is too large");
  SGMV_CHECK(res.has_value() == res_out.has_value(), "rms_norm: res and res_out go together");
  SGMV_CHECK(quant_out.has_value() == quant_scale.has_value(), "rms_norm: quant_out and quant_scale go together");
  std::vector<std::pair<const Tensor*, const char*>> rows = {{&h, "h"}, {&x_out, "x_out"}};
  if (res.has_value()) {
    rows.push_back({&*res, "res"});
    rows.push_back({&*res_out, "res_out"});
  }
  for (const auto& [t, name] : rows) {
    check_device(*t, Name(name), h);
    SGMV_CHECK(t->scalar_type() == h.scalar_type() && t->is_contiguous() && t->sizes() == h.sizes() && aligned16(*t),
               "rms_norm: %s must be contiguous, 16-byte aligned, of h's dtype and shape [%lld, %lld]", name,
               ll(h.size(0)), ll(h.size(1)));
  }
  check_device(w, Name("w"), h);
  SGMV_CHECK(w.scalar_type() == h.scalar_type() && w.dim() == 1 && w.numel() == h.size(1) && w.is_contiguous() &&
                 aligned16(w), "rms_norm: w must be contiguous, 16-byte aligned, of h's dtype, [%lld]", ll(h.size(1)));
  SGMV_CHECK(!overlap(x_out, h) && !overlap(x_out, w) && (!res.has_value() || (!overlap(x_out, *res) &&
             !overlap(*res_out, h) && !overlap(*res_out, *res) && !overlap(*res_out, x_out))),
             "rms_norm: the outputs (x_out, res_out) must not overlap the inputs or each other");
  lorafleet::NormArgs a;
  a.h = h.data_ptr();
  a.res = res.has_value() ? res->data_ptr() : nullptr;
  a.res_out = res.has_value() ? res_out->data_ptr() : nullptr;
  a.w = w.data_ptr();
  a.x_out = x_out.data_ptr();
  if (quant_out.has_value()) {
    check_e4m3_out("rms_norm", *quant_out, "quant_out", *quant_scale, "quant_scale", h);
    a.quant_out = static_cast<uint8_t*>(quant_out->data_ptr());
    a.quant_scale = quant_scale->data_ptr<float>();
  }
  SGMV_CHECK(eps >= 0 && offset >= 0, "rms_norm: eps and offset must be >= 0");
  a.eps = static_cast<float>(eps);
  a.offset = static_cast<float>(offset);
  a.rows = static_cast<int>(h.size(0));
  a.cols = static_cast<int>(h.size(1));
  return a;
}

void rms_norm(Tensor x_out, Tensor h, std::optional<Tensor> res, std::optional<Tensor> res_out, Tensor w, double eps,
              double offset, std::optional<Tensor> quant_out, std::optional<Tensor> quant_scale, bool pdl,
              int64_t stream, int64_t max_blocks, bool early) {
  lorafleet::NormArgs a = norm_args(x_out, h, res, res_out, w, eps, offset, quant_out, quant_scale);
  a.early = early;
  SGMV_CHECK(max_blocks >= 0, "rms_norm: max_blocks must be >= 0 (0: no cap)");
  const char* err = lorafleet::rms_norm_rows(kernel_dtype(h, "h"), a, pdl,
                                             static_cast<int>(std::min<int64_t>(max_blocks, kInt32Max)),
                                             h.get_device(), as_stream(stream));
  SGMV_CHECK(err == nullptr, "rms_norm launch failed: %s", err ? err : "");
}

void norm_shrink(Tensor v, Tensor x_out, Tensor h, std::optional<Tensor> res, std::optional<Tensor> res_out, Tensor w,
                 double eps, double offset, std::vector<Tensor> a, Tensor ranks, Tensor indptr, Tensor slots, bool pdl,
                 int64_t stream, int64_t max_blocks, int64_t decode_ranks, std::optional<Tensor> quant_out,
                 std::optional<Tensor> quant_scale) {
  const lorafleet::NormArgs n = norm_args(x_out, h, res, res_out, w, eps, offset, quant_out, quant_scale);
  lorafleet::ShrinkArgs args = shrink_args(v, x_out, a, ranks, indptr, slots);
  const lorafleet::LaunchOptions opt = launch_options(1 << 30, pdl, max_blocks, 0, decode_ranks);
  if (h.size(0) == 0) return;
  const char* err = lorafleet::sgmv_norm_shrink(kernel_dtype(h, "h"), n, args, opt, h.get_device(), as_stream(stream));
  SGMV_CHECK(err == nullptr, "norm_shrink launch failed: %s", err ? err : "");
}

void quantize_e4m3(Tensor out, Tensor scale, Tensor x, int64_t stream) {
  const auto dtype = kernel_dtype(x, "x");
  SGMV_CHECK(x.is_cuda() && x.dim() == 2 && x.stride(1) == 1, "quantize_e4m3: x must be a 2-D CUDA tensor with unit "
             "column stride");
  check_e4m3_out("quantize_e4m3", out, "out", scale, "scale", x);
  SGMV_CHECK(x.size(0) <= kInt32Max && x.size(1) <= kInt32Max, "quantize_e4m3: x is too large");
  lorafleet::QuantizeRowsArgs a;
  a.x = x.data_ptr();
  a.x_row_stride = x.stride(0);
  a.out = out.data_ptr();
  a.scale = scale.data_ptr<float>();
  a.rows = static_cast<int>(x.size(0));
  a.cols = static_cast<int>(x.size(1));
  const char* err = lorafleet::quantize_rows_e4m3(dtype, a, x.get_device(), as_stream(stream));
  SGMV_CHECK(err == nullptr, "quantize_e4m3 launch failed: %s", err ? err : "");
}

// The checks and launch of fp8_gemm and fp8_gemm_bf16: x e4m3 with x_scale, or bf16 (x_scale undefined).
void fp8_gemm_impl(Tensor& out, Tensor& x, const Tensor* x_scale, Tensor& w, Tensor& w_scale, int64_t stream) {
  const bool bf16 = x_scale == nullptr;
  SGMV_CHECK(x.is_cuda() && x.scalar_type() == (bf16 ? torch::kBFloat16 : torch::kFloat8_e4m3fn) && x.dim() == 2 &&
                 x.is_contiguous(),
             "fp8_gemm: x must be a contiguous 2-D %s CUDA tensor", bf16 ? "bfloat16" : "float8_e4m3fn");
  for (const Tensor* t : {&w, &w_scale, &out}) check_device(*t, Name("fp8_gemm operand"), x);
  if (!bf16) check_device(*x_scale, Name("fp8_gemm operand"), x);
  SGMV_CHECK(w.scalar_type() == torch::kFloat8_e4m3fn && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
             "fp8_gemm: w must be contiguous float8_e4m3fn [N, K=%lld]", ll(x.size(1)));
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  SGMV_CHECK(M <= lorafleet::kFp8GemmMaxRows, "fp8_gemm: at most %d rows, got %lld", lorafleet::kFp8GemmMaxRows, ll(M));
  SGMV_CHECK(K % 64 == 0 && N % 16 == 0 && K <= kInt32Max && N <= kInt32Max,
             "fp8_gemm: K (%lld) must be a multiple of 64 and N (%lld) of 16", ll(K), ll(N));
  SGMV_CHECK(aligned16(x) && aligned16(w), "fp8_gemm: x and w must be 16-byte aligned");
  if (!bf16)
    SGMV_CHECK(x_scale->scalar_type() == torch::kFloat && x_scale->is_contiguous() && x_scale->numel() == M,
               "fp8_gemm: x_scale must be contiguous float32 with %lld entries", ll(M));
  SGMV_CHECK(w_scale.scalar_type() == torch::kFloat && w_scale.is_contiguous() && w_scale.numel() == N,
             "fp8_gemm: w_scale must be contiguous float32 with %lld entries", ll(N));
  SGMV_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == M &&
                 out.size(1) == N,
             "fp8_gemm: out must be contiguous bfloat16 [%lld, %lld]", ll(M), ll(N));
  lorafleet::Fp8GemmArgs a;
  a.x = static_cast<const uint8_t*>(x.data_ptr());
  a.x_scale = bf16 ? nullptr : x_scale->data_ptr<float>();
  a.x_bf16 = bf16;
  a.w = static_cast<const uint8_t*>(w.data_ptr());
  a.w_scale = w_scale.data_ptr<float>();
  a.out = out.data_ptr();
  a.m = static_cast<int>(M);
  a.n = static_cast<int>(N);
  a.k = static_cast<int>(K);
  // The K-split's partial sums and counters: from torch's allocator (a graph capture's pool while capturing),
  // on torch's current stream of x's device, which `stream` must be (every caller passes it): the memory is
  // released when this returns and reused in that stream's order.
  const size_t ws = lorafleet::fp8_gemm_workspace(a.m, a.n, a.k, x.get_device());
  Tensor workspace;
  if (ws > 0) {
    workspace = torch::empty({static_cast<int64_t>(ws)}, x.options().dtype(torch::kUInt8));
    a.workspace = workspace.data_ptr();
    a.workspace_bytes = ws;
  }
  const char* err = lorafleet::fp8_gemm(a, x.get_device(), as_stream(stream));
  SGMV_CHECK(err == nullptr, "fp8_gemm launch failed: %s", err ? err : "");
}

void fp8_gemm(Tensor out, Tensor x, Tensor x_scale, Tensor w, Tensor w_scale, int64_t stream) {
  fp8_gemm_impl(out, x, &x_scale, w, w_scale, stream);
}

void fp8_gemm_bf16(Tensor out, Tensor x, Tensor w, Tensor w_scale, int64_t stream) {
  fp8_gemm_impl(out, x, nullptr, w, w_scale, stream);
}

// The wgmma product's arguments for x [M, K] @ w [N, K].T, both e4m3 or both bf16, checked (the output is the
// caller's).
lorafleet::Fp8Sm90Args sm90_args(const Tensor& x, const Tensor& w, int64_t splits, bool pdl, const char* who) {
  SGMV_CHECK(lorafleet::fp8_gemm_sm90_built(), "%s: this build has no sm90 FP8 GEMM (CUTLASS not found)", who);
  SGMV_CHECK(x.is_cuda() && (x.scalar_type() == torch::kFloat8_e4m3fn || x.scalar_type() == torch::kBFloat16) &&
                 x.dim() == 2 && x.is_contiguous(),
             "%s: x must be a contiguous 2-D float8_e4m3fn or bfloat16 CUDA tensor", who);
  check_device(w, Name("w"), x);
  // (w's rows may lie further apart than K: a weight with spare columns, TMA reading rows 16-byte aligned)
  SGMV_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 2 && w.size(1) == x.size(1) &&
                 (w.size(0) == 1 || (w.stride(0) >= w.size(1) && w.stride(0) * w.element_size() % 16 == 0)) &&
                 (w.size(1) == 1 || w.stride(1) == 1),
             "%s: w must be %s [N, K=%lld] with unit column stride and 16-byte aligned rows at least K apart "
             "(x's dtype)", who, x.scalar_type() == torch::kBFloat16 ? "bfloat16" : "float8_e4m3fn", ll(x.size(1)));
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  SGMV_CHECK(M >= 1 && M <= lorafleet::kFp8Sm90MaxRows, "%s: 1 to %d rows, got %lld", who,
             lorafleet::kFp8Sm90MaxRows, ll(M));
  SGMV_CHECK(splits >= 1 && splits <= 16, "%s: splits must be in [1, 16], got %lld", who, ll(splits));
  SGMV_CHECK(K % (16 * splits) == 0 && N % 4 == 0 && K <= kInt32Max && N <= kInt32Max,
             "%s: K (%lld) must be a multiple of 16 * splits (%lld) and N (%lld) of 4", who, ll(K), ll(splits), ll(N));
  SGMV_CHECK(aligned16(x) && aligned16(w), "%s: x and w must be 16-byte aligned", who);
  lorafleet::Fp8Sm90Args a;
  a.x = static_cast<const uint8_t*>(x.data_ptr());
  a.w = static_cast<const uint8_t*>(w.data_ptr());
  a.m = static_cast<int>(M);
  a.n = static_cast<int>(N);
  a.k = static_cast<int>(K);
  a.splits = static_cast<int>(splits);
  a.pdl = pdl;
  a.bf16 = x.scalar_type() == torch::kBFloat16;
  a.w_ld = w.size(0) == 1 ? K : w.stride(0);
  a.device = x.get_device();
  return a;
}

// The spans `cols` of a product of M rows and N columns on `ref`'s device, and with v the rows' LoRA (v, B pools of
// `b_like`'s dtype, ranks, row slots), checked into `a`: shared by the FP8 epilogue and the shrink first.
void lora_args(lorafleet::Fp8EpilogueArgs& a, const Tensor& ref, const Tensor& b_like, int64_t M, int64_t N,
               const std::vector<int64_t>& cols, const std::optional<Tensor>& v, const std::vector<Tensor>& b,
               const std::optional<Tensor>& ranks, const std::optional<Tensor>& row_slot, const char* who) {
  const int64_t G = static_cast<int64_t>(cols.size());
  SGMV_CHECK(G >= 1 && G <= lorafleet::kMaxGroup, "%s: 1 to %d column spans, got %lld", who, lorafleet::kMaxGroup,
             ll(G));
  int64_t total = 0;
  for (int64_t g = 0; g < G; ++g) {
    SGMV_CHECK(cols[g] > 0 && cols[g] % 8 == 0, "%s: span %lld (%lld columns) must be a positive multiple of 8", who,
               ll(g), ll(cols[g]));
    a.cols[g] = static_cast<int>(cols[g]);
    total += cols[g];
  }
  SGMV_CHECK(total == N, "%s: the spans cover %lld columns, the product has %lld", who, ll(total), ll(N));
  a.num_groups = static_cast<int>(G);
  if (!v.has_value()) return;
  SGMV_CHECK(ranks.has_value() && row_slot.has_value() && static_cast<int64_t>(b.size()) == G,
             "%s: LoRA needs ranks, row_slot and one B pool per span (%lld), got %lld", who, ll(G),
             ll(static_cast<int64_t>(b.size())));
  check_device(*v, Name("v"), ref);
  SGMV_CHECK(v->scalar_type() == torch::kFloat && v->dim() == 3 && v->is_contiguous() && v->size(0) >= M &&
                 v->size(1) == G && v->size(2) >= 1,
             "%s: v must be contiguous float32 [>= %lld, %lld, R]", who, ll(M), ll(G));
  check_device(*ranks, Name("ranks"), ref);
  SGMV_CHECK(ranks->scalar_type() == torch::kInt && ranks->is_contiguous() && ranks->dim() == 2 &&
                 ranks->size(0) == G && ranks->size(1) >= 1 && ranks->size(1) <= kInt32Max,
             "%s: ranks must be contiguous int32 [%lld, S]", who, ll(G));
  const int64_t S = ranks->size(1);
  for (int64_t g = 0; g < G; ++g) {
    check_weight_pool(b[g], Name("b", g), b_like, S, cols[g], v->size(2));
    a.lora.b[g] = b[g].data_ptr();
    a.lora.b_rank_dim[g] = static_cast<int>(b[g].size(1));
  }
  check_device(*row_slot, Name("row_slot"), ref);
  SGMV_CHECK(row_slot->scalar_type() == torch::kInt && row_slot->dim() == 1 && row_slot->is_contiguous() &&
                 row_slot->size(0) >= M,
             "%s: row_slot must be contiguous int32 with at least %lld entries", who, ll(M));
  a.lora.v = v->data_ptr<float>();
  a.lora.v_row_stride = v->stride(0);
  a.lora.v_rank_dim = static_cast<int>(v->size(2));
  a.lora.ranks = ranks->data_ptr<int32_t>();
  a.lora.row_slot = row_slot->data_ptr<int32_t>();
  a.lora.num_slots = static_cast<int>(S);
}

// The FP8 epilogue's arguments (all but y, splits and pdl) for a product of M rows and N columns on `ref`'s device,
// checked: shared by fp8_epilogue and fp8_gemm_sm90_fused.
lorafleet::Fp8EpilogueArgs epilogue_args(const Tensor& ref, int64_t M, int64_t N, Tensor out, Tensor x_scale,
                                         Tensor w_scale, std::optional<Tensor> bias, std::vector<int64_t> cols,
                                         std::optional<Tensor> v, std::vector<Tensor> b, std::optional<Tensor> ranks,
                                         std::optional<Tensor> row_slot, int64_t act) {
  check_device(out, Name("out"), ref);
  SGMV_CHECK(act >= 0 && act <= 2, "fp8_epilogue: act must be 0 (none), 1 (SiLU) or 2 (GELU-tanh), got %lld", ll(act));
  SGMV_CHECK(act == 0 || (cols.size() == 2 && cols[0] == cols[1]),
             "fp8_epilogue: an activation needs two spans of equal width (gate, up)");
  const int64_t out_cols = act == 0 ? N : N / 2;
  SGMV_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == M && out.size(1) == out_cols && aligned16(out),
             "fp8_epilogue: out must be contiguous, 16-byte aligned [%lld, %lld]", ll(M), ll(out_cols));
  SGMV_CHECK(N % 8 == 0 && M <= 65535 && N <= kInt32Max,
             "fp8_epilogue: the product must have a multiple of 8 columns and at most 65535 rows");
  check_device(x_scale, Name("x_scale"), ref);
  check_device(w_scale, Name("w_scale"), ref);
  SGMV_CHECK(x_scale.scalar_type() == torch::kFloat && x_scale.is_contiguous() && x_scale.numel() == M,
             "fp8_epilogue: x_scale must be contiguous float32 with %lld entries", ll(M));
  SGMV_CHECK(w_scale.scalar_type() == torch::kFloat && w_scale.is_contiguous() && w_scale.numel() == N &&
                 aligned16(w_scale),
             "fp8_epilogue: w_scale must be contiguous, 16-byte aligned float32 with %lld entries", ll(N));
  lorafleet::Fp8EpilogueArgs a;
  a.act = static_cast<int>(act);
  lora_args(a, ref, out, M, N, cols, v, b, ranks, row_slot, "fp8_epilogue");
  if (bias.has_value()) {
    check_device(*bias, Name("bias"), ref);
    SGMV_CHECK(bias->scalar_type() == out.scalar_type() && bias->is_contiguous() && bias->numel() == N &&
                   aligned16(*bias),
               "fp8_epilogue: bias must be contiguous, 16-byte aligned %s with %lld entries", dtype_name(out), ll(N));
    a.bias = bias->data_ptr();
  }
  a.x_scale = x_scale.data_ptr<float>();
  a.w_scale = w_scale.data_ptr<float>();
  a.out = out.data_ptr();
  a.m = static_cast<int>(M);
  a.n = static_cast<int>(N);
  return a;
}

// lora_x, the bf16 rows an e4m3 product's x was quantized from, for its shrink first: on x's device,
// contiguous, 16-byte aligned bfloat16 [m, k].
void check_lora_x(const Tensor& lora_x, const Tensor& x, int m, int k, const char* who) {
  check_device(lora_x, Name("lora_x"), x);
  SGMV_CHECK(lora_x.scalar_type() == torch::kBFloat16 && lora_x.dim() == 2 && lora_x.is_contiguous() &&
                 lora_x.size(0) == m && lora_x.size(1) == k && aligned16(lora_x),
             "%s: lora_x must be contiguous, 16-byte aligned bfloat16 [%d, %d] (x's bf16 rows)", who, m, k);
}

// The rows' shrink inside a product (fp8_gemm_sm90_fused's of x; fp8_gemm_sm90's shrink first, of lora_x): one A
// pool [S, R, K] per span of `x_bf16`'s dtype and K, and the call site's counters (int32, zero), into `e` (its LoRA
// given), with x_bf16 as the rows the shrink reads and the warps that take it (`producer`: the producer's).
void add_shrink(lorafleet::Fp8EpilogueArgs& e, const Tensor& x_bf16, const std::optional<Tensor>& v,
                const std::optional<Tensor>& ranks, const std::vector<Tensor>& a, const Tensor& sync, int64_t min_sync,
                bool producer, const char* who) {
  const int64_t G = e.num_groups;
  SGMV_CHECK(x_bf16.scalar_type() == torch::kBFloat16 && v.has_value() && static_cast<int64_t>(a.size()) == G,
             "%s: the shrink inside the product takes bf16 x, LoRA (v, B pools, ranks, row_slot) and one A pool per "
             "span (%lld)", who, ll(G));
  check_device(sync, Name("sync"), x_bf16);
  SGMV_CHECK(sync.scalar_type() == torch::kInt && sync.dim() == 1 && sync.is_contiguous() &&
                 sync.numel() >= min_sync && reinterpret_cast<uintptr_t>(sync.data_ptr()) % 4 == 0,
             "%s: sync must be contiguous int32 with at least %lld entries (zero)", who, ll(min_sync));
  for (int64_t i = 0; i < G; ++i) {
    check_weight_pool(a[i], Name("a", i), x_bf16, ranks->size(1), x_bf16.size(1), v->size(2));
    // (every v entry the expand reads below B's rank dimension is one the shrink writes)
    SGMV_CHECK(a[i].size(1) >= e.lora.b_rank_dim[i], "%s: a[%lld] has rank dimension %lld, below b[%lld]'s %d", who,
               ll(i), ll(a[i].size(1)), ll(i), e.lora.b_rank_dim[i]);
    e.lora.a[i] = a[i].data_ptr();
    e.lora.a_rank_dim[i] = static_cast<int>(a[i].size(1));
    e.lora.a_rank_max = std::max(e.lora.a_rank_max, e.lora.a_rank_dim[i]);
  }
  e.lora.sync = reinterpret_cast<unsigned*>(sync.data_ptr());
  e.lora.x = x_bf16.data_ptr();
  e.lora.shrink_producer = producer;
}

void fp8_gemm_sm90(Tensor out, Tensor x, Tensor w, int64_t stream, int64_t splits, bool pdl, bool persistent,
                   std::optional<Tensor> lora_x, std::vector<int64_t> cols, std::optional<Tensor> v,
                   std::vector<Tensor> b, std::optional<Tensor> ranks, std::optional<Tensor> row_slot,
                   std::vector<Tensor> a_pools, std::optional<Tensor> sync, bool shrink_producer) {
  lorafleet::Fp8Sm90Args a = sm90_args(x, w, splits, pdl, "fp8_gemm_sm90");
  a.persistent = persistent;
  // the shrink first: x's bf16 rows, the spans, LoRA and one A pool per span, and the call site's counter
  lorafleet::Fp8EpilogueArgs shrink;
  SGMV_CHECK(lora_x.has_value() == sync.has_value(), "fp8_gemm_sm90: the shrink first needs both lora_x and sync "
             "(or neither)");
  // (LoRA's operands without them would be ignored: v never written)
  SGMV_CHECK(lora_x.has_value() || (cols.empty() && !v.has_value() && b.empty() && !ranks.has_value() &&
                                    !row_slot.has_value() && a_pools.empty()),
             "fp8_gemm_sm90: cols, v, b, ranks, row_slot and a are the shrink first's: they need lora_x and sync");
  if (lora_x.has_value()) {
    SGMV_CHECK(!persistent, "fp8_gemm_sm90: the shrink first takes one CTA a tile, not persistent");
    // (bf16 operands: lora_x is x itself)
    SGMV_CHECK(x.scalar_type() != torch::kBFloat16 || lora_x->is_same(x),
               "fp8_gemm_sm90: with bf16 operands the shrink first's lora_x is x itself");
    check_lora_x(*lora_x, x, a.m, a.k, "fp8_gemm_sm90");
    SGMV_CHECK(v.has_value(), "fp8_gemm_sm90: the shrink first needs LoRA (v, b, ranks, row_slot)");
    lora_args(shrink, x, *lora_x, a.m, a.n, cols, v, b, ranks, row_slot, "fp8_gemm_sm90");
    add_shrink(shrink, *lora_x, v, ranks, a_pools, *sync, 1, shrink_producer, "fp8_gemm_sm90");
    shrink.m = a.m;
    shrink.n = a.n;
    a.shrink = &shrink;
  }
  const int64_t M = a.m, N = a.n;
  check_device(out, Name("out"), x);
  const bool shape_ok = splits == 1 ? out.dim() == 2 && out.size(0) == M && out.size(1) == N
                                    : out.dim() == 3 && out.size(0) == splits && out.size(1) == M && out.size(2) == N;
  SGMV_CHECK(out.scalar_type() == torch::kFloat && out.is_contiguous() && shape_ok,
             "fp8_gemm_sm90: out must be contiguous float32 [%lld, %lld] (splits 1) or [splits, %lld, %lld]", ll(M),
             ll(N), ll(M), ll(N));
  SGMV_CHECK(aligned16(out), "fp8_gemm_sm90: out must be 16-byte aligned");
  a.out = out.data_ptr<float>();
  const char* err = lorafleet::fp8_gemm_sm90(a, as_stream(stream));
  SGMV_CHECK(err == nullptr, "fp8_gemm_sm90 launch failed: %s", err ? err : "");
}

void fp8_epilogue(Tensor out, Tensor y, Tensor x_scale, Tensor w_scale, std::optional<Tensor> bias,
                  std::vector<int64_t> cols, std::optional<Tensor> v, std::vector<Tensor> b,
                  std::optional<Tensor> ranks, std::optional<Tensor> row_slot, bool pdl, int64_t stream, int64_t act,
                  bool early) {
  const auto dtype = kernel_dtype(out, "out");
  SGMV_CHECK(y.is_cuda() && y.scalar_type() == torch::kFloat && (y.dim() == 2 || y.dim() == 3) && y.is_contiguous(),
             "fp8_epilogue: y must be a contiguous float32 CUDA tensor [M, N] or [splits, M, N]");
  const int64_t splits = y.dim() == 3 ? y.size(0) : 1;
  SGMV_CHECK(splits >= 1 && splits <= 16, "fp8_epilogue: 1 to 16 partial sums in y, got %lld", ll(splits));
  const int64_t M = y.size(y.dim() - 2), N = y.size(y.dim() - 1);
  SGMV_CHECK(aligned16(y), "fp8_epilogue: y must be 16-byte aligned");
  lorafleet::Fp8EpilogueArgs a = epilogue_args(y, M, N, out, x_scale, w_scale, bias, std::move(cols), v, std::move(b),
                                               ranks, row_slot, act);
  a.splits = static_cast<int>(splits);
  a.y = y.data_ptr<float>();
  a.pdl = pdl;
  a.early = early;
  const char* err = lorafleet::fp8_epilogue(dtype, a, y.get_device(), as_stream(stream));
  SGMV_CHECK(err == nullptr, "fp8_epilogue launch failed: %s", err ? err : "");
}

void fp8_gemm_sm90_fused(Tensor out, Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, std::optional<Tensor> bias,
                         std::vector<int64_t> cols, std::optional<Tensor> v, std::vector<Tensor> b,
                         std::optional<Tensor> ranks, std::optional<Tensor> row_slot, bool pdl, int64_t stream,
                         std::vector<Tensor> a, std::optional<Tensor> sync, bool persistent,
                         bool shrink_producer) {
  lorafleet::Fp8Sm90Args g = sm90_args(x, w, 1, pdl, "fp8_gemm_sm90_fused");
  g.persistent = persistent;
  SGMV_CHECK(out.scalar_type() == torch::kBFloat16, "fp8_gemm_sm90_fused: out must be bfloat16, got %s",
             dtype_name(out));
  lorafleet::Fp8EpilogueArgs e = epilogue_args(x, g.m, g.n, out, x_scale, w_scale, bias, std::move(cols), v,
                                               std::move(b), ranks, row_slot, 0);
  // the rows' shrink inside the product (bf16 operands): one A pool per span over x's K, and the call site's three
  // counters (four with the shrink on the producer's warps)
  SGMV_CHECK(sync.has_value() == !a.empty(), "fp8_gemm_sm90_fused: the shrink inside the product needs both a and "
             "sync (or neither)");
  if (sync.has_value()) {
    SGMV_CHECK(x.scalar_type() == torch::kBFloat16, "fp8_gemm_sm90_fused: the shrink inside takes bf16 operands "
               "(e4m3 products take the shrink first: fp8_gemm_sm90)");
    add_shrink(e, x, v, ranks, a, *sync, shrink_producer ? 4 : 3, shrink_producer, "fp8_gemm_sm90_fused");
  }
  const char* err = lorafleet::fp8_gemm_sm90_fused(g, e, as_stream(stream));
  SGMV_CHECK(err == nullptr, "fp8_gemm_sm90_fused launch failed: %s", err ? err : "");
}

void decode_attention(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor indptr, Tensor indices,
                      Tensor last_page_len, Tensor partial_o, Tensor partial_ml, Tensor counters, double sm_scale,
                      double soft_cap, int64_t window_left, int64_t chunk, int64_t max_chunks, int64_t workers,
                      int64_t stream, int64_t stages, bool pdl, bool int_convert, bool tensor_cores) {
  const auto dtype = kernel_dtype(q, "q");
  SGMV_CHECK(q.is_cuda() && q.dim() == 3 && q.is_contiguous() && reinterpret_cast<uintptr_t>(q.data_ptr()) % 4 == 0,
             "decode_attention: q must be a contiguous, 4-byte aligned [B, Hq, D] CUDA tensor");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  SGMV_CHECK(out.scalar_type() == q.scalar_type() && out.sizes() == q.sizes() && out.is_contiguous(),
             "decode_attention: out must be contiguous, of q's dtype and shape [%lld, %lld, %lld]", ll(B), ll(H),
             ll(D));
  for (const Tensor* c : {&k_cache, &v_cache}) {
    SGMV_CHECK(c->dim() == 4 && c->is_contiguous() && c->size(3) == D && aligned16(*c),
               "decode_attention: the K/V pages must be contiguous, 16-byte aligned [pages, page_size, Hkv, D=%lld]",
               ll(D));
    SGMV_CHECK(c->scalar_type() == q.scalar_type() || c->scalar_type() == torch::kFloat8_e4m3fn,
               "decode_attention: page dtype %s is neither q's %s nor float8_e4m3fn", dtype_name(*c), dtype_name(q));
    check_device(*c, Name("k_cache/v_cache"), q);
  }
  SGMV_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
             "decode_attention: K and V pages differ in shape or dtype");
  const int64_t Hkv = k_cache.size(2);
  SGMV_CHECK(Hkv > 0 && H % Hkv == 0 && lorafleet::decode_attention_supports(static_cast<int>(D),
                                                                              static_cast<int>(H / Hkv)),
             "decode_attention: head_dim %lld with %lld query heads per K/V head is not supported (64, 128 or 256; "
             "at most 8)", ll(D), ll(Hkv > 0 ? H / Hkv : 0));
  SGMV_CHECK(B <= 65535 && Hkv <= 65535, "decode_attention: too many requests or K/V heads");
  SGMV_CHECK(chunk > 0 && chunk % 16 == 0 && chunk <= kInt32Max && max_chunks > 0 && max_chunks <= kInt32Max &&
                 workers > 0 && workers <= 65535,
             "decode_attention: chunk must be a positive multiple of 16, max_chunks and workers positive");
  SGMV_CHECK(stages >= 0 && stages <= 8 && lorafleet::decode_attention_stages_ok(static_cast<int>(stages)),
             "decode_attention: stages must be 0, 3 or 5, got %lld", ll(stages));
  const struct { const Tensor* t; const char* name; int64_t min; } ints[] = {
      {&indptr, "indptr", B + 1}, {&indices, "indices", 0}, {&last_page_len, "last_page_len", B},
      {&counters, "counters", B * Hkv}};
  for (const auto& it : ints) {
    SGMV_CHECK(it.t->scalar_type() == torch::kInt && it.t->dim() == 1 && it.t->is_contiguous() &&
                   it.t->numel() >= it.min && it.t->numel() <= kInt32Max,
               "decode_attention: %s must be contiguous int32 with at least %lld entries", it.name, ll(it.min));
    check_device(*it.t, Name(it.name), q);
  }
  const struct { const Tensor* t; const char* name; int64_t min; } floats[] = {
      {&partial_o, "partial_o", B * H * max_chunks * D}, {&partial_ml, "partial_ml", B * H * max_chunks * 2}};
  for (const auto& it : floats) {
    SGMV_CHECK(it.t->scalar_type() == torch::kFloat && it.t->is_contiguous() && it.t->numel() >= it.min,
               "decode_attention: %s must be contiguous float32 with at least %lld entries", it.name, ll(it.min));
    check_device(*it.t, Name(it.name), q);
  }
  check_device(out, Name("out"), q);
  lorafleet::DecodeAttnArgs a;
  a.q = q.data_ptr();
  a.out = out.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.indptr = indptr.data_ptr<int32_t>();
  a.indices = indices.data_ptr<int32_t>();
  a.last_page_len = last_page_len.data_ptr<int32_t>();
  a.partial_o = partial_o.data_ptr<float>();
  a.partial_ml = partial_ml.data_ptr<float>();
  a.counters = counters.data_ptr<int32_t>();
  a.num_pages = k_cache.size(0);
  a.num_indices = indices.numel();
  a.batch = static_cast<int>(B);
  a.num_heads = static_cast<int>(H);
  a.num_kv_heads = static_cast<int>(Hkv);
  a.head_dim = static_cast<int>(D);
  a.page_size = static_cast<int>(k_cache.size(1));
  a.chunk = static_cast<int>(chunk);
  a.max_chunks = static_cast<int>(max_chunks);
  a.workers = static_cast<int>(workers);
  a.sm_scale = static_cast<float>(sm_scale);
  a.soft_cap = static_cast<float>(soft_cap);
  a.window_left = static_cast<int>(std::max<int64_t>(-1, std::min<int64_t>(window_left, kInt32Max)));
  a.kv_e4m3 = k_cache.scalar_type() == torch::kFloat8_e4m3fn;
  a.stages = static_cast<int>(stages);
  a.pdl = pdl;
  a.int_convert = int_convert;
  a.tensor_cores = tensor_cores;
  const char* err = lorafleet::decode_attention(dtype, a, q.get_device(), as_stream(stream));
  SGMV_CHECK(err == nullptr, "decode_attention launch failed: %s", err ? err : "");
}

bool decode_attention_supports(int64_t head_dim, int64_t group) {
  return head_dim <= kInt32Max && group <= kInt32Max &&
         lorafleet::decode_attention_supports(static_cast<int>(head_dim), static_cast<int>(group));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lorafleet CUDA kernels: SGMV (LoRA shrink / expand over segments of a flat batch), rope_kv, quantize_e4m3";
  m.def("shrink", &shrink, "v[rows, g, :r] = x[rows] @ a[g][slot, :r].T for every segment",
        py::arg("v"), py::arg("x"), py::arg("a"), py::arg("ranks"), py::arg("indptr"), py::arg("slots"),
        py::arg("mma_min_rows"), py::arg("pdl"), py::arg("stream"), py::arg("max_blocks") = 0,
        py::arg("blocks_per_sm") = 0, py::arg("decode_ranks") = 0, py::arg("quant_out") = py::none(),
        py::arg("quant_scale") = py::none(), py::arg("x_ready") = false, py::arg("row_items") = false);
  m.def("expand", &expand,
        "ys[g][rows] += v[rows, g, :r] @ b[g][slot, :r] for every segment (write_f32: ys fp32, = instead of +=)",
        py::arg("ys"), py::arg("v"), py::arg("b"), py::arg("ranks"), py::arg("indptr"), py::arg("slots"),
        py::arg("mma_min_rows"), py::arg("pdl"), py::arg("stream"), py::arg("blocks_per_sm") = 0,
        py::arg("write_f32") = false);
  m.def("add", &add, "ys[g][rows] += (x[rows] @ a[g][slot, :r].T) @ b[g][slot, :r] for every segment (fused)",
        py::arg("ys"), py::arg("v"), py::arg("x"), py::arg("a"), py::arg("b"), py::arg("ranks"), py::arg("indptr"),
        py::arg("slots"), py::arg("counters"), py::arg("shrink_mma_min_rows"), py::arg("expand_mma_min_rows"),
        py::arg("pdl"), py::arg("stream"));
  m.def("rope_kv", &rope_kv, "rotary embedding of q (into q_out) and k, and the K/V cache write, in one launch",
        py::arg("q_out"), py::arg("k_cache"), py::arg("v_cache"), py::arg("qkv"), py::arg("positions"),
        py::arg("slots"), py::arg("cos_sin"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("stream"),
        py::arg("pdl") = false);
  m.def("rope_kv_lora", &rope_kv_lora,
        "rope_kv with the qkv rows' LoRA expand (v @ b[g][row_slot]) added first, in the SGMV expand's order",
        py::arg("q_out"), py::arg("k_cache"), py::arg("v_cache"), py::arg("qkv"), py::arg("positions"),
        py::arg("slots"), py::arg("cos_sin"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("stream"),
        py::arg("v"), py::arg("b"), py::arg("ranks"), py::arg("row_slot"), py::arg("pdl") = false);
  m.def("rms_norm", &rms_norm,
        "x_out = RMSNorm(h [+ res]) as ops.py computes it (res_out = h + res), optionally x_out's e4m3 rows, "
        "one launch",
        py::arg("x_out"), py::arg("h"), py::arg("res"), py::arg("res_out"), py::arg("w"), py::arg("eps"),
        py::arg("offset"), py::arg("quant_out"), py::arg("quant_scale"), py::arg("pdl"), py::arg("stream"),
        py::arg("max_blocks") = 0, py::arg("early") = false);
  m.def("norm_shrink", &norm_shrink,
        "rms_norm and the shrink of its output (v[rows, g, :r] = x_out[rows] @ a[g][slot, :r].T) in one launch",
        py::arg("v"), py::arg("x_out"), py::arg("h"), py::arg("res"), py::arg("res_out"), py::arg("w"), py::arg("eps"),
        py::arg("offset"), py::arg("a"), py::arg("ranks"), py::arg("indptr"), py::arg("slots"), py::arg("pdl"),
        py::arg("stream"), py::arg("max_blocks") = 0, py::arg("decode_ranks") = 0, py::arg("quant_out") = py::none(),
        py::arg("quant_scale") = py::none());
  m.def("quantize_e4m3", &quantize_e4m3, "dynamic per-row FP8 (e4m3) quantization of activations, one launch",
        py::arg("out"), py::arg("scale"), py::arg("x"), py::arg("stream"));
  m.def("fp8_gemm", &fp8_gemm, "bf16 (x @ w.T) * x_scale * w_scale for at most 64 e4m3 rows, the weight streamed once",
        py::arg("out"), py::arg("x"), py::arg("x_scale"), py::arg("w"), py::arg("w_scale"), py::arg("stream"));
  m.def("fp8_gemm_bf16", &fp8_gemm_bf16,
        "bf16 (x @ w.T) * w_scale for at most 64 bf16 rows and e4m3 w (weight-only FP8), the weight streamed once",
        py::arg("out"), py::arg("x"), py::arg("w"), py::arg("w_scale"), py::arg("stream"));
  m.def("fp8_gemm_sm90", &fp8_gemm_sm90, "fp32 x @ w.T (unit scales) for at most 64 e4m3 rows on Hopper's wgmma",
        py::arg("out"), py::arg("x"), py::arg("w"), py::arg("stream"), py::arg("splits") = 1, py::arg("pdl") = true,
        py::arg("persistent") = false, py::arg("lora_x") = py::none(), py::arg("cols") = std::vector<int64_t>{},
        py::arg("v") = py::none(), py::arg("b") = std::vector<torch::Tensor>{}, py::arg("ranks") = py::none(),
        py::arg("row_slot") = py::none(), py::arg("a") = std::vector<torch::Tensor>{}, py::arg("sync") = py::none(),
        py::arg("shrink_producer") = false);
  m.def("fp8_gemm_sm90_fused", &fp8_gemm_sm90_fused,
        "bf16 out = the FP8 epilogue (scales, bias, rows' LoRA expand) of x @ w.T on Hopper's wgmma, one launch",
        py::arg("out"), py::arg("x"), py::arg("w"), py::arg("x_scale"), py::arg("w_scale"), py::arg("bias"),
        py::arg("cols"), py::arg("v"), py::arg("b"), py::arg("ranks"), py::arg("row_slot"), py::arg("pdl"),
        py::arg("stream"), py::arg("a") = std::vector<torch::Tensor>{}, py::arg("sync") = py::none(),
        py::arg("persistent") = false, py::arg("shrink_producer") = false);
  m.def("fp8_gemm_sm90_built", &lorafleet::fp8_gemm_sm90_built, "whether this build holds the sm90 FP8 GEMM");
  m.def("fp8_epilogue", &fp8_epilogue,
        "out = (y * x_scale) * w_scale [+ bias] [+ the rows' LoRA expand] for the fp32 unit-scale FP8 product y, "
        "one launch",
        py::arg("out"), py::arg("y"), py::arg("x_scale"), py::arg("w_scale"), py::arg("bias"), py::arg("cols"),
        py::arg("v"), py::arg("b"), py::arg("ranks"), py::arg("row_slot"), py::arg("pdl"), py::arg("stream"),
        py::arg("act") = 0, py::arg("early") = false);
  m.def("decode_attention", &decode_attention,
        "attention of one query row per request over its paged K/V (bf16 / fp16 or e4m3 pages), one launch",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("indptr"), py::arg("indices"),
        py::arg("last_page_len"), py::arg("partial_o"), py::arg("partial_ml"), py::arg("counters"),
        py::arg("sm_scale"), py::arg("soft_cap"), py::arg("window_left"), py::arg("chunk"), py::arg("max_chunks"),
        py::arg("workers"), py::arg("stream"), py::arg("stages") = 0, py::arg("pdl") = false,
        py::arg("int_convert") = false, py::arg("tensor_cores") = false);
  m.def("decode_attention_supports", &decode_attention_supports,
        "whether decode_attention takes this head size and number of query heads per K/V head",
        py::arg("head_dim"), py::arg("group"));
  m.attr("MAX_RANK") = lorafleet::kMaxRank;
  m.attr("MAX_GROUP") = lorafleet::kMaxGroup;
  m.attr("MAX_SEGMENTS") = lorafleet::kMaxSegments;
}
