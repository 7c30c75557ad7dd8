#include "model/params.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

namespace oomless {

namespace {

Tensor make_view(void* p, DType t, const std::vector<int64_t>& shape, Tier tier = Tier::Host) {
  switch (shape.size()) {
    case 1: return Tensor(p, t, {shape[0]}, tier);
    case 2: return Tensor(p, t, {shape[0], shape[1]}, tier);
    default: fail("[model] parameter of rank ", shape.size(), " is not supported");
  }
}

}  // namespace

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// The parameters of one block, once: name, field, shape, weight decay and when it exists. param_specs
// and the named accessors come from this table.
struct LayerField {
  const char* suffix;
  Tensor LayerParams::*field;
  bool decay;
  std::vector<int64_t> (*shape)(const ModelConfig&);
  bool (*present)(const ModelConfig&);
};

using C = const ModelConfig&;
bool always(C) { return true; }
bool qkv_bias(C c) { return c.qkv_bias; }
bool o_bias(C c) { return c.o_bias; }
bool qk_norm(C c) { return c.qk_norm; }
const LayerField kLayerFields[] = {
    {"input_layernorm.weight", &LayerParams::in_norm, false, [](C c) { return std::vector<int64_t>{c.E}; }, always},
    {"self_attn.q_proj.weight", &LayerParams::wq, true, [](C c) { return std::vector<int64_t>{c.q_dim(), c.E}; }, always},
    {"self_attn.q_proj.bias", &LayerParams::bq, false, [](C c) { return std::vector<int64_t>{c.q_dim()}; }, qkv_bias},
    {"self_attn.k_proj.weight", &LayerParams::wk, true, [](C c) { return std::vector<int64_t>{c.kv_dim(), c.E}; }, always},
    {"self_attn.k_proj.bias", &LayerParams::bk, false, [](C c) { return std::vector<int64_t>{c.kv_dim()}; }, qkv_bias},
    {"self_attn.v_proj.weight", &LayerParams::wv, true, [](C c) { return std::vector<int64_t>{c.kv_dim(), c.E}; }, always},
    {"self_attn.v_proj.bias", &LayerParams::bv, false, [](C c) { return std::vector<int64_t>{c.kv_dim()}; }, qkv_bias},
    {"self_attn.o_proj.weight", &LayerParams::wo, true, [](C c) { return std::vector<int64_t>{c.E, c.q_dim()}; }, always},
    {"self_attn.o_proj.bias", &LayerParams::bo, false, [](C c) { return std::vector<int64_t>{c.E}; }, o_bias},
    {"self_attn.q_norm.weight", &LayerParams::q_norm, false, [](C c) { return std::vector<int64_t>{c.D}; }, qk_norm},
    {"self_attn.k_norm.weight", &LayerParams::k_norm, false, [](C c) { return std::vector<int64_t>{c.D}; }, qk_norm},
    {"post_attention_layernorm.weight", &LayerParams::post_norm, false, [](C c) { return std::vector<int64_t>{c.E}; },
     always},
    {"mlp.gate_proj.weight", &LayerParams::wg, true, [](C c) { return std::vector<int64_t>{c.F, c.E}; }, always},
    {"mlp.up_proj.weight", &LayerParams::wu, true, [](C c) { return std::vector<int64_t>{c.F, c.E}; }, always},
    {"mlp.down_proj.weight", &LayerParams::wd, true, [](C c) { return std::vector<int64_t>{c.E, c.F}; }, always},
};
std::string layer_prefix(int64_t l) { return "model.layers." + std::to_string(l) + "."; }
}  // namespace

int64_t layer_of_name(std::string_view name, std::string* rest) {
  constexpr std::string_view kLayerPrefix = "model.layers.";
  if (name.substr(0, kLayerPrefix.size()) != kLayerPrefix) return -1;
  name.remove_prefix(kLayerPrefix.size());
  int64_t l = 0;
  size_t i = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9') l = l * 10 + (name[i++] - '0');
  if (i == 0 || i >= name.size() || name[i] != '.') return -1;
  if (rest) *rest = std::string(name.substr(i));
  return l;
}

std::vector<ParamSpec> param_specs(const ModelConfig& c) {
  std::vector<ParamSpec> p;
  p.push_back({"model.embed_tokens.weight", {c.V, c.E}, true});
  for (int64_t l = 0; l < c.L; ++l)
    for (const LayerField& f : kLayerFields)
      if (f.present(c)) p.push_back({layer_prefix(l) + f.suffix, f.shape(c), f.decay});
  p.push_back({"model.norm.weight", {c.E}, false});
  if (!c.tied) p.push_back({"lm_head.weight", {c.V, c.E}, true});
  return p;
}

