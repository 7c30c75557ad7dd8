// The planner (`oomless plan`, `train --plan`, `train --budget` with no memory flags): the fastest schedule of a
// training run that fits a memory budget, chosen by a mixed-integer program over what the engine can do without
// changing the numbers it computes:
//   per layer: SavePolicy all | selective | none (what it keeps; the rest is recomputed before its backward);
//   activations: kept in memory, or offloaded to disk between forward and backward (--act-offload disk);
//   chunk-recurrent training (--chunk C) with its K/V history in memory or on disk (--kv-offload);
//   the optimizer state in memory or on disk (--optim-state disk).
// On a CPU run Device and Host are the same RAM under --budget, so Host placements free nothing and are left
// out. The micro-batch does not change memory (sequences run one at a time) and is left as given.
//
// Memory: the closed-form estimate (train/estimate.h) of each global choice with every layer at `none`, plus a
// layer's bytes per policy (layers are alike), or with activations on disk the ring of two layers' sets (2 x
// the largest). Time: the cost model (plan/cost.h) measured on this machine: per-sequence block forward +
// backward, a layer's recompute per policy, the embedding and head, the optimizer, disk bandwidth for what
// moves (overlapped with compute: a step takes the larger of its compute and its transfers).
// The program: binaries x[l][p] (one policy per layer) and y[g] (one global choice), continuous step time t
// and ring size r[g]; per g, with big-M on y[g]: memory <= budget, t >= compute, t >= transfers; minimise t.
#pragma once
#include <array>
#include <optional>
#include <string>
#include <vector>

#include "io/json.h"
#include "model/model.h"
#include "plan/cost.h"
#include "train/estimate.h"
#include "train/trainer.h"

namespace oomless {

// The settings a plan chooses beside the per-layer policies.
struct PlanGlobal {
  int64_t chunk = 0;                 // 0: whole sequences
  std::string act_offload = "none";  // none, or per layer (the layers that send their sets to disk)
  std::string kv_offload = "none";   // with chunk: none | disk
  std::string optim_state = "host";  // host | disk
  std::string flags() const;         // as typed: "--chunk 1024 --kv-offload disk", "" for the defaults
};

// The program's data: for each global choice, its memory and time without any layer's saved activations,
// and a layer's bytes and recompute seconds per SavePolicy (all, selective, none). Each layer also chooses
// where its saved set waits when the choice allows it (whole sequences): memory, or disk through the ring.
struct PlanInstance {
  int64_t L = 0;
  double budget = 0;  // bytes, Device + Host
  struct Option {
    PlanGlobal g;
    double base_bytes = 0;                 // the estimate with every layer at none
    bool disk_allowed = false;             // layers may send their saved sets to disk (--act-offload per layer)
    double base_seconds = 0;               // compute of a step with every layer at all
    double io_seconds = 0;                 // transfers that do not depend on the layers (K/V pages on disk)
    std::array<double, 3> act_bytes{};     // a layer's saved activations per policy, kept in memory
    std::array<double, 3> set_bytes{};     // the same as one set of the ring (64-byte aligned tensors)
    std::array<double, 3> rec_seconds{};   // a layer's recompute per policy and step
    double disk_seconds_per_byte = 0;      // a byte of a set on disk goes out and comes back
    std::array<double, 3> disk_seconds{};  // what a layer's set on disk adds to a step's compute, per policy
  };
  std::vector<Option> options;

  // The model's memory and step time of option o with these policies and places (L of each; on_disk is
  // ignored where the option does not allow it). Memory holds the sets kept in memory, and for those on disk
  // a ring of two sets of the largest; a step takes the larger of its compute (with what each set on disk
  // measurably adds to it) and its transfers.
  double bytes(size_t o, const std::vector<SavePolicy>& p, const std::vector<bool>& on_disk) const;
  double seconds(size_t o, const std::vector<SavePolicy>& p, const std::vector<bool>& on_disk) const;
};

struct PlanPick {
  bool feasible = false;
  size_t option = 0;
  std::vector<SavePolicy> policies;
  std::vector<bool> on_disk;
  double seconds = 0, bytes = 0;
  std::string solver;  // GLPK's status, or "enumeration"
};

// The optimum by GLPK (plan/milp.h); layers are alike, so the choices come back as counts laid out from layer 0:
// the sets sent to disk first (their fetch has the whole backward above them to hide in), then the layers
// kept at none, then selective, then all.
PlanPick solve_plan(const PlanInstance& in);
// Every choice of every layer and option, for tests on small instances: the cost model's true optimum.
PlanPick enumerate_plan(const PlanInstance& in);

// The instance for a run of `c` under `budget` bytes, from the estimate and the measured costs: whole sequences
// (unless c asks for chunks) and each of `chunks`. With an empty cost model, the memory side only.
PlanInstance build_instance(const TrainConfig& c, const ModelSource& src, size_t budget, const CostModel& cost,
                            const std::vector<int64_t>& chunks);

struct Plan {
  TrainConfig config;       // c with the plan's settings applied
  PlanPick pick;
  PlanGlobal global;
  MemoryEstimate estimate;  // of `config`
  std::string explain;      // why each choice, in words
  json::Value cost;         // the measured cost model (CostModel::json), null when nothing was measured
  // Where its times were measured ("machine" in the file): the CPU as `oomless probe` names it and the threads.
  std::string machine_cpu = machine_cpu_name();
  int machine_threads = oomless::machine_threads();
  json::Value json(const TrainConfig& asked, const ModelConfig& cfg, size_t budget) const;
};

// Plans c under budget: measures the costs (spill files in c.spill_dir or `scratch`), solves, and checks the
// chosen run with the estimate. When nothing fits: an error naming the smallest budget that does and its plan.
Plan make_plan(const TrainConfig& c, size_t budget, const std::string& scratch, std::FILE* log = nullptr);

// A plan file's settings onto c (train --plan): the model's shape and --seq must match the plan's, and the
// settings it chooses must not also be given as flags (named); with --budget given beside it, the plan's predicted
// peak must fit it. Errors name the file and what is wrong. Returns a warning ("" if none) when the plan was made
// on another CPU or thread count: its memory holds, its times and so its choices may not.
std::string apply_plan(TrainConfig& c, const json::Value& plan, const std::string& source, const ModelConfig& cfg);

// The flags a plan sets (save-policy, act-offload, chunk, page, kv-offload, optim-state): train --budget plans
// only when none of them is given, and train --plan refuses them beside the plan.
const std::vector<std::string>& planned_flags();

// `oomless plan`: prints the plan (and --explain's reasons), writes --out; 0, or an error when nothing fits.
int run_plan(const TrainConfig& c, const std::string& out, bool explain);

}  // namespace oomless
