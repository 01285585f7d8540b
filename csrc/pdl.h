// Programmatic dependent launch (sm_90+), shared by the kernels that use it (sgmv.cu, quant.cu).
#pragma once

#include <cuda_runtime.h>

namespace lorafleet {

// Lets the next kernel in the stream, if launched with programmatic stream serialization, start now.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Waits until the preceding kernel in the stream has completed and its writes are visible. A no-op
// when this grid was launched without programmatic stream serialization.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Adds the programmatic-stream-serialization attribute to `cfg` (in `attr`, which must outlive the launch)
// when `pdl` and the device is sm_90 or newer.
inline void set_pdl(cudaLaunchConfig_t& cfg, cudaLaunchAttribute* attr, bool pdl, int major) {
  cfg.attrs = attr;
  cfg.numAttrs = 0;
  if (pdl && major >= 9) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.numAttrs = 1;
  }
}

}  // namespace lorafleet
