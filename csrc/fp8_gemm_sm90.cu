// fp8_gemm_sm90 (see fp8_gemm_sm90.h): the entry points and the e4m3 operands' kernels; the kernels themselves are
// in sm90_gemm.cuh, the bf16 operands' instantiations in fp8_gemm_sm90_bf16.cu.
#include <algorithm>

#include "sm90_gemm.cuh"

namespace lorafleet {

#ifdef LORAFLEET_SM90_GEMM

bool fp8_gemm_sm90_built() { return true; }

namespace {

// The product's size checks, shared by both entry points.
const char* sizes_error(const Fp8Sm90Args& a) {
  if (a.m <= 0 || a.m > kFp8Sm90MaxRows || a.n <= 0 || a.k <= 0) return "fp8_gemm_sm90(_fused): sizes out of range";
  if (a.splits < 1 || a.k % (16 * a.splits) != 0 || a.n % 4 != 0)
    return "fp8_gemm_sm90(_fused): K must be a multiple of 16 * splits and N of 4";
  if (a.w_ld != 0 && (a.w_ld < a.k || a.w_ld * (a.bf16 ? 2 : 1) % 16 != 0))
    return "fp8_gemm_sm90(_fused): w_ld must be at least K and a multiple of 16 bytes";
  if (a.device < 0) return "fp8_gemm_sm90(_fused): no device given";
  return nullptr;
}

// launch() with `device` current (the previous device restored after), on compute capability 9.0 only.
template <class Launch>
const char* on_sm90(int device, Launch&& launch) {
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
  int major = 0, minor = 0;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  const char* err = e != cudaSuccess ? cudaGetErrorString(e)
                    : major != 9 || minor != 0 ? "fp8_gemm_sm90: needs a compute capability 9.0 GPU"
                                               : launch();
  if (prev >= 0 && prev != device) cudaSetDevice(prev);
  if (e != cudaSuccess) cudaGetLastError();  // reported here, not left for the next unrelated check
  return err;
}

// The shrink's checks (a LoRA with one A pool per span and the call site's counters), shared by both entry points.
const char* shrink_error(const Fp8EpilogueArgs& e, const char* who) {
  const Fp8EpilogueLora& l = e.lora;
  if (l.v == nullptr || l.a_rank_max < 1 || l.sync == nullptr) return who;
  for (int g = 0; g < e.num_groups; ++g)
    if (l.a[g] == nullptr || l.a_rank_dim[g] < 1 || l.a_rank_dim[g] > l.a_rank_max) return who;
  return nullptr;
}

// The shrink's tickets for a launch of `ctas` CTAs on `sms` SMs: at most as many as the warps that take them (4 a CTA,
// the consumers; 3 with shrink_producer) of one CTA per SM, at most of every CTA, each the fewest rank rows of one
// row that allows it; where the rows alone outnumber those warps, a row each. lora.x: with bf16 operands x itself,
// else the caller's (x's bf16 rows).
Fp8EpilogueArgs plan_shrink(const Fp8Sm90Args& a, const Fp8EpilogueArgs& e, int sms, long long ctas) {
  const Fp8EpilogueLora& l = e.lora;
  const long long warps = (l.shrink_producer ? 3 : 4) * (ctas < sms ? ctas : sms);
  const int per_row = e.num_groups * l.a_rank_max;
  int per = static_cast<int>(std::max(1LL, (static_cast<long long>(per_row) * a.m + warps - 1) / warps));
  while (per < per_row && static_cast<long long>(a.m) * ((per_row + per - 1) / per) > warps) ++per;
  Fp8EpilogueArgs shrunk = e;
  if (a.bf16) shrunk.lora.x = a.x;
  shrunk.lora.k = a.k;
  shrunk.lora.shrink_per = per;
  shrunk.lora.shrink_tickets = a.m * ((per_row + per - 1) / per);
  return shrunk;
}

// The CTAs of a launch with one CTA a tile: 64 weight rows by token_tile(M) tokens, times the parts of K.
long long tile_ctas(const Fp8Sm90Args& a) {
  const int tokens = token_tile(a.m);
  return static_cast<long long>((a.n + 63) / 64) * ((a.m + tokens - 1) / tokens) * a.splits;
}

}  // namespace

const char* fp8_gemm_sm90(const Fp8Sm90Args& a, void* stream) {
  if (const char* err = sizes_error(a)) return err;
  if (a.bf16 && a.persistent) return "fp8_gemm_sm90: the persistent schedule is built for e4m3 operands only";
  if (a.shrink != nullptr) {
    if (a.persistent) return "fp8_gemm_sm90: the shrink first takes one CTA a tile";
    if (!a.bf16 && a.shrink->lora.x == nullptr) return "fp8_gemm_sm90: the shrink first needs x's bf16 rows";
    if (const char* err = shrink_error(*a.shrink, "fp8_gemm_sm90: the shrink first needs LoRA (v, ranks, row "
                                                  "slots), one A pool per span and the call site's counters"))
      return err;
  }
  return on_sm90(a.device, [&]() -> const char* {
    if (a.shrink != nullptr) {
      DeviceInfo info;  // (sgmv.h: read once per device)
      if (const char* err = device_info(a.device, &info)) return err;
      const Fp8EpilogueArgs planned = plan_shrink(a, *a.shrink, info.sms, tile_ctas(a));
      return a.bf16 ? sm90_bf16_plain_shrink(a, planned, stream) : plain_shrink<>(a, planned, stream);
    }
    if (a.persistent) {
      DeviceInfo info;  // (sgmv.h: read once per device)
      if (const char* err = device_info(a.device, &info)) return err;
      return plain<cutlass::float_e4m3_t, true>(a, stream, info.sms);
    }
    return a.bf16 ? sm90_bf16_plain(a, stream) : plain<cutlass::float_e4m3_t, false>(a, stream, 0);
  });
}

const char* fp8_gemm_sm90_fused(const Fp8Sm90Args& a, const Fp8EpilogueArgs& e, void* stream) {
  if (const char* err = sizes_error(a)) return err;
  if (a.splits != 1 || e.splits != 1) return "fp8_gemm_sm90_fused: the product in one part only";
  if (e.act != 0) return "fp8_gemm_sm90_fused: no activation (gate and up lie in different tiles)";
  if (e.m != a.m || e.n != a.n) return "fp8_gemm_sm90_fused: the epilogue's sizes differ from the product's";
  if (a.bf16 && a.persistent) return "fp8_gemm_sm90_fused: the persistent schedule is built for e4m3 operands only";
  if (const char* err = fp8_epilogue_check(e)) return err;
  const Fp8EpilogueLora& l = e.lora;
  if (l.sync != nullptr) {
    if (!a.bf16) return "fp8_gemm_sm90_fused: the shrink inside takes bf16 operands (e4m3: the shrink first)";
    if (const char* err = shrink_error(e, "fp8_gemm_sm90_fused: the shrink inside the product needs LoRA and one A "
                                          "pool per span"))
      return err;
  }
  return on_sm90(a.device, [&]() -> const char* {
    DeviceInfo info;  // (sgmv.h: read once per device)
    if (const char* err = device_info(a.device, &info)) return err;
    if (!a.bf16)
      return a.persistent ? fused<cutlass::float_e4m3_t, true>(a, e, stream, info.sms)
                          : fused<cutlass::float_e4m3_t>(a, e, stream);
    if (l.sync == nullptr) return sm90_bf16_fused(a, e, stream);
    // (a grid with fewer SMs takes the tickets its first warps leave in its epilogues)
    return sm90_bf16_fused(a, plan_shrink(a, e, info.sms, tile_ctas(a)), stream);
  });
}

#else

bool fp8_gemm_sm90_built() { return false; }

const char* fp8_gemm_sm90(const Fp8Sm90Args&, void*) {
  return "fp8_gemm_sm90: not built (needs CUTLASS's headers, found through flashinfer, and sm_90a)";
}

const char* fp8_gemm_sm90_fused(const Fp8Sm90Args&, const Fp8EpilogueArgs&, void*) {
  return "fp8_gemm_sm90_fused: not built (needs CUTLASS's headers, found through flashinfer, and sm_90a)";
}

#endif

}  // namespace lorafleet
