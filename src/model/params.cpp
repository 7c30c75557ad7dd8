#include "model/params.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

namespace oomless {

namespace {

Tensor make_view(void* p, DType t, const std::vector<int64_t>& shape) {
  switch (shape.size()) {
    case 1: return Tensor(p, t, {shape[0]});
    case 2: return Tensor(p, t, {shape[0], shape[1]});
    default: fail("[model] parameter of rank ", shape.size(), " is not supported");
  }
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

ParamSet::ParamSet(std::vector<ParamSpec> specs, DType dtype, Arena& arena, Category cat, const char* what)
    : specs_(std::move(specs)), dtype_(dtype) {
  // Each parameter starts on a 64-byte boundary so kernels see aligned rows.
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const ParamSpec& s : specs_) {
    offsets.push_back(total);
    total += (static_cast<size_t>(dtype_bytes(dtype, numel_of(s.shape))) + 63) / 64 * 64;
  }
  storage_ = arena.alloc(std::max<size_t>(total, 1), cat, what);
  std::memset(storage_.data(), 0, storage_.size());
  for (size_t i = 0; i < specs_.size(); ++i)
    tensors_.push_back(make_view(storage_.as<char>() + offsets[i], dtype, specs_[i].shape));
}

ParamSet::ParamSet(const ModelConfig& cfg, DType dtype, Arena& arena, Category cat)
    : ParamSet(param_specs(cfg), dtype, arena, cat, "parameters") {

  // Named accessors, in param_specs() order.
  size_t i = 0;
  auto next = [&]() -> Tensor { return tensors_.at(i++); };
  embed = next();
  layers.resize(static_cast<size_t>(cfg.L));
  for (LayerParams& l : layers) {
    l.in_norm = next();
    l.wq = next();
    if (cfg.qkv_bias) l.bq = next();
    l.wk = next();
    if (cfg.qkv_bias) l.bk = next();
    l.wv = next();
    if (cfg.qkv_bias) l.bv = next();
    l.wo = next();
    if (cfg.o_bias) l.bo = next();
    if (cfg.qk_norm) {
      l.q_norm = next();
      l.k_norm = next();
    }
    l.post_norm = next();
    l.wg = next();
    l.wu = next();
    l.wd = next();
  }
  final_norm = next();
  lm_head = cfg.tied ? embed : next();
}

const Tensor* ParamSet::find(std::string_view hf_name) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == hf_name) return &tensors_[i];
  return nullptr;
}

TrainableSet trainable_set(const ParamSet& params, const ParamSet& grads) {
  OOM_CHECK(params.specs().size() == grads.specs().size(), "[model] parameters (", params.specs().size(),
            " tensors) and gradients (", grads.specs().size(), ") differ in layout");
  TrainableSet t;
  for (size_t i = 0; i < params.specs().size(); ++i)
    t.push_back({params.specs()[i].name, params.tensors()[i], grads.tensors()[i], params.specs()[i].decay});
  return t;
}

void init_random(ParamSet& p, uint64_t seed, double std) {
  std::mt19937_64 rng(seed);
  auto normal = [&rng]() {
    // Box-Muller from two 53-bit uniforms: the same numbers on every platform (std::normal_distribution
    // is implementation-defined).
    const double u1 = (static_cast<double>(rng() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  };
  for (size_t i = 0; i < p.specs().size(); ++i) {
    const ParamSpec& s = p.specs()[i];
    const Tensor& t = p.tensors()[i];
    const bool is_norm = s.name.find("norm.weight") != std::string::npos;
    const bool is_bias = s.name.size() > 5 && s.name.compare(s.name.size() - 5, 5, ".bias") == 0;
    std::vector<double> v(static_cast<size_t>(t.numel()));
    for (double& x : v) x = is_norm ? 1.0 : is_bias ? 0.0 : std * normal();
    convert(t.data, t.dtype, v.data(), DType::f64, t.numel());
  }
}

void convert_params(ParamSet& dst, const ParamSet& src) {
  OOM_CHECK(dst.tensors().size() == src.tensors().size(), "[model] convert_params: different models");
  for (size_t i = 0; i < src.tensors().size(); ++i) {
    const Tensor& s = src.tensors()[i];
    const Tensor& d = dst.tensors()[i];
    OOM_CHECK(s.numel() == d.numel(), "[model] convert_params: ", src.specs()[i].name, " sizes differ");
    convert(d.data, d.dtype, s.data, s.dtype, s.numel());
  }
}

}  // namespace oomless
