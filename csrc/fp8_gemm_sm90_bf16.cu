// The wgmma product on bf16 operands (fp8_gemm_sm90.h Fp8Sm90Args::bf16): sm90_gemm.cuh's kernels instantiated for
// bf16 in a file of their own, which builds beside fp8_gemm_sm90.cu's e4m3 ones.
#include "sm90_gemm.cuh"

namespace lorafleet {

#ifdef LORAFLEET_SM90_GEMM
const char* sm90_bf16_plain(const Fp8Sm90Args& a, void* stream) { return plain<cutlass::bfloat16_t, false>(a, stream, 0); }

const char* sm90_bf16_plain_shrink(const Fp8Sm90Args& a, const Fp8EpilogueArgs& shrink, void* stream) {
  return plain_shrink<cutlass::bfloat16_t>(a, shrink, stream);
}

const char* sm90_bf16_fused(const Fp8Sm90Args& a, const Fp8EpilogueArgs& e, void* stream) {
  return fused<cutlass::bfloat16_t>(a, e, stream);
}
#endif

}  // namespace lorafleet
