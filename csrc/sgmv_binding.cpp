// Torch binding of the SGMV launchers (sgmv.h). It validates every input and then enqueues the
// kernels on the CUDA stream that Python passes in as an integer (no c10/cuda headers needed).
//
//   shrink(v, x, a, ranks, indptr, slots, mma_min_rows, pdl, stream):
//       v[rows, g, :r] = x[rows] @ a[g][s, :r, :].T        for every segment (rows, s >= 0) and g
//   expand(ys, v, b, ranks, indptr, slots, mma_min_rows, pdl, stream):
//       ys[g][rows] += v[rows, g, :r] @ b[g][s, :r, :]
//
// with r = ranks[g, s]. The values inside ranks / indptr / slots live on the device and are not
// inspected here (that would need a synchronisation): the kernels clamp ranks to [0, R_g], skip
// slots outside [0, S) and clamp rows to [0, T), so a bad table gives wrong numbers, never a fault.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "sgmv.h"

namespace {

using torch::Tensor;

constexpr int64_t kInt32Max = 2147483647;

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

lorafleet::DType kernel_dtype(const Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kHalf || x.scalar_type() == torch::kBFloat16,
              "sgmv: x must be float16 or bfloat16, got ", x.scalar_type(),
              " (use TorchSGMV for other dtypes)");
  return x.scalar_type() == torch::kHalf ? lorafleet::DType::kFloat16 : lorafleet::DType::kBFloat16;
}

// Every tensor must sit on the device of the reference tensor (x for shrink, ys[0] for expand).
void check_device(const Tensor& t, const std::string& name, const Tensor& ref) {
  TORCH_CHECK(t.is_cuda(), "sgmv: ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == ref.device(), "sgmv: ", name, " is on ", t.device(), " but the inputs are on ",
              ref.device());
}

void check_weight_pool(const Tensor& w, const std::string& name, const Tensor& x, int64_t slots, int64_t width,
                       int64_t v_rank) {
  check_device(w, name, x);
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "sgmv: ", name, " has dtype ", w.scalar_type(),
              " but x has ", x.scalar_type());
  TORCH_CHECK(w.dim() == 3, "sgmv: ", name, " must be [S, R, features], got shape ", w.sizes());
  TORCH_CHECK(w.is_contiguous(), "sgmv: ", name, " must be contiguous");
  TORCH_CHECK(w.size(0) == slots, "sgmv: ", name, " has ", w.size(0), " slots but ranks has ", slots);
  TORCH_CHECK(w.size(1) >= 1 && w.size(1) <= lorafleet::kMaxRank, "sgmv: ", name, " rank dimension ", w.size(1),
              " must be in [1, ", lorafleet::kMaxRank, "]");
  TORCH_CHECK(w.size(1) <= v_rank, "sgmv: ", name, " rank dimension ", w.size(1), " exceeds v.size(2) = ", v_rank);
  TORCH_CHECK(w.size(2) == width, "sgmv: ", name, " has ", w.size(2), " features, expected ", width);
  TORCH_CHECK(aligned16(w), "sgmv: ", name, " must be 16-byte aligned");
}

