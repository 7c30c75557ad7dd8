// The planner's cost model, measured on this machine for one model shape: the real kernels run short training
// steps of a copy of the model cut to one and four layers (random weights: the time does not depend on them; the
// layers' costs timed with a narrow vocabulary, the embedding's and head's with the model's own), so
// the figures include everything a step does at this width (chunks over the whole sequence, so that their
// attention reads the history it will), and disk bandwidth through a spill file in the folder the run would
// use. Each cost is the median, over several rounds after the setup's dry run, of the difference between two
// configurations' steps taken in turns (side by side where the budget allows both), so that the machine's drift
// cancels.
#pragma once
#include <cstdint>
#include <map>
#include <string>

#include "model/load.h"
#include "train/trainer.h"

namespace oomless {

struct CostModel {
  // Seconds per sequence of T tokens (T = --seq), or with chunks of T tokens per chunk (measured over a whole
  // --seq, so each chunk's attention reads the history it will).
  struct AtT {
    double block = 0;       // one layer's forward + backward, SavePolicy all
    double head = 0;        // the embedding, final norm and head + loss, forward + backward
    double rec_none = 0;    // a layer at none: what recomputing it adds
    double rec_sel = 0;     // a layer at selective
    double kv_disk = 0;     // chunks: what a layer's K/V history on disk adds
    double act_disk = 0;    // whole sequences: what a layer's saved set (at all) sent to disk and back adds
  };
  std::map<int64_t, AtT> at;         // by T
  double optim_per_param = 0;        // the optimizer step, seconds per trained parameter
  double optim_disk_per_param = 0;   // what its state on disk adds (--optim-state disk), per trained parameter
  double disk_write_bps = 0, disk_read_bps = 0;  // bytes/s through a spill file
  std::string cpu;                   // what it was measured on
  int threads = 0;
  int64_t cut_layers = 0;            // the larger cut's layers (measure_costs)

  json::Value json() const;
};

// This machine as the cost model and plan files name it: the CPU as `oomless probe` names it, "model (isa)", and
// OpenMP's thread count.
const std::string& machine_cpu_name();
int machine_threads();

// The parameters a run of c on cfg trains: every one, or the adapters' (modules_to_save aside).
int64_t trained_params(const TrainConfig& c, const ModelConfig& cfg);

// The layers of the larger cut model for a run like c (4, or fewer down to 2 while its run keeping everything at
// --seq would not fit `budget`; 0: no limit), its config.json written in scratch.
int64_t cut_layers(const TrainConfig& c, const ModelConfig& cfg, const std::string& scratch, size_t budget);

// Measures the costs of c's model at T = c.seq (when whole sequences are a choice) and at each chunk length.
// scratch: a folder for the spill file and the cut models' config.json; the larger cut has cut_layers(...).
CostModel measure_costs(const TrainConfig& c, const ModelSource& src, const std::vector<int64_t>& chunks,
                        const std::string& scratch, std::FILE* log, size_t budget = 0);

}  // namespace oomless
