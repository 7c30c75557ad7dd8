#include "model/act_store.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace oomless {

ActKind act_kind_of_slot(int slot) {
  if (slot < 12) return static_cast<ActKind>(slot);
  return slot < 12 + kProjCount ? ActKind::lora_u : ActKind::dora_z;
}

const char* act_kind_name(ActKind k) {
  static constexpr const char* kNames[kActKinds] = {"h1",    "q_pre", "k_pre", "q",  "k",    "v",  "o",
                                                    "x_mid", "h2",    "gate",  "up", "act", "lora_u", "dora_z"};
  return kNames[static_cast<int>(k)];
}

DType parse_act_dtype(std::string_view s) {
  if (s == "fp32" || s == "f32") return DType::f32;
  if (s == "bf16") return DType::bf16;
  if (s == "fp8") return DType::f8_e4m3;
  fail("[train] --act-dtype ", s, " is not a storage for saved activations oomless has; use fp32, bf16 or fp8");
}

ActStorage::ActStorage(DType storage, int64_t layers) : storage_(storage) {
  OOM_CHECK(storage == DType::bf16 || storage == DType::f8_e4m3, "[model] saved activations are stored as bf16 or "
            "f8_e4m3, not ", dtype_name(storage));
  hist_.assign(static_cast<size_t>(layers * kActSlots), {});
  scale_.assign(static_cast<size_t>(layers * kActSlots), 1.0);
}

void ActStorage::narrow(Ops& ops, int64_t layer, int slot, Tensor c, Tensor x) {
  const size_t i = static_cast<size_t>(layer * kActSlots + slot);
  ActCounts& cnt = counts_[static_cast<size_t>(act_kind_of_slot(slot))];
  double scale = 1.0;
  CastStats st;
  if (storage_ == DType::f8_e4m3) {
    const std::vector<float>& h = hist_[i];
    const float ref = h.empty() ? 0.0f : *std::max_element(h.begin(), h.end());
    if (ref > 0) {
      scale = 448.0 / ref;
      st = ops.cast_scaled(c, x, scale);
    } else {  // no history yet: the tensor's own amax (one pass to find it)
      st = ops.cast_scaled(c, x, 1.0);
      if (st.amax > 0 && std::isfinite(st.amax)) {
        scale = 448.0 / st.amax;
        st = ops.cast_scaled(c, x, scale);
      }
    }
    if (std::isfinite(st.amax)) {
      hist_[i].push_back(static_cast<float>(st.amax));
      if (hist_[i].size() > static_cast<size_t>(kAmaxHistory)) hist_[i].erase(hist_[i].begin());
    } else {
      ++cnt.nonfinite;
    }
  } else {
    st = ops.cast_scaled(c, x, 1.0);
    if (!std::isfinite(st.amax)) ++cnt.nonfinite;
  }
  scale_[i] = scale;
  cnt.values += static_cast<uint64_t>(x.numel());
  cnt.saturated += static_cast<uint64_t>(st.saturated);
  cnt.flushed += static_cast<uint64_t>(st.flushed);
}

void ActStorage::widen(Ops& ops, int64_t layer, int slot, Tensor x, Tensor c) {
  ops.convert(x, c);
  const double scale = scale_[static_cast<size_t>(layer * kActSlots + slot)];
  if (scale != 1.0) ops.scale(x, 1.0 / scale);
}

void ActStorage::reset() {
  for (std::vector<float>& h : hist_) h.clear();
  std::fill(scale_.begin(), scale_.end(), 1.0);
  counts_ = {};
}

json::Value ActStorage::amax_state() const {
  return storage_ == DType::f8_e4m3 ? amax_history_json(hist_) : json::Value();
}

void ActStorage::restore_amax(const json::Value& state) {
  restore_amax_history(hist_, state, "[train] activations:", std::to_string(kActSlots) + " per layer");
}

}  // namespace oomless
