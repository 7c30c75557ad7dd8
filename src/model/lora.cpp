#include "model/lora.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace oomless {

namespace {

struct ProjInfo {
  const char* short_name;
  const char* module;
};
constexpr ProjInfo kProj[kProjCount] = {
    {"q", "self_attn.q_proj"},  {"k", "self_attn.k_proj"}, {"v", "self_attn.v_proj"}, {"o", "self_attn.o_proj"},
    {"gate", "mlp.gate_proj"}, {"up", "mlp.up_proj"},     {"down", "mlp.down_proj"}};

std::string target_names() {
  std::string s;
  for (const ProjInfo& p : kProj) s += std::string(s.empty() ? "" : ", ") + p.short_name;
  return s + " (or q_proj, ..., down_proj), or all-linear";
}

}  // namespace

const char* proj_short_name(Proj p) { return kProj[static_cast<int>(p)].short_name; }
const char* proj_module(Proj p) { return kProj[static_cast<int>(p)].module; }

int64_t proj_out(const ModelConfig& c, Proj p) {
  switch (p) {
    case Proj::q: return c.q_dim();
    case Proj::k:
    case Proj::v: return c.kv_dim();
    case Proj::o:
    case Proj::down: return c.E;
    case Proj::gate:
    case Proj::up: return c.F;
  }
  return 0;
}

int64_t proj_in(const ModelConfig& c, Proj p) {
  switch (p) {
    case Proj::o: return c.q_dim();
    case Proj::down: return c.F;
    default: return c.E;
  }
}

Tensor proj_weight(const LayerParams& w, Proj p) {
  const Tensor* t[kProjCount] = {&w.wq, &w.wk, &w.wv, &w.wo, &w.wg, &w.wu, &w.wd};
  return *t[static_cast<int>(p)];
}

Tensor proj_bias(const LayerParams& w, Proj p) {
  switch (p) {
    case Proj::q: return w.bq;
    case Proj::k: return w.bk;
    case Proj::v: return w.bv;
    case Proj::o: return w.bo;
    default: return Tensor();
  }
}

double LoraSettings::scale() const {
  const double rr = static_cast<double>(r);
  return rslora ? alpha / std::sqrt(rr) : alpha / rr;
}

std::vector<Proj> parse_lora_targets(std::string_view list) {
  std::vector<Proj> out;
  if (list == "all-linear" || list == "all") {
    for (int i = 0; i < kProjCount; ++i) out.push_back(static_cast<Proj>(i));
    return out;
  }
  size_t i = 0;
  while (i <= list.size()) {
    size_t j = list.find(',', i);
    if (j == std::string_view::npos) j = list.size();
    std::string_view name = list.substr(i, j - i);
    i = j + 1;
    if (name.empty()) continue;
    int found = -1;
    for (int p = 0; p < kProjCount; ++p) {
      const std::string module = kProj[p].module;
      if (name == kProj[p].short_name || name == module.substr(module.find('.') + 1)) found = p;
    }
    OOM_CHECK(found >= 0, "[lora] --lora-targets: unknown projection '", name, "'; this model's linear layers are ",
              target_names());
    const Proj p = static_cast<Proj>(found);
    if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  }
  OOM_CHECK(!out.empty(), "[lora] --lora-targets names no projection; use ", target_names());
  std::sort(out.begin(), out.end());
  return out;
}

void validate_lora(const LoraSettings& s, const ModelConfig& c) {
  OOM_CHECK(s.r > 0, "[lora] --lora r must be a positive rank, got ", s.r);
  OOM_CHECK(std::isfinite(s.alpha) && s.alpha > 0, "[lora] --lora-alpha must be a positive number, got ", s.alpha);
  OOM_CHECK(s.dropout >= 0 && s.dropout < 1, "[lora] --lora-dropout must be in [0, 1), got ", s.dropout);
  OOM_CHECK(!s.targets.empty(), "[lora] no --lora-targets; use ", target_names());
  for (Proj p : s.targets) {
    const int64_t n = std::min(proj_out(c, p), proj_in(c, p));
    OOM_CHECK(s.r <= n, "[lora] --lora ", s.r, " is above the width of ", proj_module(p), " (", proj_out(c, p), " x ",
              proj_in(c, p), "): r may be at most ", n);
  }
}

std::string lora_key(int64_t layer, Proj p, std::string_view part) {
  return "base_model.model.model.layers." + std::to_string(layer) + "." + proj_module(p) + "." + std::string(part);
}

