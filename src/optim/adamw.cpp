#include "optim/adamw.h"

#include <cmath>

namespace oomless {

namespace {

// The state is laid out from the same specs as the parameters; anything else is a caller error that
// would otherwise update the wrong tensors.
void check_layout(const char* what, const ParamSet& p, const ParamSet& state) {
  OOM_CHECK(p.specs().size() == state.specs().size() && p.dtype() == state.dtype(), "[optim] ", what, " has ",
            p.specs().size(), " tensors of ", dtype_name(p.dtype()), ", the optimizer state ", state.specs().size(),
            " of ", dtype_name(state.dtype()));
  for (size_t i = 0; i < p.specs().size(); ++i)
    OOM_CHECK(p.specs()[i].name == state.specs()[i].name && p.tensors()[i].same_shape(state.tensors()[i]),
              "[optim] ", what, " tensor ", i, " (", p.specs()[i].name, ", ", p.tensors()[i].str(),
              ") does not match the optimizer state (", state.specs()[i].name, ", ", state.tensors()[i].str(), ")");
}

}  // namespace

AdamW::AdamW(const ModelConfig& cfg, const ParamSet& params, Arena& arena, const AdamWSettings& settings)
    : settings_(settings),
      m_(cfg, params.dtype(), arena, Category::optimizer),
      v_(cfg, params.dtype(), arena, Category::optimizer) {
  OOM_CHECK(settings.beta1 >= 0 && settings.beta1 < 1 && settings.beta2 >= 0 && settings.beta2 < 1,
            "[optim] AdamW betas must be in [0, 1), got ", settings.beta1, ", ", settings.beta2);
  OOM_CHECK(settings.eps > 0, "[optim] AdamW eps must be positive, got ", settings.eps);
  OOM_CHECK(settings.weight_decay >= 0 && std::isfinite(settings.weight_decay),
            "[optim] AdamW weight_decay must be finite and >= 0, got ", settings.weight_decay);
  check_layout("the parameter set", params, m_);
}

void AdamW::step(Ops& ops, ParamSet& params, const ParamSet& grads, double lr, int64_t step) {
  OOM_CHECK(step >= 1, "[optim] AdamW steps count from 1, got ", step);
  OOM_CHECK(std::isfinite(lr) && lr >= 0, "[optim] AdamW learning rate must be finite and >= 0, got ", lr);
  check_layout("the parameter set", params, m_);
  check_layout("the gradient set", grads, m_);
  AdamWConfig c;
  c.lr = lr;
  c.beta1 = settings_.beta1;
  c.beta2 = settings_.beta2;
  c.eps = settings_.eps;
  c.step = step;
  const std::vector<ParamSpec>& specs = params.specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    c.weight_decay = specs[i].decay ? settings_.weight_decay : 0.0;
    ops.adamw_step(params.tensors()[i], grads.tensors()[i], m_.tensors()[i], v_.tensors()[i], c);
  }
}

}  // namespace oomless
