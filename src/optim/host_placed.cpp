#include "optim/host_placed.h"

namespace oomless {

HostPlaced::HostPlaced(std::unique_ptr<Optimizer> inner, Ops& host) : in_(std::move(inner)), host_(host) {}

void HostPlaced::step_tensors(Ops& ops, const TrainableSet& params, const std::vector<size_t>& which, double lr,
                              int64_t step) {
  // Copied once (names and shapes do not change); each call refreshes only the entries it steps.
  if (staged_.size() != params.size()) staged_ = params;
  TrainableSet& staged = staged_;
  size_t mapped = 0;  // which[0, mapped) hold host views to release
  auto release = [&](bool write_back) {
    for (size_t k = 0; k < mapped; ++k) {
      const size_t i = which[k];
      ops.unmap_from_host(params[i].param, staged[i].param, write_back);
      ops.unmap_from_host(params[i].grad, staged[i].grad, false);
      staged[i].param = params[i].param, staged[i].grad = params[i].grad;  // no host view outlives the call
    }
    mapped = 0;
  };
  try {
    for (size_t i : which) {
      OOM_CHECK(i < params.size(), "[optim] step_tensors: tensor ", i, " of ", params.size());
      staged[i] = params[i];
      staged[i].param = ops.map_to_host(params[i].param);
      try {
        staged[i].grad = ops.map_to_host(params[i].grad);
      } catch (...) {
        ops.unmap_from_host(params[i].param, staged[i].param, false);
        throw;
      }
      ++mapped;
    }
    in_->step_tensors(host_, staged, which, lr, step);
  } catch (...) {
    release(false);
    throw;
  }
  release(true);
}

}  // namespace oomless
