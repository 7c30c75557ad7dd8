#include "optim/adamw.h"

#include <cmath>

namespace oomless {

namespace {

std::vector<ParamSpec> state_specs(const TrainableSet& p) {
  std::vector<ParamSpec> s;
  for (const Trainable& t : p) {
    std::vector<int64_t> shape(t.param.dims, t.param.dims + t.param.ndim);
    s.push_back({t.name, shape, t.decay});
  }
  return s;
}

}  // namespace

AdamW::AdamW(const TrainableSet& params, Arena& arena, const AdamWSettings& settings)
    : settings_(settings),
      m_(state_specs(params), trainable_dtype(params), arena, Category::optimizer, "adamw m"),
      v_(state_specs(params), trainable_dtype(params), arena, Category::optimizer, "adamw v") {
  OOM_CHECK(settings.beta1 >= 0 && settings.beta1 < 1 && settings.beta2 >= 0 && settings.beta2 < 1,
            "[optim] AdamW betas must be in [0, 1), got ", settings.beta1, ", ", settings.beta2);
  OOM_CHECK(settings.eps > 0, "[optim] AdamW eps must be positive, got ", settings.eps);
  OOM_CHECK(settings.weight_decay >= 0 && std::isfinite(settings.weight_decay),
            "[optim] AdamW weight_decay must be finite and >= 0, got ", settings.weight_decay);
}

void AdamW::step_tensors(Ops& ops, const TrainableSet& params, const std::vector<size_t>& which, double lr,
                         int64_t step) {
  check_step(params, which, m_.specs().size(), lr, step);
  AdamWConfig c;
  c.lr = lr;
  c.beta1 = settings_.beta1;
  c.beta2 = settings_.beta2;
  c.eps = settings_.eps;
  c.step = step;
  if (settings_.transformers_form) {
    // (m / bc1) / (sqrt(v) / sqrt(bc2) + eps / sqrt(bc2)) = lr sqrt(bc2) / bc1 * m / (sqrt(v) + eps)
    c.eps = settings_.eps / std::sqrt(1.0 - std::pow(settings_.beta2, static_cast<double>(step)));
    c.decay_after_update = true;
  }
  for (size_t i : which) {
    const Trainable& t = params[i];
    OOM_CHECK(t.name == m_.specs()[i].name && t.param.same_shape(m_.tensors()[i]), "[optim] tensor ", i, " (", t.name,
              ", ", t.param.str(), ") does not match the optimizer state (", m_.specs()[i].name, ", ",
              m_.tensors()[i].str(), ")");
    c.weight_decay = t.decay ? settings_.weight_decay : 0.0;
    ops.adamw_step(t.param, t.grad, m_.tensors()[i], v_.tensors()[i], c);
  }
}

std::vector<NamedTensor> AdamW::state() {
  std::vector<NamedTensor> s;
  for (size_t i = 0; i < m_.specs().size(); ++i) s.push_back({"m." + m_.specs()[i].name, m_.tensors()[i]});
  for (size_t i = 0; i < v_.specs().size(); ++i) s.push_back({"v." + v_.specs()[i].name, v_.tensors()[i]});
  return s;
}

json::Value adam_settings_json(const char* optimizer, const AdamWSettings& s) {
  json::Value o = json::Value::object();
  o.set("optimizer", json::Value::string(optimizer));
  o.set("beta1", json::Value::number(s.beta1));
  o.set("beta2", json::Value::number(s.beta2));
  o.set("eps", json::Value::number(s.eps));
  o.set("weight-decay", json::Value::number(s.weight_decay));
  return o;
}

json::Value AdamW::settings_json() const { return adam_settings_json("adamw", settings_); }

}  // namespace oomless