// Checks v, ranks and the segment table; `x` gives the device and T (ys[0] for expand).
lorafleet::SegmentArgs check_tables(const Tensor& v, const Tensor& x, int64_t groups, const Tensor& ranks,
                                    const Tensor& indptr, const Tensor& slots) {
  TORCH_CHECK(groups >= 1 && groups <= lorafleet::kMaxGroup, "sgmv: 1 to ", lorafleet::kMaxGroup,
              " projections per launch, got ", groups);
  check_device(v, "v", x);
  TORCH_CHECK(v.scalar_type() == torch::kFloat, "sgmv: v must be float32, got ", v.scalar_type());
  TORCH_CHECK(v.dim() == 3 && v.size(0) == x.size(0) && v.size(1) == groups,
              "sgmv: v must be [T, G, R] = [", x.size(0), ", ", groups, ", R], got shape ", v.sizes());
  TORCH_CHECK(v.size(2) >= 1, "sgmv: v has an empty rank dimension");
  TORCH_CHECK(v.is_contiguous(), "sgmv: v must be contiguous");
  TORCH_CHECK(v.numel() <= kInt32Max, "sgmv: v is too large");

  check_device(ranks, "ranks", x);
  TORCH_CHECK(ranks.scalar_type() == torch::kInt, "sgmv: ranks must be int32, got ", ranks.scalar_type());
  TORCH_CHECK(ranks.dim() == 2 && ranks.size(0) == groups, "sgmv: ranks must be [G, S] with G = ", groups,
              ", got shape ", ranks.sizes());
  TORCH_CHECK(ranks.size(1) >= 1 && ranks.size(1) <= kInt32Max, "sgmv: ranks must have at least one slot");
  TORCH_CHECK(ranks.is_contiguous(), "sgmv: ranks must be contiguous");

  check_device(indptr, "indptr", x);
  check_device(slots, "slots", x);
  TORCH_CHECK(indptr.scalar_type() == torch::kInt && slots.scalar_type() == torch::kInt,
              "sgmv: indptr and slots must be int32, got ", indptr.scalar_type(), " and ", slots.scalar_type());
  TORCH_CHECK(indptr.dim() == 1 && slots.dim() == 1 && indptr.numel() == slots.numel() + 1,
              "sgmv: indptr must be [capacity + 1] and slots [capacity], got ", indptr.sizes(), " and ", slots.sizes());
  TORCH_CHECK(slots.numel() >= 1 && slots.numel() <= lorafleet::kMaxSegments, "sgmv: segment capacity ",
              slots.numel(), " must be in [1, ", lorafleet::kMaxSegments, "]");
  TORCH_CHECK(indptr.is_contiguous() && slots.is_contiguous(), "sgmv: indptr and slots must be contiguous");

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

void check_x(const Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "sgmv: x must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 2, "sgmv: x must be [T, in_features], got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "sgmv: x must be contiguous");
  TORCH_CHECK(x.size(1) >= 8 && x.size(1) % 8 == 0, "sgmv: in_features must be a multiple of 8, got ", x.size(1));
  TORCH_CHECK(x.numel() <= kInt32Max, "sgmv: x is too large");
  TORCH_CHECK(aligned16(x), "sgmv: x must be 16-byte aligned");
}

void shrink(Tensor v, Tensor x, std::vector<Tensor> a, Tensor ranks, Tensor indptr, Tensor slots,
            int64_t mma_min_rows, bool pdl, int64_t stream) {
  check_x(x);
  const auto dtype = kernel_dtype(x);
  const int64_t groups = static_cast<int64_t>(a.size());
  lorafleet::ShrinkArgs args;
  args.seg = check_tables(v, x, groups, ranks, indptr, slots);
  args.x = x.data_ptr();
  args.in_features = static_cast<int>(x.size(1));
  args.v = v.data_ptr<float>();
  args.v_rank_dim = static_cast<int>(v.size(2));
  for (int64_t g = 0; g < groups; ++g) {
    check_weight_pool(a[g], "a[" + std::to_string(g) + "]", x, ranks.size(1), x.size(1), v.size(2));
    args.a[g] = a[g].data_ptr();
    args.a_rank_dim[g] = static_cast<int>(a[g].size(1));
  }
  if (x.size(0) == 0) return;
  TORCH_CHECK(mma_min_rows >= 1, "sgmv: mma_min_rows must be >= 1");
  lorafleet::LaunchOptions opt;
  opt.mma_min_rows = static_cast<int>(std::min<int64_t>(mma_min_rows, kInt32Max));
  opt.pdl = pdl;
  const char* err = lorafleet::sgmv_shrink(dtype, args, opt, x.get_device(),
                                           reinterpret_cast<void*>(static_cast<intptr_t>(stream)));
  TORCH_CHECK(err == nullptr, "sgmv shrink launch failed: ", err ? err : "");
}

