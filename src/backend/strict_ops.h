// The strict device mode's backend (memory/allocator.h): every call of the backend it wraps runs with Device
// memory open to the host, which is closed again when the call returns. make_ops wraps the backend it builds
// in one when the mode is on, so that host code above backend/ touching Device memory faults.
#pragma once
#include <memory>

#include "backend/ops.h"

namespace oomless {

std::unique_ptr<Ops> make_strict_ops(std::unique_ptr<Ops> inner);

}  // namespace oomless
