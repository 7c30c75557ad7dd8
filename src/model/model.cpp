#include "model/model.h"
#include "model/model_detail.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>

namespace oomless {

SavePolicy parse_save_policy(std::string_view s) {
  if (s == "all") return SavePolicy::all;
  if (s == "selective") return SavePolicy::selective;
  if (s == "none") return SavePolicy::none;
  fail("[model] unknown save policy '", s, "'; use all, selective or none");
}

namespace {

// A per-layer list of one of `names` ("NAME", or items NAME:FIRST-LAST / NAME:LAYER and at most one bare NAME
// for the layers no item names): the index into `names` of each of the L layers; with L < 0 only the syntax is
// checked and each item's index is returned. `what` starts every error ("[train] --save-policy "), `kind`
// names one value ("save policy").
std::vector<int> parse_layer_list(std::string_view spec, int64_t L, const char* what, const char* kind,
                                  const std::vector<std::string_view>& names, const char* example) {
  std::string choices;
  for (size_t i = 0; i < names.size(); ++i)
    choices += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + std::string(names[i]);
  std::vector<int> items;
  std::vector<int> owner(static_cast<size_t>(std::max<int64_t>(L, 0)), -1);
  std::optional<int> rest;
  std::string_view left = spec;
  OOM_CHECK(!spec.empty(), what, "is empty; use ", choices, " or a list such as ", example);
  for (int item = 0; !left.empty() || item == 0; ++item) {
    const size_t comma = left.find(',');
    const std::string_view it = left.substr(0, comma);
    left = comma == std::string_view::npos ? std::string_view() : left.substr(comma + 1);
    OOM_CHECK(!it.empty() && (comma == std::string_view::npos || !left.empty()), what, spec, ": an empty item; items are ",
              "NAME or NAME:FIRST-LAST, separated by commas");
    const size_t colon = it.find(':');
    const std::string_view name = it.substr(0, colon);
    const auto found = std::find(names.begin(), names.end(), name);
    OOM_CHECK(found != names.end(), what, spec, ": '", name, "' is not a ", kind, "; use ", choices);
    const int p = static_cast<int>(found - names.begin());
    items.push_back(p);
    if (colon == std::string_view::npos) {
      OOM_CHECK(!rest, what, spec, ": two items without layers; give one default and NAME:FIRST-LAST for the rest");
      rest = p;
      continue;
    }
    const std::string_view range = it.substr(colon + 1);
    const size_t dash = range.find('-');
    auto number = [&](std::string_view d) {
      OOM_CHECK(!d.empty() && d.size() <= 6 && d.find_first_not_of("0123456789") == std::string_view::npos, what, spec,
                ": '", range, "' is not a layer or a range of layers (FIRST-LAST, counted from 0)");
      return std::stoll(std::string(d));
    };
    const int64_t a = number(range.substr(0, dash)), b = dash == std::string_view::npos ? a : number(range.substr(dash + 1));
    OOM_CHECK(a <= b, what, spec, ": the range ", range, " is empty (FIRST-LAST with FIRST <= LAST)");
    if (L < 0) continue;
    OOM_CHECK(b < L, what, spec, ": layer ", b, " is past the model's last layer, ", L - 1);
    for (int64_t l = a; l <= b; ++l) {
      OOM_CHECK(owner[static_cast<size_t>(l)] < 0, what, spec, ": layer ", l, " is named twice");
      owner[static_cast<size_t>(l)] = static_cast<int>(items.size() - 1);
    }
  }
  if (L < 0) return items;
  std::vector<int> out(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    const int o = owner[static_cast<size_t>(l)];
    OOM_CHECK(o >= 0 || rest, what, spec, ": layer ", l, " has no ", kind, "; name every layer of the ", L,
              " or add a bare NAME for the rest");
    out[static_cast<size_t>(l)] = o >= 0 ? items[static_cast<size_t>(o)] : *rest;
  }
  return out;
}

}  // namespace

std::vector<SavePolicy> parse_save_policies(std::string_view spec, int64_t L) {
  const std::vector<int> i = parse_layer_list(spec, L, "[train] --save-policy ", "save policy", {"all", "selective", "none"},
                                              "all:0-3,none:4-31");
  std::vector<SavePolicy> out;
  for (int x : i) out.push_back(x == 0 ? SavePolicy::all : x == 1 ? SavePolicy::selective : SavePolicy::none);
  return out;
}

std::vector<Tier> parse_act_tiers(std::string_view spec, int64_t L) {
  const std::vector<int> i = parse_layer_list(spec, L, "[train] --act-offload ", "place for saved activations",
                                              {"none", "host", "disk"}, "disk:0-19,none");
  std::vector<Tier> out;
  for (int x : i) out.push_back(x == 0 ? Tier::Device : x == 1 ? Tier::Host : Tier::Disk);
  return out;
}

const char* save_policy_name(SavePolicy p) {
  switch (p) {
    case SavePolicy::all: return "all";
    case SavePolicy::selective: return "selective";
    case SavePolicy::none: return "none";
  }
  return "?";
}

ComputeDType parse_compute_dtype(std::string_view s) {
  if (s == "fp32" || s == "f32" || s == "float32") return ComputeDType::f32;
  if (s == "bf16" || s == "bfloat16") return ComputeDType::bf16;
  fail("[model] unknown compute dtype '", s, "'; use fp32 or bf16");
}

Model::Model(const ModelConfig& cfg, Ops& ops, ParamSet& params, Arena& arena, ModelOptions opt)
    : cfg_(cfg), ops_(ops), params_(params), arena_(arena), opt_(opt), act_(ops.act_dtype()) {
  OOM_CHECK(params.dtype() == act_, "[model] parameters are ", dtype_name(params.dtype()), " but the ", ops.name(),
            " backend computes in ", dtype_name(act_));
  if (opt_.dtype == ComputeDType::bf16) {
    OOM_CHECK(act_ == DType::f32, "[model] bf16 compute needs an fp32 backend (cpu), not ", ops.name());
  }
  OOM_CHECK(opt_.save_layers.empty() || static_cast<int64_t>(opt_.save_layers.size()) == cfg.L, "[model] ",
            opt_.save_layers.size(), " save policies for ", cfg.L, " layers");
  if (opt_.act_store != DType::f32 && opt_.act_store != act_)
    act_storage_ = std::make_unique<ActStorage>(opt_.act_store, cfg_.L);
  const bool bf16 = opt_.dtype == ComputeDType::bf16;
  auto read = [bf16](const Tensor& t) { return bf16 && (t.data || t.quant) ? t.read_as_bf16() : t; };
  for (const LayerParams& p : params_.layers) {
    LayerParams r = p;
    for (Tensor* w : {&r.wq, &r.wk, &r.wv, &r.wo, &r.wg, &r.wu, &r.wd}) *w = read(*w);
    wread_.push_back(r);
  }
  head_ = read(params_.lm_head);
  if (opt_.adapters) {
    const AdapterSet& ad = *opt_.adapters;
    OOM_CHECK(ad.layers() == cfg_.L && ad.tensors().dtype() == act_, "[model] the adapters (", ad.layers(),
              " layers of ", dtype_name(ad.tensors().dtype()), ") do not fit this model (", cfg_.L, " layers, ",
              dtype_name(act_), ")");
    lora_r_ = ad.settings().r;
    lora_scale_ = ad.settings().scale();
    lora_dropout_ = ad.settings().dropout;
    dora_ = ad.settings().dora;
    for (int64_t l = 0; l < cfg_.L; ++l) {
      LayerLora r = ad.layer(l);
      for (LoraTensors& t : r.p) t.a = read(t.a), t.b = read(t.b);
      aread_.push_back(r);
    }
  }
  if (dora_) {
    // The base's row norms once (it is frozen), room for each step's n and g, and the norm's scratch.
    auto buf = [&](int64_t n, Category cat, const char* what) {
      dora_bufs_.push_back(arena_.alloc(static_cast<size_t>(dtype_bytes(act_, n)), cat, what));
      return dora_bufs_.back().view(DType::u8, {static_cast<int64_t>(dora_bufs_.back().size())});
    };
    const int64_t r = lora_r_;
    int64_t max_n = 0;
    for (Proj p : opt_.adapters->settings().targets) max_n = std::max(max_n, proj_out(cfg_, p));
    dora_p_ = Tensor(buf(r * max_n, Category::workspace, "dora A W^T"), act_, {r, max_n});
    dora_aa_ = Tensor(buf(r * r, Category::workspace, "dora A A^T"), act_, {r, r});
    dora_q_ = Tensor(buf(max_n * r, Category::workspace, "dora B A A^T"), act_, {max_n, r});
    dora_rows_.resize(static_cast<size_t>(cfg_.L));
    for (int64_t l = 0; l < cfg_.L; ++l)
      for (Proj p : opt_.adapters->settings().targets) {
        const int64_t N = proj_out(cfg_, p);
        const Tensor d = buf(3 * N, Category::adapter, "dora norms");
        DoraRows& x = dora_rows_[static_cast<size_t>(l)][static_cast<size_t>(p)];
        x.wn = Tensor(d, act_, {N});
        x.n = Tensor(d, dtype_bytes(act_, N), act_, {N});
        x.g = Tensor(d, dtype_bytes(act_, 2 * N), act_, {N});
        ops_.row_norms(x.wn, proj_weight(params_.layers[static_cast<size_t>(l)], p));
      }
  }
}

Model::~Model() = default;

namespace {

// Trainable::group of a trainable tensor's name (Hugging Face or PEFT keys).
int64_t group_of(std::string_view name, const ModelConfig& cfg) {
  constexpr std::string_view peft = "base_model.model.";
  if (name.substr(0, peft.size()) == peft) name.remove_prefix(peft.size());
  if (const int64_t l = layer_of_name(name); l >= 0) return l;
  if (name == "model.embed_tokens.weight" || (cfg.tied && name == "lm_head.weight")) return kEmbedGroup;
  return kHeadGroup;  // model.norm.weight, lm_head.weight
}

}  // namespace

void Model::share_layer_grads() {
  OOM_CHECK(!opt_.adapters, "[model] shared layer gradients are for full training");
  OOM_CHECK(!grads_, "[model] share_layer_grads() must come before the gradients are allocated");
  share_layer_grads_ = true;
}

ParamSet& Model::grads() {
  OOM_CHECK(!opt_.adapters, "[model] the base model is frozen under adapters: it has no gradients");
  if (!grads_ && share_layer_grads_) {
    grads_ = std::make_unique<ParamSet>(cfg_, act_, arena_, Category::grads,
                                        [](const ParamSpec& p) { return layer_of_name(p.name) <= 0; });
    for (const ParamSpec& p : param_specs(cfg_)) {
      std::string rest;
      if (layer_of_name(p.name, &rest) > 0) grads_->set_view(p.name, *grads_->find("model.layers.0" + rest));
    }
  }
  if (!grads_) grads_ = std::make_unique<ParamSet>(cfg_, act_, arena_, Category::grads);
  return *grads_;
}

AdapterSet& Model::adapter_grads() {
  OOM_CHECK(opt_.adapters, "[model] adapter gradients need adapters");
  if (!agrads_) {
    agrads_ = std::make_unique<AdapterSet>(cfg_, opt_.adapters->settings(), act_, arena_, Category::grads);
    const LoraSettings& s = opt_.adapters->settings();
    const bool embed = s.train_embed || (cfg_.tied && s.train_head), head = s.train_head && !cfg_.tied;
    std::vector<ParamSpec> specs;
    if (embed) specs.push_back({"embed", {cfg_.V, cfg_.E}, true});
    if (head) specs.push_back({"head", {cfg_.V, cfg_.E}, true});
    if (!specs.empty()) {
      sgrads_ = std::make_unique<ParamSet>(specs, act_, arena_, Category::grads, "modules_to_save grads");
      if (embed) g_embed_ = sgrads_->tensors()[0];
      g_head_ = head ? sgrads_->tensors()[embed ? 1 : 0] : cfg_.tied ? g_embed_ : Tensor();
    }
  }
  return *agrads_;
}

void Model::ensure_grads() {
  if (opt_.adapters) adapter_grads();
  else grads();
}

TrainableSet Model::trainable() {
  TrainableSet t;
  if (opt_.adapters) {
    t = trainable_set(opt_.adapters->tensors(), adapter_grads().tensors());
    // modules_to_save, under PEFT's keys (a tied matrix once, as the embedding).
    if (g_embed_.data) t.push_back({"base_model.model.model.embed_tokens.weight", params_.embed, g_embed_, true});
    if (g_head_.data && !cfg_.tied) t.push_back({"base_model.model.lm_head.weight", params_.lm_head, g_head_, true});
  } else {
    for (size_t i = 0; i < params_.specs().size(); ++i)
      OOM_CHECK(params_.tensors()[i].data, "[model] ", params_.specs()[i].name, " is held quantised (",
                params_.tensors()[i].quant ? params_.tensors()[i].quant->format : "elsewhere",
                "): a quantised base can only be frozen; train an adapter on it (--lora r)");
    t = trainable_set(params_, grads());
  }
  for (Trainable& x : t) x.group = group_of(x.name, cfg_);
  return t;
}

void Model::grads_final(int64_t group) {
  if (grad_hook_ && hook_this_backward_) grad_hook_(group);
}

void Model::zero_grads() {
  if (grads_) ops_.zero(grads_->raw());
  if (agrads_) ops_.zero(agrads_->tensors().raw());
  if (sgrads_) ops_.zero(sgrads_->raw());
}

void Model::reserve(int64_t T, bool for_backward, bool chunked) {
  OOM_CHECK(T >= 1, "[model] sequence length must be >= 1, got ", T);
  if (s_ && T <= cap_T_ && (!for_backward || cap_backward_) && (!chunked || cap_chunked_)) return;
  s_.reset();
  auto s = std::make_unique<Scratch>();
  const int64_t E = cfg_.E, F = cfg_.F, H = cfg_.H, Hkv = cfg_.Hkv, D = cfg_.D, L = cfg_.L;
  auto alloc = [&](DType t, std::initializer_list<int64_t> shape, Category cat, const char* what) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    s->bufs.push_back(arena_.alloc(static_cast<size_t>(dtype_bytes(t, n)), cat, what));
    return s->bufs.back().view(t, shape);
  };
  const Category A = Category::activations, W = Category::workspace;
  s->pos = alloc(DType::i32, {T}, W, "positions");
  ops_.iota(s->pos, 0);
  s->ones = alloc(act_, {T, 1}, W, "ones");
  ops_.fill(s->ones, 1.0);
  s->ids = alloc(DType::i32, {T}, W, "ids");
  s->targets = alloc(DType::i32, {T}, W, "targets");