void expand(std::vector<Tensor> ys, Tensor v, std::vector<Tensor> b, Tensor ranks, Tensor indptr, Tensor slots,
            int64_t mma_min_rows, bool pdl, int64_t stream) {
  TORCH_CHECK(!ys.empty() && ys.size() == b.size(), "sgmv: expand needs one output per B pool, got ", ys.size(),
              " outputs and ", b.size(), " pools");
  const Tensor& y0 = ys[0];
  TORCH_CHECK(y0.is_cuda(), "sgmv: ys[0] must be a CUDA tensor, got device ", y0.device());
  const auto dtype = kernel_dtype(y0);
  const int64_t groups = static_cast<int64_t>(b.size());
  TORCH_CHECK(y0.dim() == 2, "sgmv: ys[0] must be [T, out_features], got shape ", y0.sizes());
  lorafleet::ExpandArgs args;
  args.seg = check_tables(v, y0, groups, ranks, indptr, slots);
  args.v = v.data_ptr<float>();
  args.v_rank_dim = static_cast<int>(v.size(2));
  for (int64_t g = 0; g < groups; ++g) {
    const Tensor& y = ys[g];
    const std::string name = "ys[" + std::to_string(g) + "]";
    check_device(y, name, y0);
    TORCH_CHECK(y.scalar_type() == y0.scalar_type(), "sgmv: ", name, " has dtype ", y.scalar_type(), " but ys[0] has ",
                y0.scalar_type());
    TORCH_CHECK(y.dim() == 2 && y.size(0) == y0.size(0), "sgmv: ", name, " must be [T, out] with T = ", y0.size(0),
                ", got shape ", y.sizes());
    TORCH_CHECK(y.size(1) >= 8 && y.size(1) % 8 == 0, "sgmv: ", name, " width must be a multiple of 8, got ",
                y.size(1));
    TORCH_CHECK(y.stride(1) == 1, "sgmv: ", name, " must have unit column stride, got strides ", y.strides());
    TORCH_CHECK(y.size(0) <= 1 || (y.stride(0) >= y.size(1) && y.stride(0) % 8 == 0), "sgmv: ", name,
                " row stride must be a multiple of 8 and at least its width, got strides ", y.strides());
    TORCH_CHECK(aligned16(y), "sgmv: ", name, " must start 16-byte aligned (column offset a multiple of 8)");
    TORCH_CHECK(y.size(1) <= kInt32Max, "sgmv: ", name, " is too wide");
    check_weight_pool(b[g], "b[" + std::to_string(g) + "]", y0, ranks.size(1), y.size(1), v.size(2));
    args.b[g] = b[g].data_ptr();
    args.b_rank_dim[g] = static_cast<int>(b[g].size(1));
    args.y[g] = y.data_ptr();
    args.y_row_stride[g] = y.size(0) <= 1 ? y.size(1) : y.stride(0);
    args.out_features[g] = static_cast<int>(y.size(1));
  }
  if (y0.size(0) == 0) return;
  TORCH_CHECK(mma_min_rows >= 1, "sgmv: mma_min_rows must be >= 1");
  lorafleet::LaunchOptions opt;
  opt.mma_min_rows = static_cast<int>(std::min<int64_t>(mma_min_rows, kInt32Max));
  opt.pdl = pdl;
  const char* err = lorafleet::sgmv_expand(dtype, args, opt, y0.get_device(),
                                           reinterpret_cast<void*>(static_cast<intptr_t>(stream)));
  TORCH_CHECK(err == nullptr, "sgmv expand launch failed: ", err ? err : "");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lorafleet SGMV kernels (LoRA shrink / expand over segments of a flat batch)";
  m.def("shrink", &shrink, "v[rows, g, :r] = x[rows] @ a[g][slot, :r].T for every segment",
        py::arg("v"), py::arg("x"), py::arg("a"), py::arg("ranks"), py::arg("indptr"), py::arg("slots"),
        py::arg("mma_min_rows"), py::arg("pdl"), py::arg("stream"));
  m.def("expand", &expand, "ys[g][rows] += v[rows, g, :r] @ b[g][slot, :r] for every segment",
        py::arg("ys"), py::arg("v"), py::arg("b"), py::arg("ranks"), py::arg("indptr"), py::arg("slots"),
        py::arg("mma_min_rows"), py::arg("pdl"), py::arg("stream"));
  m.attr("MAX_RANK") = lorafleet::kMaxRank;
  m.attr("MAX_GROUP") = lorafleet::kMaxGroup;
  m.attr("MAX_SEGMENTS") = lorafleet::kMaxSegments;
}
