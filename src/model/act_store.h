// Saved activations in a narrower storage (--act-dtype): what a training forward keeps for backward
// (the SavePolicy's per-layer tensors) held as bf16 or f8_e4m3 instead of the act dtype, and widened
// again into the one-layer work set just before that layer's backward. The forward itself computes
// in the act dtype; only the copies kept for backward are narrow.
//
// Which tensors: the per-layer saved activations (norm outputs, q/k/v and their pre-norm forms, attention
// O, the residual after attention, gate/up/SwiGLU product, LoRA's u and DoRA's unscaled outputs). Kept in
// the act dtype: the per-row statistics (RMSNorm rstd, attention LSE: a few bytes a row, and the
// attention backward's probabilities exp(s - lse) are exponentially sensitive to them) and the residual
// stream states (the checkpoints a recompute starts from). Attention's inputs q, k, v are rounded in place
// before attention runs, so the forward's LSE belongs to the same q, k, v the backward reads.
//
// f8_e4m3 uses delayed scaling as Transformer Engine does (and as the K/V store's fp8 pages): each
// (layer, tensor) is multiplied by 448 / the largest |x| it had over its last kAmaxHistory stashes (its
// own amax while the history is empty or all zeros) and rounded to E4M3, saturating; the inverse scale
// widens it back. Counted per tensor kind: values stored, saturated, flushed to zero, stashes with a
// non-finite amax (kept out of the history; the step's loss is then not finite and the step skipped).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "io/amax_history.h"
#include "io/json.h"
#include "model/lora.h"

namespace oomless {

// The tensors one layer may keep, as slots: the 12 block activations, then LoRA's u and DoRA's z per
// projection.
enum class ActKind : int { h1, q_pre, k_pre, q, k, v, o, x_mid, h2, gate, up, act, lora_u, dora_z };
inline constexpr int kActKinds = 14;
inline constexpr int kActSlots = 12 + 2 * kProjCount;
ActKind act_kind_of_slot(int slot);
const char* act_kind_name(ActKind k);
// "fp32" (as computed: f32), "bf16", "fp8" (f8_e4m3); anything else an error naming them.
DType parse_act_dtype(std::string_view s);

struct ActCounts {
  uint64_t values = 0, saturated = 0, flushed = 0, nonfinite = 0;
};

class ActStorage {
 public:
  ActStorage(DType storage, int64_t layers);
  DType storage() const { return storage_; }
  // c (storage dtype) = x (act dtype), scaled for f8_e4m3; the scale is kept for widen().
  void narrow(Ops& ops, int64_t layer, int slot, Tensor c, Tensor x);
  // x (act dtype) = the value c holds, as the last narrow() of (layer, slot) stored it.
  void widen(Ops& ops, int64_t layer, int slot, Tensor x, Tensor c);
  // Both: x rounded in place to what its stored copy c holds.
  void narrow_in_place(Ops& ops, int64_t layer, int slot, Tensor c, Tensor x) {
    narrow(ops, layer, slot, c, x);
    widen(ops, layer, slot, x, c);
  }
  const std::array<ActCounts, kActKinds>& counts() const { return counts_; }
  void reset();  // history and counts cleared (after a dry run)
  // f8_e4m3: the amax history (JSON, exact) for checkpoints, so a resumed run scales as the uninterrupted
  // one would have; null otherwise.
  json::Value amax_state() const;
  void restore_amax(const json::Value& state);

 private:
  DType storage_;
  std::vector<std::vector<float>> hist_;  // per (layer, slot): the last kAmaxHistory amax values
  std::vector<double> scale_;             // per (layer, slot): the scale of the last narrow()
  std::array<ActCounts, kActKinds> counts_{};
};

}  // namespace oomless
