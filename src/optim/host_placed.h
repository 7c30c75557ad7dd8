// Where the optimizer runs, made explicit. An optimizer whose state lives in host memory runs on the host
// (ZeRO-Offload's shape): each step maps the parameters and gradients it updates to the host through the
// device's Ops (no copy where the device is the host, the CPU backend; a download on a device backend), steps
// them with the host's Ops over the host state, and writes the parameters back (the gradients are only read:
// an optimizer may use their host copy as scratch, as GaLore does). Bit for bit the update of the same
// optimizer run on the device, since both are the same kernels over the same values.
#pragma once
#include <memory>

#include "optim/optimizer.h"

namespace oomless {

class HostPlaced final : public Optimizer {
 public:
  // `inner` was built over host memory; `host` computes there (and outlives this).
  HostPlaced(std::unique_ptr<Optimizer> inner, Ops& host);
  const char* name() const override { return in_->name(); }
  void step_tensors(Ops& ops, const TrainableSet& params, const std::vector<size_t>& which, double lr,
                    int64_t step) override;
  std::vector<NamedTensor> state() override { return in_->state(); }
  std::vector<StWrite> state_entries(Ops&) override { return in_->state_entries(host_); }
  void load_state(Ops&, const SafetensorsFile& f) override { in_->load_state(host_, f); }
  json::Value settings_json() const override { return in_->settings_json(); }

 private:
  std::unique_ptr<Optimizer> in_;
  Ops& host_;
  TrainableSet staged_;  // the set the inner optimizer steps: host views of the tensors of one call
};

}  // namespace oomless
