// AdamW8bit: bitsandbytes' blockwise 8-bit AdamW (bnb.optim.AdamW8bit, as its CUDA kernel updates) over a
// TrainableSet. A tensor of at least kMin8bitElements elements keeps m and v as one byte each, m in the
// signed dynamic map and v in the unsigned one, with a scale (absmax) per 256 consecutive elements: 2 bytes
// a parameter plus 8 bytes a block, against fp32 AdamW's 8 (Ops::adamw8bit_step has the arithmetic). A
// smaller tensor (norm weights, biases, small adapters) keeps fp32 m and v, as bitsandbytes does, updated
// with the same semantics (decay after the Adam step). A non-finite gradient element zeroes that element's
// state and leaves its parameter as it is. Decay applies only where Trainable::decay is set.
//
// Checkpoint names: "m.NAME" / "v.NAME" (u8 codes, or f32 for a small tensor), "m_absmax.NAME" /
// "v_absmax.NAME" (one scale per block). Everything is allocated in the constructor (Category::optimizer).
#pragma once
#include <cstdint>

#include "memory/arena.h"
#include "model/params.h"
#include "optim/adamw.h"

namespace oomless {

class AdamW8bit final : public Optimizer {
 public:
  static constexpr int64_t kMin8bitElements = 4096;  // bitsandbytes' min_8bit_size

  AdamW8bit(const TrainableSet& params, Arena& arena, const AdamWSettings& settings);

  const char* name() const override { return "adamw8bit"; }
  void step_tensors(Ops& ops, const TrainableSet& params, const std::vector<size_t>& which, double lr,
                    int64_t step) override;
  std::vector<NamedTensor> state() override;
  json::Value settings_json() const override;

  // Whether params[i] keeps 8-bit state.
  bool quantized(size_t i) const { return slot_[i].quantized; }

 private:
  struct Slot {
    bool quantized = false;
    size_t index = 0;  // into codes_/scales_ (two tensors each: m, v) or small_ (m, v)
  };
  AdamWSettings settings_;
  std::vector<std::string> names_;
  std::vector<Slot> slot_;
  ParamSet codes_, scales_, small_;
};

}  // namespace oomless
