// The optimizer interface: one update of a TrainableSet per step, its state as named tensors for
// checkpoints, and the settings a resumed run must keep. AdamW (optim/adamw.h) and AdamW8bit (optim/adamw8bit.h) implement it.
#pragma once
#include <cstdint>
#include <memory>
#include <string_view>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "memory/arena.h"
#include "model/trainable.h"

namespace oomless {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual const char* name() const = 0;
  // One update of every trainable tensor from its gradient at rate lr; step counts from 1. `params` must
  // be the set the optimizer was built for (same names, shapes, order).
  void step(Ops& ops, const TrainableSet& params, double lr, int64_t step);
  // The same update for the tensors params[i], i in `which` (ascending, each at most once), for a step
  // taken in parts, such as one layer as soon as its gradient is final (--step-in-backward): the parts
  // of one step, together covering every tensor once, give step()'s result bit for bit.
  virtual void step_tensors(Ops& ops, const TrainableSet& params, const std::vector<size_t>& which, double lr,
                            int64_t step) = 0;
  // The state in memory, named for checkpoints (e.g. "m.NAME", "v.NAME"), in a fixed order.
  virtual std::vector<NamedTensor> state() = 0;
  // The state as a checkpoint writes it (an entry may stream its bytes from disk: StWrite::read), and read
  // back from a checkpoint's optimizer file, which must hold exactly these tensors with their dtypes and
  // shapes (else an error naming the first that differs, before anything is changed). The defaults go
  // through state(); an optimizer whose state is not in memory overrides both.
  virtual std::vector<StWrite> state_entries(Ops& ops);
  virtual void load_state(Ops& ops, const SafetensorsFile& f);
  // The settings that define the run (fixed on resume), as JSON.
  virtual json::Value settings_json() const = 0;

 protected:
  // Checks a step's arguments against the `built` tensors the optimizer was made for.
  void check_step(const TrainableSet& params, const std::vector<size_t>& which, size_t built, double lr,
                  int64_t step) const;
};

// Checks that a checkpoint's optimizer file holds exactly `want` (names, dtypes, sizes); throws naming the
// first difference and what to do.
void check_state_file(const SafetensorsFile& f, const std::vector<StWrite>& want, const char* optimizer);
// While one lives, check_state_file accepts a file holding more tensors than `want` (every one of `want` still
// checked): an optimizer over a share of the tensors (ZeRO) reading its part of a whole run's state.
class StateFileSubset {
 public:
  StateFileSubset();
  ~StateFileSubset();
  StateFileSubset(const StateFileSubset&) = delete;
  StateFileSubset& operator=(const StateFileSubset&) = delete;
};

struct AdamWSettings;
struct GaLoreSettings;

// The optimizers --optim names: "adamw", "adamw8bit", "galore", "galore8bit". parse_optimizer throws for
// any other name, listing them; make_optimizer builds one over `params` with its state in `arena`.
void parse_optimizer(std::string_view name);
// The one float dtype of every parameter and gradient of `params` (same shapes pairwise); throws otherwise
// or when the set is empty.
DType trainable_dtype(const TrainableSet& params);
std::unique_ptr<Optimizer> make_optimizer(std::string_view name, const TrainableSet& params, Arena& arena,
                                          const AdamWSettings& settings, const GaLoreSettings& galore);

}  // namespace oomless
