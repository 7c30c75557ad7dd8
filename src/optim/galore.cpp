#include "optim/galore.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "optim/adamw8bit.h"

namespace oomless {

struct GaLore::Proj {
  size_t param = 0;   // index in the trainable set
  int64_t m = 0, n = 0, r = 0;
  bool right = true;  // P is (r, n) and R = G P^T (m, r); else P (m, r) and R = P^T G (r, n)
  int64_t layer = 0;
  bool eight = false;  // 8-bit moments
  size_t p = 0, mv = 0;  // P in projectors_; m, v at 2 mv, 2 mv + 1 in moments_ or codes_/scales_
  std::vector<int64_t> low() const { return right ? std::vector<int64_t>{m, r} : std::vector<int64_t>{r, n}; }
  int64_t low_numel() const { return right ? m * r : r * n; }
};

bool galore_projects(const Trainable& t) {
  return t.param.ndim == 2 && t.name.rfind("model.layers.", 0) == 0;
}

namespace {

int64_t layer_of(const std::string& name) {
  return std::strtoll(name.c_str() + std::strlen("model.layers."), nullptr, 10);
}

}  // namespace

GaLore::GaLore(const TrainableSet& params, Arena& arena, const AdamWSettings& adam, const GaLoreSettings& galore)
    : adam_(adam), galore_(galore) {
  OOM_CHECK(galore.rank >= 1, "[optim] --galore-rank must be at least 1, got ", galore.rank);
  OOM_CHECK(galore.gap >= 1, "[optim] --galore-gap must be at least 1, got ", galore.gap);
  OOM_CHECK(std::isfinite(galore.scale) && galore.scale > 0, "[optim] --galore-scale must be positive, got ", galore.scale);
  std::vector<ParamSpec> pspecs, mspecs, cspecs, sspecs;
  TrainableSet rest;
  for (size_t i = 0; i < params.size(); ++i) {
    const Trainable& t = params[i];
    if (!galore_projects(t)) {
      slot_.push_back(-1);
      rest_pos_.push_back(rest_index_.size());
      rest_index_.push_back(i);
      rest.push_back(t);
      continue;
    }
    rest_pos_.push_back(SIZE_MAX);
    Proj p;
    p.param = i;
    p.m = t.param.dims[0], p.n = t.param.dims[1], p.r = galore.rank;
    OOM_CHECK(p.r <= std::min(p.m, p.n), "[optim] --galore-rank ", p.r, " is above the smaller side of ", t.name, " (",
              p.m, " x ", p.n, "): GaLore projects onto at most min(m, n) directions; use --galore-rank ",
              std::min(p.m, p.n), " or less");
    p.right = p.m >= p.n;
    p.layer = layer_of(t.name);
    p.eight = galore.eight_bit && p.low_numel() >= AdamW8bit::kMin8bitElements;
    p.p = pspecs.size();
    pspecs.push_back({"P." + t.name, p.right ? std::vector<int64_t>{p.r, p.n} : std::vector<int64_t>{p.m, p.r}, false});
    const std::vector<int64_t> blocks{(p.low_numel() + kAdam8Block - 1) / kAdam8Block};
    if (p.eight) {
      p.mv = cspecs.size() / 2;
      cspecs.push_back({"m." + t.name, p.low(), false});
      cspecs.push_back({"v." + t.name, p.low(), false});
      sspecs.push_back({"m_absmax." + t.name, blocks, false});
      sspecs.push_back({"v_absmax." + t.name, blocks, false});
    } else {
      p.mv = mspecs.size() / 2;
      mspecs.push_back({"m." + t.name, p.low(), false});
      mspecs.push_back({"v." + t.name, p.low(), false});
    }
    slot_.push_back(static_cast<int64_t>(proj_.size()));
    proj_.push_back(p);
  }
  const DType dt = trainable_dtype(params);
  projectors_ = ParamSet(pspecs, dt, arena, Category::optimizer, "galore projectors");
  moments_ = ParamSet(mspecs, dt, arena, Category::optimizer, "galore moments");
  codes_ = ParamSet(cspecs, DType::u8, arena, Category::optimizer, "galore 8-bit moments");
  scales_ = ParamSet(sspecs, dt, arena, Category::optimizer, "galore 8-bit scales");
  int64_t most = 1;
  for (const Proj& p : proj_) most = std::max(most, p.low_numel());
  scratch_ = arena.alloc(static_cast<size_t>(dtype_bytes(dt, 2 * most)), Category::optimizer, "galore low-rank scratch");
  if (!rest.empty()) {
    AdamWSettings s = adam;
    s.transformers_form = !galore.eight_bit;
    if (galore.eight_bit)
      rest_ = std::make_unique<AdamW8bit>(rest, arena, s);
    else
      rest_ = std::make_unique<AdamW>(rest, arena, s);
  }
}

GaLore::~GaLore() = default;

void GaLore::step_tensors(Ops& ops, const TrainableSet& params, const std::vector<size_t>& which, double lr,
                          int64_t step) {
  check_step(params, which, slot_.size(), lr, step);
  if (step != refreshed_step_) refreshed_ = 0, refreshed_step_ = step;
  const DType dt = params[0].param.dtype;
  std::vector<size_t> rest_which;
  for (size_t i : which) {
    if (slot_[i] < 0) {
      rest_which.push_back(rest_pos_[i]);
      continue;
    }
    const Proj& p = proj_[static_cast<size_t>(slot_[i])];
    const Trainable& t = params[p.param];
    OOM_CHECK(t.param.ndim == 2 && t.param.dims[0] == p.m && t.param.dims[1] == p.n, "[optim] ", t.name, " ",
              t.param.str(), " does not match the GaLore state (", p.m, " x ", p.n, ")");
    const Tensor P = projectors_.tensors()[p.p];
    const bool refresh = step == 1 || (galore_.staggered ? (step - 1) % galore_.gap == p.layer % galore_.gap
                                                         : (step - 1) % galore_.gap == 0);
    if (refresh) {
      ops.svd_basis(P, t.grad, p.right);
      ++refreshed_;
    }
    const std::vector<int64_t> low = p.low();
    const Tensor R = scratch_.view(dt, {low[0], low[1]});
    const Tensor U(R, dtype_bytes(dt, p.low_numel()), dt, {low[0], low[1]});
    if (p.right)
      ops.matmul(R, t.grad, P, false, true, false);  // (m, n) (r, n)^T
    else
      ops.matmul(R, P, t.grad, true, false, false);  // (m, r)^T (m, n)
    ops.fill(U, 0.0);
    AdamWConfig c;
    c.lr = 1.0;
    c.beta1 = adam_.beta1;
    c.beta2 = adam_.beta2;
    c.step = step;
    c.weight_decay = 0.0;
    c.decay_after_update = true;
    if (p.eight) {
      c.eps = adam_.eps;
      ops.adamw8bit_step(U, R, codes_.tensors()[2 * p.mv], scales_.tensors()[2 * p.mv], codes_.tensors()[2 * p.mv + 1],
                         scales_.tensors()[2 * p.mv + 1], c);
    } else {
      // galore: U = -sqrt(bc2) / bc1 * m / (sqrt(v) + eps); galore8bit's fp32 case is bitsandbytes' 32-bit
      // update, eps inside the correction.
      c.eps = galore_.eight_bit ? adam_.eps
                                : adam_.eps / std::sqrt(1.0 - std::pow(adam_.beta2, static_cast<double>(step)));
      ops.adamw_step(U, R, moments_.tensors()[2 * p.mv], moments_.tensors()[2 * p.mv + 1], c);
    }
    // back-project into the gradient's buffer, then p += lr scale back(U)
    if (p.right)
      ops.matmul(t.grad, U, P, false, false, false);  // (m, r) (r, n)
    else
      ops.matmul(t.grad, P, U, false, false, false);  // (m, r) (r, n)
    ops.axpy(t.param, lr * galore_.scale, t.grad);
    if (t.decay && adam_.weight_decay > 0) ops.scale(t.param, 1.0 - lr * adam_.weight_decay);
  }
  if (rest_ && !rest_which.empty()) {
    TrainableSet rest;
    for (size_t i : rest_index_) rest.push_back(params[i]);
    rest_->step_tensors(ops, rest, rest_which, lr, step);
  }
}

std::vector<NamedTensor> GaLore::state() {
  std::vector<NamedTensor> s;
  for (const ParamSet* p : {&projectors_, &moments_, &codes_, &scales_})
    for (const NamedTensor& t : p->named()) s.push_back(t);
  if (rest_)
    for (const NamedTensor& t : rest_->state()) s.push_back(t);
  return s;
}

json::Value GaLore::settings_json() const {
  json::Value o = adam_settings_json(name(), adam_);
  o.set("galore-rank", json::Value::number(static_cast<double>(galore_.rank)));
  o.set("galore-gap", json::Value::number(static_cast<double>(galore_.gap)));
  o.set("galore-scale", json::Value::number(galore_.scale));
  o.set("galore-refresh", json::Value::string(galore_.staggered ? "staggered" : "all"));
  return o;
}

}  // namespace oomless