  // A set of block activations: the full recompute set, or per layer what the policy keeps. `recomputed`
  // marks what selective recompute rebuilds (norms and the SwiGLU product): kept only with SavePolicy all.
  // Saved per-layer copies are narrow with --act-dtype (model/act_store.h), but for the row statistics.
  const DType nd = act_storage_ && for_backward ? act_storage_->storage() : act_;
  auto act_set = [&](auto&& take, Category cat, bool everything, SavePolicy policy) {
    const bool all = everything || policy == SavePolicy::all;
    const DType dt = cat == A ? nd : act_;
    auto maybe = [&](bool keep, std::initializer_list<int64_t> shape, const char* what, DType t) {
      return keep ? take(t, shape, cat, what) : Tensor();
    };
    Acts a;  // x_in is always the residual stream state, layer_in[l]
    a.h1 = maybe(all, {T, E}, "h1", dt);
    a.rstd1 = maybe(all, {T}, "rstd1", act_);
    a.q_pre = maybe(cfg_.qk_norm, {T, H, D}, "q_pre", dt);
    a.q_rstd = maybe(cfg_.qk_norm && all, {T * H}, "q_rstd", act_);
    a.k_pre = maybe(cfg_.qk_norm, {Hkv, T, D}, "k_pre", dt);
    a.k_rstd = maybe(cfg_.qk_norm && all, {Hkv * T}, "k_rstd", act_);
    a.q = take(dt, {T, H, D}, cat, "q");
    a.k = take(dt, {Hkv, T, D}, cat, "k");
    a.v = take(dt, {Hkv, T, D}, cat, "v");
    a.o = take(dt, {T, H, D}, cat, "o");
    a.lse = take(act_, {H, T}, cat, "lse");
    a.x_mid = take(dt, {T, E}, cat, "x_mid");
    a.h2 = maybe(all, {T, E}, "h2", dt);
    a.rstd2 = maybe(all, {T}, "rstd2", act_);
    a.gate = take(dt, {T, F}, cat, "gate");
    a.up = take(dt, {T, F}, cat, "up");
    a.act = maybe(all, {T, F}, "act", dt);
    for (int p = 0; p < kProjCount; ++p)
      if (lora_on(0, static_cast<Proj>(p))) a.u[p] = take(dt, {T, lora_r_}, cat, "lora_u");
    // DoRA's unscaled projection outputs: what the magnitude's gradient needs (training only).
    for (int p = 0; p < kProjCount && for_backward; ++p) {
      const Proj x = static_cast<Proj>(p);
      if (!dora_on(0, x)) continue;
      a.z[p] = x == Proj::k || x == Proj::v ? take(dt, {Hkv, T, D}, cat, "dora_z")
                                            : take(dt, {T, proj_out(cfg_, x)}, cat, "dora_z");
    }
    return a;
  };
  s->work = act_set(alloc, W, true, SavePolicy::all);
  // The residual stream: every layer's input is kept in training (it is the checkpoint); inference
  // ping-pongs between two.
  const int64_t n_states = for_backward ? L + 1 : 2;
  for (int64_t i = 0; i < n_states; ++i) s->layer_in.push_back(alloc(act_, {T, E}, A, "residual"));
  bool keeps = chunked, leaves = false;
  for (int64_t l = 0; l < L; ++l) {
    keeps = keeps || save_policy(l) != SavePolicy::none;
    leaves = leaves || act_tier(l) != Tier::Device;
  }
  OOM_CHECK(!(for_backward && keeps && leaves) || !chunked, "[model] saved activations are offloaded in full-"
            "sequence training only; chunk-recurrent training keeps one chunk's (drop --act-offload or --chunk)");
  // The layers whose sets leave Device between forward and backward, in order.
  std::vector<int64_t> out_layers;
  for (int64_t l = 0; for_backward && !chunked && l < L; ++l)
    if (act_tier(l) != Tier::Device && save_policy(l) != SavePolicy::none) out_layers.push_back(l);
  const bool offload = !out_layers.empty();
  s->off_index.assign(static_cast<size_t>(L), -1);
  // Views laid out in act_set's order, each 64-byte aligned, from `base` (null: count the bytes only).
  struct Carver {
    char* base = nullptr;
    size_t bytes = 0;
    Tier tier = Tier::Device;
    Tensor operator()(DType t, std::initializer_list<int64_t> shape, Category, const char*) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      bytes = (bytes + 63) / 64 * 64;
      Tensor r = base ? Tensor(base + bytes, t, shape, tier) : Tensor();
      bytes += static_cast<size_t>(dtype_bytes(t, n));
      return r;
    }
  };
  if (offload) {
    // Each leaving layer's set measured, then carved from its ring set (views laid out in act_set's order,
    // 64-byte aligned), so the i-th and (i + kActRing)-th leaving layers share memory; all but the last
    // kActRing get a Host buffer or a spill slot of their size.
    const int64_t K = static_cast<int64_t>(out_layers.size()), R = std::min(kActRing, K);
    s->off_layers = out_layers;
    s->act_bytes.assign(static_cast<size_t>(L), 0);
    std::vector<size_t> ring_bytes(static_cast<size_t>(R), 0);
    for (int64_t i = 0; i < K; ++i) {
      const int64_t l = out_layers[static_cast<size_t>(i)];
      s->off_index[static_cast<size_t>(l)] = i;
      Carver count;
      act_set(count, A, false, save_policy(l));
      s->act_bytes[static_cast<size_t>(l)] = count.bytes;
      ring_bytes[static_cast<size_t>(i % R)] = std::max(ring_bytes[static_cast<size_t>(i % R)], count.bytes);
    }
    for (int64_t r = 0; r < R; ++r)
      s->ring.push_back(arena_.alloc(ring_bytes[static_cast<size_t>(r)], A, "saved activations (offload ring)"));
    s->host.resize(static_cast<size_t>(L));
    s->disk.assign(static_cast<size_t>(L), -1);
    s->out.assign(static_cast<size_t>(L), 0);
    s->in.assign(static_cast<size_t>(L), 0);
    const size_t largest = *std::max_element(ring_bytes.begin(), ring_bytes.end());
    bool to_disk = false;
    for (int64_t i = 0; i < K - R; ++i) to_disk = to_disk || act_tier(out_layers[static_cast<size_t>(i)]) == Tier::Disk;
    if (to_disk) s->spill = SpillFile::open(opt_.spill_dir, largest, arena_.ledger(), Category::activations);
    for (int64_t i = 0; i < K - R; ++i) {
      const int64_t l = out_layers[static_cast<size_t>(i)];
      const size_t n = s->act_bytes[static_cast<size_t>(l)];
      if (act_tier(l) == Tier::Host) {
        OOM_CHECK(opt_.act_host, "[model] Host offload of activations needs the Host arena");
        s->host[static_cast<size_t>(l)] = opt_.act_host->alloc(n, A, "offloaded activations");
      } else {
        s->disk[static_cast<size_t>(l)] = s->spill->alloc_slot();
      }
    }
    s->off = std::make_unique<Offloader>(s->spill.get());
  }
  for (int64_t l = 0; for_backward && keeps && l < L; ++l) {
    Acts a;  // a recomputed layer keeps nothing but its input (in layer_in) ...
    const int64_t i = s->off_index[static_cast<size_t>(l)];
    if (i >= 0) {
      const Buffer& ring = s->ring[static_cast<size_t>(i % std::min<int64_t>(kActRing, static_cast<int64_t>(out_layers.size())))];
      Carver carve{ring.as<char>(), 0, ring.tier()};
      a = act_set(carve, A, false, save_policy(l));
    } else if (save_policy(l) != SavePolicy::none) {
      a = act_set(alloc, A, false, save_policy(l));
    } else if (chunked) {
      // ... but in chunk mode its attention O and LSE, so that the recompute never sweeps the history again.
      a.o = alloc(nd, {T, H, D}, A, "o");
      a.lse = alloc(act_, {H, T}, A, "lse");
    }
    s->saved.push_back(a);
  }
  s->hn = alloc(act_, {T, E}, A, "final_norm");
  s->rstd_f = alloc(act_, {T}, A, "final_rstd");
  s->lse_f = alloc(act_, {T}, A, "loss_lse");
  s->proj = alloc(act_, {T, E}, W, "proj");
  if (for_backward) {
    s->dx = alloc(act_, {T, E}, W, "dx");
    s->dh = alloc(act_, {T, E}, W, "dh");
    s->dxn = alloc(act_, {T, E}, W, "dxn");
    s->dq = alloc(act_, {T, H, D}, W, "dq");
    s->dq_pre = alloc(act_, {T, H, D}, W, "dq_pre");
    s->d_o = alloc(act_, {T, H, D}, W, "d_o");
    s->dk = alloc(act_, {Hkv, T, D}, W, "dk");
    s->dv = alloc(act_, {Hkv, T, D}, W, "dv");
    s->dk_pre = alloc(act_, {Hkv, T, D}, W, "dk_pre");
    s->dgate = alloc(act_, {T, F}, W, "dgate");
    s->dup = alloc(act_, {T, F}, W, "dup");
    s->dact = alloc(act_, {T, F}, W, "dact");
    if (cfg_.qk_norm) s->tmp_rows = alloc(act_, {std::max(T * H, Hkv * T) * D}, W, "norm_tmp");
    if (opt_.adapters)
      for (Tensor& t : s->du) t = alloc(act_, {T, lora_r_}, W, "lora_du");
    if (lora_dropout_ > 0) s->dxdrop = alloc(act_, {T * std::max({E, F, H * D})}, W, "lora_dropout_dx");
    if (dora_on(0, Proj::o) || dora_on(0, Proj::down)) s->dz = alloc(act_, {T, E}, W, "dora_dz");
  }
  if (lora_dropout_ > 0) s->xdrop = alloc(act_, {T * std::max({E, F, H * D})}, W, "lora_dropout_x");
  if (lora_dropout_ > 0 && dora_) {
    s->dora_t = alloc(act_, {T * std::max({E, F, H * D})}, W, "dora_dropout");
    if (for_backward) {
      s->dora_t2 = alloc(act_, {T * std::max({E, F, H * D})}, W, "dora_dropout");
      s->dora_dz = alloc(act_, {T * std::max({E, F, H * D})}, W, "dora_dropout");
    }
  }
  if (opt_.dtype == ComputeDType::bf16) {
    s->op_elems = T * std::max({E, F, H * D});
    s->op_small_elems = T * lora_r_;
    for (int i = 0; i < 5; ++i) {
      const bool big = i < 2 || i == 4;
      if (i < 2 || (opt_.adapters && i < 4) || (i == 4 && lora_dropout_ > 0))
        s->op[i] = alloc(DType::bf16, {big ? s->op_elems : s->op_small_elems}, W, "bf16 operand");
    }
  }
  s_ = std::move(s);
  cap_T_ = T;
  cap_backward_ = for_backward;
  cap_chunked_ = chunked;
}