ParamSet::ParamSet(std::vector<ParamSpec> specs, DType dtype, Arena& arena, Category cat, const char* what)
    : specs_(std::move(specs)), dtype_(dtype) {
  // Each parameter starts on a 64-byte boundary so kernels see aligned rows.
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const ParamSpec& s : specs_) {
    offsets.push_back(total);
    total += (static_cast<size_t>(dtype_bytes(dtype, numel_of(s.shape))) + 63) / 64 * 64;
  }
  storage_ = arena.alloc_zeroed(std::max<size_t>(total, 1), cat, what);
  for (size_t i = 0; i < specs_.size(); ++i)
    tensors_.push_back(make_view(storage_.as<char>() + offsets[i], dtype, specs_[i].shape, storage_.tier()));
}

ParamSet::ParamSet(const ModelConfig& cfg, DType dtype, Arena& arena, Category cat)
    : ParamSet(cfg, dtype, arena, cat, [](const ParamSpec&) { return true; }) {}

ParamSet::ParamSet(const ModelConfig& cfg, DType dtype, Arena& arena, Category cat,
                   const std::function<bool(const ParamSpec&)>& stored)
    : model_(true), cfg_(cfg), dtype_(dtype) {
  const std::vector<ParamSpec> all = param_specs(cfg);
  std::vector<ParamSpec> kept;
  for (const ParamSpec& s : all)
    if (stored(s)) kept.push_back(s);
  ParamSet inner(kept, dtype, arena, cat, "parameters");
  storage_ = std::move(inner.storage_);
  specs_ = all;
  size_t k = 0;
  for (const ParamSpec& s : all) {
    if (k < kept.size() && kept[k].name == s.name) {
      tensors_.push_back(inner.tensors_[k++]);
    } else {
      tensors_.push_back(make_view(nullptr, dtype, s.shape));
    }
  }
  wire(cfg);
}

void ParamSet::wire(const ModelConfig& cfg) {
  auto get = [&](const std::string& name) {
    const Tensor* t = find(name);
    OOM_CHECK(t, "[model] internal: no parameter ", name);
    return *t;
  };
  embed = get("model.embed_tokens.weight");
  layers.assign(static_cast<size_t>(cfg.L), LayerParams{});
  for (int64_t l = 0; l < cfg.L; ++l)
    for (const LayerField& f : kLayerFields)
      if (f.present(cfg)) layers[static_cast<size_t>(l)].*(f.field) = get(layer_prefix(l) + f.suffix);
  final_norm = get("model.norm.weight");
  lm_head = cfg.tied ? embed : get("lm_head.weight");
}

void ParamSet::set_view(std::string_view hf_name, const Tensor& t) {
  OOM_CHECK(model_, "[model] set_view needs a model's parameter set");
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == hf_name) {
      OOM_CHECK(t.same_shape(tensors_[i]) && t.dtype == tensors_[i].dtype, "[model] set_view: ", hf_name, " is ",
                tensors_[i].str(), ", not ", t.str());
      tensors_[i] = t;
      wire(cfg_);
      return;
    }
  fail("[model] set_view: no parameter ", hf_name);
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

void init_random(Ops& ops, ParamSet& p, uint64_t seed, double std) {
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
    if (!t.data) continue;  // held elsewhere (a quantised base)
    const bool is_norm = s.name.find("norm.weight") != std::string::npos;
    const bool is_bias = s.name.size() > 5 && s.name.compare(s.name.size() - 5, 5, ".bias") == 0;
    std::vector<double> v(static_cast<size_t>(t.numel()));
    for (double& x : v) x = is_norm ? 1.0 : is_bias ? 0.0 : std * normal();
    ops.write_host(t, [&](void* host) { convert(host, t.dtype, v.data(), DType::f64, t.numel()); });
  }
}

void convert_params(Ops& ops, ParamSet& dst, const ParamSet& src) {
  OOM_CHECK(dst.tensors().size() == src.tensors().size(), "[model] convert_params: different models");
  for (size_t i = 0; i < src.tensors().size(); ++i) {
    const Tensor& s = src.tensors()[i];
    const Tensor& d = dst.tensors()[i];
    OOM_CHECK(s.numel() == d.numel(), "[model] convert_params: ", src.specs()[i].name, " sizes differ");
    ops.convert(d, s);
  }
}

std::vector<NamedTensor> ParamSet::named(const std::string& prefix) const {
  std::vector<NamedTensor> v;
  for (size_t i = 0; i < specs_.size(); ++i) v.push_back({prefix + specs_[i].name, tensors_[i]});
  return v;
}

}  // namespace oomless
