#include "backend/ops.h"

#include "backend/cpu/cpu_ops.h"
#include "backend/ref/ref_ops.h"

namespace oomless {

std::unique_ptr<Ops> make_ops(std::string_view name, Arena* workspace) {
  if (name == "ref") return std::make_unique<RefOps>();
  if (name == "cpu") return std::make_unique<CpuOps>(workspace);
  if (name == "cuda")
    fail("[backend] the CUDA backend has no kernels yet in this build; use --backend cpu");
  fail("[backend] unknown backend '", name, "': choose cpu (or ref, the float64 oracle used by tests)");
}

}  // namespace oomless