bool Model::act_offloading() const { return s_ && s_->off; }

OffloadStats Model::act_offload_stats() const { return act_offloading() ? s_->off->stats() : OffloadStats{}; }

// The leaving layers in order (Scratch::off_layers): the i-th waits, before its forward, for the copy out of
// the (i - kActRing)-th, whose ring set it reuses; after its forward its set is copied out (unless it is one of
// the last kActRing); after its backward the (i - kActRing)-th is fetched back into the set it released.
void Model::act_offload_before_forward(int64_t layer) {
  if (!act_offloading() || !training_) return;
  const int64_t i = s_->off_index[static_cast<size_t>(layer)];
  if (i < kActRing) return;
  Offloader::Ticket& t = s_->out[static_cast<size_t>(s_->off_layers[static_cast<size_t>(i - kActRing)])];
  s_->off->wait(t);
  t = 0;
}

void Model::act_offload_after_forward(int64_t layer) {
  if (!act_offloading() || !training_) return;
  const size_t l = static_cast<size_t>(layer);
  const int64_t i = s_->off_index[l], K = static_cast<int64_t>(s_->off_layers.size());
  if (i < 0 || i >= K - kActRing || s_->act_bytes[l] == 0) return;
  const void* src = s_->ring[static_cast<size_t>(i % kActRing)].data();
  s_->out[l] = s_->disk[l] >= 0 ? s_->off->to_disk(s_->disk[l], src, s_->act_bytes[l], 0, Tier::Device)
                                : s_->off->copy(s_->host[l].data(), src, s_->act_bytes[l], Tier::Device, Tier::Host);
}