std::vector<ParamSpec> adapter_specs(const ModelConfig& c, const LoraSettings& s) {
  std::vector<ParamSpec> specs;
  for (int64_t l = 0; l < c.L; ++l)
    for (Proj p : s.targets) {
      specs.push_back({lora_key(l, p, "lora_A.weight"), {s.r, proj_in(c, p)}, true});
      specs.push_back({lora_key(l, p, "lora_B.weight"), {proj_out(c, p), s.r}, true});
      // A scale per output row, like a norm's weight: no weight decay.
      if (s.dora) specs.push_back({lora_key(l, p, "lora_magnitude_vector"), {proj_out(c, p)}, false});
    }
  return specs;
}

AdapterSet::AdapterSet(const ModelConfig& cfg, const LoraSettings& s, DType dtype, Arena& arena, Category cat)
    : settings_(s), set_(adapter_specs(cfg, s), dtype, arena, cat, cat == Category::grads ? "adapter grads" : "adapters") {
  validate_lora(s, cfg);
  // On a tied model the embedding and the head are one matrix: training either trains both.
  if (cfg.tied && (s.train_embed || s.train_head)) settings_.train_embed = settings_.train_head = true;
  layers_.resize(static_cast<size_t>(cfg.L));
  size_t i = 0;
  for (LayerLora& l : layers_)
    for (Proj p : s.targets) {
      l.p[static_cast<int>(p)].a = set_.tensors()[i++];
      l.p[static_cast<int>(p)].b = set_.tensors()[i++];
      if (s.dora) l.p[static_cast<int>(p)].m = set_.tensors()[i++];
    }
}

void merge_lora(Ops& ops, ParamSet& params, const AdapterSet& a, Arena& arena) {
  const LoraSettings& s = a.settings();
  OOM_CHECK(params.dtype() == a.tensors().dtype(), "[lora] merge: the base is ", dtype_name(params.dtype()),
            ", the adapter ", dtype_name(a.tensors().dtype()));
  for (int64_t l = 0; l < a.layers(); ++l)
    for (Proj p : s.targets) {
      const std::string name = "model.layers." + std::to_string(l) + "." + proj_module(p) + ".weight";
      const Tensor* w = params.find(name);
      OOM_CHECK(w && w->data, "[lora] merge: the base has no ", name, w ? " held unquantised" : "");
      const LoraTensors& t = a.layer(l)[p];
      // W (N, K) += (s B) (N, r) . A (r, K)
      Buffer buf = arena.alloc(static_cast<size_t>(t.b.nbytes()), Category::workspace, "merge");
      Tensor bs = buf.view(t.b.dtype, {t.b.dims[0], t.b.dims[1]});
      ops.convert(bs, t.b);
      ops.scale(bs, s.scale());
      ops.matmul(*w, bs, t.a, false, false, true);
      if (!s.dora) continue;
      // DoRA: W_j *= m_j / ||W_j||, the norm of the merged row (PEFT's dora_factor).
      const int64_t N = w->dims[0];
      Buffer nb = arena.alloc(static_cast<size_t>(2 * dtype_bytes(w->dtype, N)), Category::workspace, "merge");
      const Tensor n = nb.view(w->dtype, {N});
      const Tensor g(n, dtype_bytes(w->dtype, N), w->dtype, {N});
      ops.row_norms(n, *w);
      ops.dora_scale(g, n, t.m, n, Tensor(), Tensor(), Tensor(), 0.0);
      ops.scale_rows(*w, g);
    }
}

void init_lora(Ops& ops, AdapterSet& a, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < a.tensors().specs().size(); ++i) {
    const Tensor& t = a.tensors().tensors()[i];
    const bool is_a = a.tensors().specs()[i].name.find(".lora_A.") != std::string::npos;
    std::vector<double> v(static_cast<size_t>(t.numel()), 0.0);
    if (is_a) {
      // 53-bit uniforms in [-bound, bound): the same numbers on every platform.
      const double bound = 1.0 / std::sqrt(static_cast<double>(t.dims[1]));
      for (double& x : v) x = bound * (2.0 * static_cast<double>(rng() >> 11) * 0x1.0p-53 - 1.0);
    }
    std::vector<char> host(static_cast<size_t>(t.nbytes()));
    convert(host.data(), t.dtype, v.data(), DType::f64, t.numel());
    ops.upload(t, host.data());
  }
}

void init_dora(Ops& ops, AdapterSet& a, const ParamSet& base) {
  if (!a.settings().dora) return;
  for (int64_t l = 0; l < a.layers(); ++l)
    for (Proj p : a.settings().targets)
      ops.row_norms(a.layer(l)[p].m, proj_weight(base.layers[static_cast<size_t>(l)], p));
}

}  // namespace oomless
