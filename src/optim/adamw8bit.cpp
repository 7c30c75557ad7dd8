#include "optim/adamw8bit.h"

#include <cmath>

namespace oomless {

namespace {

std::vector<int64_t> shape_of(const Tensor& t) { return std::vector<int64_t>(t.dims, t.dims + t.ndim); }

bool is_8bit(const Trainable& t) { return t.param.numel() >= AdamW8bit::kMin8bitElements; }

// The specs of one kind of state: "m.NAME" then "v.NAME" for each tensor of the kind, side by side.
std::vector<ParamSpec> specs(const TrainableSet& p, bool eight, const char* m, const char* v, bool blocks) {
  std::vector<ParamSpec> s;
  for (const Trainable& t : p) {
    if (is_8bit(t) != eight) continue;
    const std::vector<int64_t> shape =
        blocks ? std::vector<int64_t>{(t.param.numel() + kAdam8Block - 1) / kAdam8Block} : shape_of(t.param);
    s.push_back({m + t.name, shape, t.decay});
    s.push_back({v + t.name, shape, t.decay});
  }
  return s;
}

}  // namespace

AdamW8bit::AdamW8bit(const TrainableSet& params, Arena& arena, const AdamWSettings& settings)
    : settings_(settings),
      codes_(specs(params, true, "m.", "v.", false), DType::u8, arena, Category::optimizer, "adamw8bit codes"),
      scales_(specs(params, true, "m_absmax.", "v_absmax.", true), trainable_dtype(params), arena, Category::optimizer,
              "adamw8bit scales"),
      small_(specs(params, false, "m.", "v.", false), trainable_dtype(params), arena, Category::optimizer,
             "adamw8bit fp32 state") {
  OOM_CHECK(settings.beta1 >= 0 && settings.beta1 < 1 && settings.beta2 >= 0 && settings.beta2 < 1,
            "[optim] AdamW8bit betas must be in [0, 1), got ", settings.beta1, ", ", settings.beta2);
  OOM_CHECK(settings.eps > 0, "[optim] AdamW8bit eps must be positive, got ", settings.eps);
  OOM_CHECK(settings.weight_decay >= 0 && std::isfinite(settings.weight_decay),
            "[optim] AdamW8bit weight_decay must be finite and >= 0, got ", settings.weight_decay);
  size_t q = 0, f = 0;
  for (const Trainable& t : params) {
    names_.push_back(t.name);
    slot_.push_back(is_8bit(t) ? Slot{true, q++} : Slot{false, f++});
  }
}

void AdamW8bit::step_tensors(Ops& ops, const TrainableSet& params, const std::vector<size_t>& which, double lr,
                             int64_t step) {
  check_step(params, which, names_.size(), lr, step);
  AdamWConfig c;
  c.lr = lr;
  c.beta1 = settings_.beta1;
  c.beta2 = settings_.beta2;
  c.eps = settings_.eps;
  c.step = step;
  c.decay_after_update = true;
  for (size_t i : which) {
    const Trainable& t = params[i];
    const Slot& s = slot_[i];
    const Tensor& ref = s.quantized ? codes_.tensors()[2 * s.index] : small_.tensors()[2 * s.index];
    OOM_CHECK(t.name == names_[i] && t.param.same_shape(ref), "[optim] tensor ", i, " (", t.name, ", ", t.param.str(),
              ") does not match the optimizer state (", names_[i], ", ", ref.str(), ")");
    c.weight_decay = t.decay ? settings_.weight_decay : 0.0;
    if (s.quantized)
      ops.adamw8bit_step(t.param, t.grad, codes_.tensors()[2 * s.index], scales_.tensors()[2 * s.index],
                         codes_.tensors()[2 * s.index + 1], scales_.tensors()[2 * s.index + 1], c);
    else
      ops.adamw_step(t.param, t.grad, small_.tensors()[2 * s.index], small_.tensors()[2 * s.index + 1], c);
  }
}

std::vector<NamedTensor> AdamW8bit::state() {
  std::vector<NamedTensor> s;
  for (const ParamSet* p : {&codes_, &scales_, &small_})
    for (const NamedTensor& t : p->named()) s.push_back(t);
  return s;
}

json::Value AdamW8bit::settings_json() const {
  json::Value o = adam_settings_json("adamw8bit", settings_);
  o.set("block", json::Value::number(static_cast<double>(kAdam8Block)));
  o.set("min-8bit-size", json::Value::number(static_cast<double>(kMin8bitElements)));
  return o;
}

}  // namespace oomless
