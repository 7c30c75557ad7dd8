// What a training run will hold, before it runs: bytes per tier and category, in closed form from the
// model's config and the run's settings (no tensor is allocated, no weight read).
//
// Each term is the size of one thing the run reserves, from the same shapes the code allocates:
//   weights     the base as held: P * 4 bytes in f32; a quantised base as its blocks (NF4: 0.5 B/param plus
//               scales; a GGUF's own types), tables in bf16 / NF4 when asked;
//   adapter     LoRA A (r, K) and B (N, r) per target and layer (+ DoRA's magnitudes and norms), f32;
//   grads       as the trained tensors (one layer's with --step-in-backward);
//   optimizer   AdamW m, v: 8 B/param; AdamW8bit: 2 B/param + a scale per 256; GaLore: Adam in the rank-r
//               projection of each layer matrix + its projector; on Host by default, Disk (+ a window of
//               three pieces on Device) with --optim-state disk;
//   activations the residual stream (L + 1) T E, what each layer's SavePolicy keeps (per layer, in the
//               --act-dtype storage), the final norm; a chunk's worth with --chunk; off Device but for a ring
//               of two layers with --act-offload;
//   kv, kv_grad chunk-recurrent training's history: L * pages * 2 Hkv P D * bytes for keys and values (and
//               their f32 gradients), in the --kv-offload tier, windows on Device;
//   workspace   the model's per-pass buffers (backward gradients of one layer, bf16 operand copies), the
//               kernels' scratch asked of the backend (Ops::*_workspace: GEMM packing kept between calls, the
//               largest attention or cross-entropy call), GaLore's SVD.
// The ledger counts the same things (memory/arena.h); tests/estimate_test.cpp holds the two together over
// a sweep of configurations.
#pragma once
#include <array>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "io/json.h"
#include "memory/arena.h"
#include "model/load.h"
#include "train/trainer.h"

namespace oomless {

struct MemoryEstimate {
  // Peak bytes of each (tier, category) over the run (setup included).
  std::array<std::array<size_t, kCategoryCount>, kTierCount> bytes{};
  // Peak of each tier's sum (at most the sum of its categories' peaks: a load-time buffer freed before
  // the run starts does not meet the run's own).
  std::array<size_t, kTierCount> tier_peak{};
  // Activations per layer and SavePolicy (all, selective, none) as this run would store them: what a
  // planner weighs per layer.
  std::vector<std::array<size_t, 3>> layer_activations;

  size_t at(Tier t, Category c) const { return bytes[static_cast<int>(t)][static_cast<int>(c)]; }
  size_t category(Category c) const;  // over all tiers
  size_t peak(Tier t) const { return tier_peak[static_cast<int>(t)]; }
  // What --budget limits on a CPU run: the Device and Host arenas together.
  size_t ram_peak() const { return peak(Tier::Device) + peak(Tier::Host); }
  size_t static_bytes() const;   // weights, grads, optimizer, adapter, all tiers
  size_t dynamic_bytes() const;  // activations, kv, kv_grad, workspace, all tiers

  // {"device": {"weights": n, ..., "peak": n}, "host": {...}, "disk": {...}, "static": n, "dynamic": n,
  //  "ram_peak": n}
  json::Value json() const;
  // One row per category held, a column per tier.
  std::string table() const;
  // "weights 48.02 MiB, grads 48.02 MiB, ..." over all tiers, the categories held (as train prints the ledger).
  std::string line() const;
};

// The estimate for `c` on the model `src` (opened, its weights not read) computed by `ops`'s kernels with
// OpenMP's current thread count (their scratch scales with it). Errors name the flag, as setup would.
// The ranks a run has (data parallel, mpirun): what rank `rank` of `size` holds. Default: this process's.
struct EstimateRanks {
  int size = 1, rank = 0;
};
EstimateRanks this_process_ranks();
MemoryEstimate estimate_training(const TrainConfig& c, const ModelSource& src, const Ops& ops,
                                 EstimateRanks ranks = this_process_ranks());

// The same from the configuration alone: opens c.model (headers only) and asks the CPU backend.
MemoryEstimate estimate_training(const TrainConfig& c);

// `oomless estimate`: prints the estimate (a table, or one JSON object) and, when it does not fit --budget,
// the memory options that make it fit, cheapest in time first. Returns 0 when it fits (or no budget is
// given), 3 when it does not.
int run_estimate(const TrainConfig& c, bool as_json, int ranks = 1);

}  // namespace oomless