void Model::act_offload_before_backward(int64_t layer) {
  if (!act_offloading() || s_->off_index[static_cast<size_t>(layer)] < 0) return;
  Offloader::Ticket& t = s_->in[static_cast<size_t>(layer)];
  s_->off->wait(t);
  t = 0;
}

void Model::act_offload_after_backward(int64_t layer) {
  if (!act_offloading()) return;
  const int64_t below = s_->off_index[static_cast<size_t>(layer)] - kActRing;
  if (s_->off_index[static_cast<size_t>(layer)] < 0 || below < 0) return;
  const size_t k = static_cast<size_t>(s_->off_layers[static_cast<size_t>(below)]);
  if (s_->act_bytes[k] == 0) return;
  void* dst = s_->ring[static_cast<size_t>(below % kActRing)].data();
  s_->in[k] = s_->disk[k] >= 0 ? s_->off->from_disk(dst, s_->disk[k], s_->act_bytes[k], 0, Tier::Device)
                               : s_->off->copy(dst, s_->host[k].data(), s_->act_bytes[k], Tier::Host, Tier::Device);
}

Model::Acts Model::acts_for_layer(int64_t layer) {
  Acts a = s_->work;
  if (!s_->saved.empty()) {
    const Acts& sv = s_->saved[static_cast<size_t>(layer)];
    // Narrow copies (--act-dtype) stay where they are: the layer computes in the work set, and
    // stash_layer / unstash_layer move the values.
    auto pick = [&](Tensor& dst, const Tensor& src) {
      if (src.data && src.dtype == act_) dst = src;
    };
    pick(a.h1, sv.h1), pick(a.rstd1, sv.rstd1), pick(a.q_pre, sv.q_pre), pick(a.q_rstd, sv.q_rstd);
    pick(a.k_pre, sv.k_pre), pick(a.k_rstd, sv.k_rstd), pick(a.q, sv.q), pick(a.k, sv.k), pick(a.v, sv.v);
    pick(a.o, sv.o), pick(a.lse, sv.lse), pick(a.x_mid, sv.x_mid), pick(a.h2, sv.h2), pick(a.rstd2, sv.rstd2);
    pick(a.gate, sv.gate), pick(a.up, sv.up), pick(a.act, sv.act);
    for (int p = 0; p < kProjCount; ++p) pick(a.u[p], sv.u[p]), pick(a.z[p], sv.z[p]);
  }
  a.x_in = s_->layer_in[static_cast<size_t>(layer) % s_->layer_in.size()];
  // Views for the current length T (buffers are sized for the reserved capacity).
  const int64_t T = T_, E = cfg_.E, F = cfg_.F, H = cfg_.H, Hkv = cfg_.Hkv, D = cfg_.D;
  auto re = [](Tensor& t, std::initializer_list<int64_t> shape) {
    if (t.data) t = Tensor(t, t.dtype, shape);
  };
  re(a.x_in, {T, E}), re(a.h1, {T, E}), re(a.rstd1, {T}), re(a.q_pre, {T, H, D}), re(a.q_rstd, {T * H});
  re(a.k_pre, {Hkv, T, D}), re(a.k_rstd, {Hkv * T}), re(a.q, {T, H, D}), re(a.k, {Hkv, T, D});
  re(a.v, {Hkv, T, D}), re(a.o, {T, H, D}), re(a.lse, {H, T}), re(a.x_mid, {T, E}), re(a.h2, {T, E});
  re(a.rstd2, {T}), re(a.gate, {T, F}), re(a.up, {T, F}), re(a.act, {T, F});
  for (Tensor& u : a.u) re(u, {T, lora_r_});
  for (int p = 0; p < kProjCount; ++p) {
    const Proj x = static_cast<Proj>(p);
    if (x == Proj::k || x == Proj::v) re(a.z[p], {Hkv, T, D});
    else re(a.z[p], {T, proj_out(cfg_, x)});
  }
  return a;
}

