// What the CUDA runtime sees, for probe. Plain C++ interface: callers never include CUDA headers.
// Defined only in CUDA builds (OOMLESS_WITH_CUDA).
#pragma once
#include <string>

namespace oomless {

struct CudaInfo {
  int devices = 0;
  std::string name;  // device 0
  int sm_major = 0, sm_minor = 0;
  size_t total_bytes = 0;
  std::string error;  // why no device could be used, when devices == 0
};

CudaInfo query_cuda();

}  // namespace oomless
