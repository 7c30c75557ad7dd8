#include <cuda_runtime.h>

#include "backend/cuda/cuda_info.h"

namespace oomless {

CudaInfo query_cuda() {
  CudaInfo info;
  cudaError_t err = cudaGetDeviceCount(&info.devices);
  if (err != cudaSuccess) {
    info.devices = 0;
    info.error = cudaGetErrorString(err);
    return info;
  }
  if (info.devices > 0) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
      info.name = prop.name;
      info.sm_major = prop.major;
      info.sm_minor = prop.minor;
      info.total_bytes = prop.totalGlobalMem;
    }
  }
  return info;
}

}  // namespace oomless