namespace {

// x's values as a flat vector, and the same number of elements of c's buffer.
Tensor flat(const Tensor& x) { return Tensor(x, x.dtype, {x.numel()}); }
Tensor flat_like(const Tensor& c, const Tensor& x) { return Tensor(c, c.dtype, {x.numel()}); }

}  // namespace

std::array<Tensor*, kActSlots> Model::slots_of(Acts& a) {
  std::array<Tensor*, kActSlots> r{&a.h1, &a.q_pre, &a.k_pre, &a.q, &a.k, &a.v, &a.o, &a.x_mid, &a.h2, &a.gate, &a.up, &a.act};
  for (int p = 0; p < kProjCount; ++p) {
    r[static_cast<size_t>(12 + p)] = &a.u[p];
    r[static_cast<size_t>(12 + kProjCount + p)] = &a.z[p];
  }
  return r;
}

bool Model::narrow_saved() const { return act_storage_ && s_ && !s_->saved.empty(); }

void Model::stash_layer(int64_t layer, const Acts& a) {
  Acts w = a;
  const auto cs = slots_of(s_->saved[static_cast<size_t>(layer)]), xs = slots_of(w);
  for (int i = 0; i < kActSlots; ++i) {
    const Tensor& c = *cs[static_cast<size_t>(i)];
    const ActKind k = act_kind_of_slot(i);
    if (!c.data || c.dtype == act_ || k == ActKind::q || k == ActKind::k || k == ActKind::v) continue;
    const Tensor& x = *xs[static_cast<size_t>(i)];
    act_storage_->narrow(ops_, layer, i, flat_like(c, x), flat(x));
  }
}

