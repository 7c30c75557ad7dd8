// GaLore (galore_torch's GaLoreAdamW, and GaLoreAdamW8bit with eight_bit): the gradient G (m, n) of each
// projection matrix of the layers is projected onto r singular vectors of a recent gradient, Adam runs in
// that r-dimensional space, and the update is projected back:
//   every `gap` steps (steps 1, gap + 1, 2 gap + 1, ...; staggered: the tensors of layer l refresh at the
//   steps s > 1 with (s - 1) mod gap == l mod gap, spreading the SVDs over the steps) P = the top-r right
//   singular vectors (r, n) when m >= n, else the left ones (m, r) (Ops::svd_basis; signs canonical);
//   R = G P^T (m, r) or P^T G (r, n); Adam moments of R's shape (never reset when P changes);
//   galore:     p -= lr sqrt(1 - b2^t) / (1 - b1^t) * scale * back(m / (sqrt(v) + eps))
//   galore8bit: the moments in bitsandbytes' 8-bit blocks (Ops::adamw8bit_step; under 4096 elements fp32)
//               and p += scale * back(bitsandbytes' update)
//   then p *= 1 - lr wd where the tensor decays.
// back(X) = X P or P X. Every other trainable tensor (embeddings, head, norms, biases) gets galore_torch's
// AdamW (transformers' form), or bitsandbytes' AdamW8bit with eight_bit. The gradient buffer of a projected
// tensor is overwritten by its back-projected update during step().
//
// State names: "P.NAME" (the projector), "m.NAME" / "v.NAME" of R's shape (u8 codes with
// "m_absmax.NAME" / "v_absmax.NAME" for 8-bit ones), then the other tensors' optimizer state.
#pragma once
#include <cstdint>
#include <memory>

#include "memory/arena.h"
#include "model/params.h"
#include "optim/adamw.h"

namespace oomless {

struct GaLoreSettings {
  int64_t rank = 0;       // r
  int64_t gap = 200;      // update_proj_gap
  double scale = 1.0;     // the projected step is multiplied by it (GaLoreProjector's default)
  bool eight_bit = false;  // galore8bit
  bool staggered = false;  // refresh one layer's projectors per step instead of all at once
};

class GaLore final : public Optimizer {
 public:
  // Projects the 2-D tensors named model.layers.*; throws naming a tensor whose smaller side is below r.
  GaLore(const TrainableSet& params, Arena& arena, const AdamWSettings& adam, const GaLoreSettings& galore);
  ~GaLore() override;

  const char* name() const override { return galore_.eight_bit ? "galore8bit" : "galore"; }
  void step_tensors(Ops& ops, const TrainableSet& params, const std::vector<size_t>& which, double lr,
                    int64_t step) override;
  std::vector<NamedTensor> state() override;
  json::Value settings_json() const override;

  // Whether params[i] is projected, and the SVDs the last step computed (all its parts).
  bool projected(size_t i) const { return slot_[i] >= 0; }
  int64_t refreshed_last_step() const { return refreshed_; }

 private:
  struct Proj;
  AdamWSettings adam_;
  GaLoreSettings galore_;
  std::vector<int64_t> slot_;  // index into proj_, or -1
  std::vector<Proj> proj_;
  std::vector<size_t> rest_index_;  // params indices the other optimizer steps
  std::vector<size_t> rest_pos_;    // per params index: its position among those, or SIZE_MAX
  std::unique_ptr<Optimizer> rest_;
  ParamSet projectors_, moments_, codes_, scales_;
  Buffer scratch_;
  int64_t refreshed_ = 0;
  int64_t refreshed_step_ = 0;  // the step refreshed_ counts for
};

// true for the tensors GaLore projects: 2-D, under model.layers.
bool galore_projects(const Trainable& t);

}  // namespace oomless