void Model::stash_in_place(int64_t layer, ActKind kind, Tensor x) {
  if (!stash_ && !round_qkv_) return;
  Acts& sv = s_->saved[static_cast<size_t>(layer)];
  const Tensor& c = kind == ActKind::q ? sv.q : kind == ActKind::k ? sv.k : sv.v;
  if (!c.data || c.dtype == act_) return;
  act_storage_->narrow_in_place(ops_, layer, static_cast<int>(kind), flat_like(c, x), flat(x));
}

void Model::unstash_layer(int64_t layer, Acts& a) {
  if (!narrow_saved()) return;
  const auto cs = slots_of(s_->saved[static_cast<size_t>(layer)]), xs = slots_of(a);
  for (int i = 0; i < kActSlots; ++i) {
    const Tensor& c = *cs[static_cast<size_t>(i)];
    if (!c.data || c.dtype == act_) continue;
    const Tensor& x = *xs[static_cast<size_t>(i)];
    act_storage_->widen(ops_, layer, i, flat(x), flat_like(c, x));
  }
}

Tensor Model::as_operand(Tensor x, int slot) {
  OOM_CHECK(x.ndim == 2, "[model] matmul operands are 2-D, got ", x.str());
  if (opt_.dtype != ComputeDType::bf16) return x;
  OOM_CHECK(x.numel() <= (slot < 2 || slot == 4 ? s_->op_elems : s_->op_small_elems),
            "[model] bf16 operand scratch too small");
  Tensor b(s_->op[slot], DType::bf16, {x.dims[0], x.dims[1]});
  ops_.convert(b, x);
  return b;
}

void Model::linear_forward(Tensor y, Tensor x, Tensor wc, Tensor b) {
  // y (T, N) = x (T, K) . W (N, K)^T [+ b]; x is already an operand (fp32 or bf16 copy), wc the matching weight.
  ops_.matmul(y, x, wc, false, true, false);
  if (b.data) {
    Tensor ones(s_->ones, act_, {y.dims[0], 1});
    ops_.matmul(y, ones, b.reshape({1, b.numel()}), false, false, true);
  }
}

void Model::linear_backward_input(Tensor dx, Tensor dy, Tensor wc, bool accumulate) {
  // dx (T, K) (=|+=) dy (T, N) . W (N, K); dy is an operand.
  ops_.matmul(dx, dy, wc, false, false, accumulate);
}

void Model::linear_backward_weight(Tensor dw, Tensor dy, Tensor x) {
  // dW (N, K) += dy^T (N, T) . x (T, K); dy, x are operands. Nothing for a frozen weight.
  if (!dw.data) return;
  ops_.matmul(dw, dy, x, true, false, true);
}

bool Model::lora_on(int64_t layer, Proj p) const {
  return !aread_.empty() && aread_[static_cast<size_t>(layer)][p].a.data;
}

Linear Model::linear(int64_t layer, Proj p) const {
  const size_t l = static_cast<size_t>(layer);
  Linear L;
  L.w = proj_weight(wread_[l], p);
  L.b = proj_bias(params_.layers[l], p);
  if (grads_) L.gw = proj_weight(grads_->layers[l], p), L.gb = proj_bias(grads_->layers[l], p);
  if (!lora_on(layer, p)) return L;
  const LoraTensors& t = aread_[l][p];
  L.a = t.a, L.bm = t.b, L.scale = lora_scale_;
  if (agrads_) {
    const LoraTensors& g = agrads_->layer(layer)[p];
    L.ga = g.a, L.gbm = g.b, L.gm = g.m;
  }
  L.dropout_seed = dropout_seed(layer, p);
  if (dora_) {
    const DoraRows& d = dora_rows_[l][static_cast<size_t>(p)];
    L.g = d.g, L.n = d.n;
  }
  return L;
}

Linear Model::head_linear() const {
  Linear L;
  L.w = head_;
  L.gw = grads_ ? grads_->lm_head : g_head_;
  return L;
}

void Model::project(const Linear& L, Tensor y, Tensor x, Tensor x_op, Tensor u, Tensor z) {
  linear_forward(y, x_op, L.w, L.dora() ? Tensor() : L.b);  // DoRA adds the bias after its scale
  if (!L.lora()) return;
  if (L.dora() && dropout_on()) return dora_dropout_forward(L, y, x, u, z);
  lora_up(L, y, u);
  if (L.dora()) dora_forward(L, y, z);
}

void Model::project_backward(const Linear& L, Tensor dy, Tensor dz, Tensor x_op, Tensor dx, bool dx_acc, Tensor u,
                             Tensor z, Tensor du, bool du_acc, Tensor t, bool t_acc) {
  bias_backward(L.gb, dy);  // from dy itself, before DoRA scales it
  if (L.dora() && dropout_on()) return dora_dropout_backward(L, dy, z, u, dx, dx_acc, t, t_acc, du, du_acc);
  Tensor g = dy;
  if (L.dora()) {
    dora_backward(L, dz, dy, z);
    g = dz;
  }
  Tensor op = as_operand(g, 0);
  linear_backward_input(dx, op, L.w, dx_acc);
  linear_backward_weight(L.gw, op, x_op);
  if (L.lora()) lora_backward_rows(L, du, op, u, du_acc);
}

uint64_t Model::dropout_seed(int64_t layer, Proj p) const {
  return dropout_seed_ ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(layer * kProjCount + static_cast<int>(p) + 1));
}

Tensor Model::dropped(const Linear& L, Tensor x) {
  Tensor xd(s_->xdrop, act_, {x.dims[0], x.dims[1]});
  ops_.dropout(xd, x, lora_dropout_, L.dropout_seed, row0_ * x.dims[1], false);
  return as_operand(xd, 4);
}

void Model::lora_down(const Linear& L, Tensor u, Tensor x, Tensor x_op) {
  ops_.matmul(u, dropout_on() ? dropped(L, x) : x_op, L.a, false, true, false);
  ops_.scale(u, L.scale);
}

void Model::lora_up(const Linear& L, Tensor y, Tensor u) {
  ops_.matmul(y, as_operand(u, 2), L.bm, false, true, true);
}

void Model::lora_backward_rows(const Linear& L, Tensor du, Tensor dy_op, Tensor u, bool accumulate) {
  ops_.matmul(L.gbm, dy_op, as_operand(u, 2), true, false, true);
  ops_.matmul(du, dy_op, L.bm, false, false, accumulate);
}

void Model::lora_backward_input(const Linear& L, Tensor dx, Tensor du, Tensor x, Tensor x_op, Tensor pre) {
  ops_.scale(du, L.scale);
  Tensor du_op = as_operand(du, 3);
  if (!dropout_on()) {
    ops_.matmul(L.ga, du_op, x_op, true, false, true);
    ops_.matmul(dx, du_op, L.a, false, false, true);
    return;
  }
  // dA += du^T dropout(x) (the same mask, drawn again); dx += dropout(du A [+ pre]).
  ops_.matmul(L.ga, du_op, dropped(L, x), true, false, true);
  Tensor t = pre.data ? pre : Tensor(s_->dxdrop, act_, {dx.dims[0], dx.dims[1]});
  ops_.matmul(t, du_op, L.a, false, false, pre.data != nullptr);
  ops_.dropout(dx, t, lora_dropout_, L.dropout_seed, row0_ * dx.dims[1], true);
}

void Model::refresh_dora() {
  if (!dora_) return;
  const AdapterSet& ad = *opt_.adapters;
  const int64_t r = lora_r_;
  for (int64_t l = 0; l < cfg_.L; ++l)
    for (Proj p : ad.settings().targets) {
      // From the master tensors (fp32 even under bf16 compute; a quantised base as the GEMM reads it).
      const LoraTensors& t = ad.layer(l)[p];
      const DoraRows& d = dora_rows_[static_cast<size_t>(l)][static_cast<size_t>(p)];
      if (hold_dora_) {  // the held n, the current m
        ops_.dora_scale(d.g, d.n, t.m, d.n, Tensor(), Tensor(), Tensor(), 0.0);
        continue;
      }
      const int64_t N = proj_out(cfg_, p);
      Tensor pt(dora_p_, act_, {r, N}), q(dora_q_, act_, {N, r});
      ops_.matmul(pt, t.a, proj_weight(params_.layers[static_cast<size_t>(l)], p), false, true, false);
      ops_.matmul(dora_aa_, t.a, t.a, false, true, false);
      ops_.matmul(q, t.b, dora_aa_, false, false, false);
      ops_.dora_scale(d.g, d.n, t.m, d.wn, t.b, pt, q, lora_scale_);
    }
}

void Model::dora_forward(const Linear& L, Tensor y, Tensor z) {
  ops_.dora_forward(y, z, L.g, L.b);
}

void Model::dora_backward(const Linear& L, Tensor dz, Tensor dy, Tensor z) {
  ops_.dora_backward(dz, L.gm, dy, z, L.g, L.n);
}

void Model::dora_dropout_forward(const Linear& L, Tensor y, Tensor x, Tensor u, Tensor z) {
  Tensor t(s_->dora_t, act_, {y.dims[0], y.dims[1]});
  linear_forward(t, dropped(L, x), L.w, Tensor());  // x_d W^T
  ops_.axpy(y, -1.0, t);                            // (x - x_d) W^T, negated exactly below
  lora_up(L, t, u);                                 // z_d
  dora_forward(L, t, z);                            // g z_d + b
  ops_.add(y, y, t);
}

void Model::dora_dropout_backward(const Linear& L, Tensor dy, Tensor z, Tensor u, Tensor dx, bool dx_acc, Tensor t,
                                  bool t_acc, Tensor du, bool du_acc) {
  Tensor dz(s_->dora_dz, act_, {dy.dims[0], dy.dims[1]});
  dora_backward(L, dz, dy, z);  // dm; dz = g dy
  linear_backward_input(dx, as_operand(dy, 0), L.w, dx_acc);
  lora_backward_rows(L, du, as_operand(dz, 0), u, du_acc);
  ops_.axpy(dz, -1.0, dy);  // (g - 1) dy
  linear_backward_input(t, as_operand(dz, 0), L.w, t_acc);
}

void Model::bias_backward(Tensor db, Tensor dy) {
  // db (N) += column sums of dy (T, N), as ones (T, 1)^T . dy: one fixed-order GEMM.
  if (!db.data) return;
  Tensor ones(s_->ones, act_, {dy.dims[0], 1});
  ops_.matmul(db.reshape({1, db.numel()}), ones, dy, true, false, true);
}

}  // namespace oomless
