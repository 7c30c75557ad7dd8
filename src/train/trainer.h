// The trainer: full training of every parameter (fp32 master weights) or adapters on a frozen base, with
// AdamW, gradient accumulation, global-norm clipping, warmup + schedule, whole-sequence or chunk-recurrent
// steps, crash-safe checkpoints that resume bit-exactly, and metrics.
//
// Loss normalisation: every sequence of an optimizer step contributes sum(CE over its supervised targets)
// / N, N = the supervised targets of the whole step (all micro-batches), counted before any backward, so
// B = 2 x accumulation 1 and B = 1 x accumulation 2 give the same gradients.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/json.h"
#include "model/engine.h"
#include "model/eval.h"
#include "kv/paged_kv.h"
#include "optim/optimizer.h"

namespace oomless {

struct TrainConfig {
  std::string model = "preset:tiny";
  std::string backend = "cpu";  // cpu, or cuda (refused until its kernels exist)
  std::string data;            // empty: the bundled corpus (data/kjv/train.txt, embedded)
  std::string out;              // empty: runs/run-YYYYmmdd-HHMMSS (a new folder per run)
  int64_t seq = 256;
  int64_t batch = 8;
  int64_t grad_accum = 1;
  int64_t steps = 0;           // total optimizer steps of the run (0: from epochs)
  double epochs = 0;           // used when steps is 0; 0 and 0: 1 epoch
  // Defaults by situation (resolve_defaults; 0 or negative here means "the default"): a pretrained model
  // (Hugging Face folder, GGUF) fine-tunes with lr 2e-5 (2e-4 with --lora), no weight decay and a warmup
  // of 3% of the run; a random init (preset, config.json alone) trains with lr 1e-3, weight decay 0.1
  // and 20 warmup steps. min_lr is 0.1 lr either way.
  double lr = 0;
  double min_lr = -1;
  int64_t warmup = -1;
  std::string schedule = "cosine";
  double weight_decay = -1;
  std::string optim = "adamw";  // adamw | adamw8bit | galore | galore8bit
  int64_t galore_rank = 0;      // 0: width / 4
  int64_t galore_gap = 200;     // steps between projector refreshes
  double galore_scale = -1;     // < 0: 1 (galore_torch's projector default), or the saved run's on resume
  std::string galore_refresh = "all";  // all | staggered
  std::string optim_state = "host";    // device | host | disk: where the optimizer state lives
  int64_t zero = 0;                    // ZeRO stage over the ranks: 0 (replicated) or 1 (optimizer state sharded)
  int64_t context_parallel = 1;        // ranks each sequence is spread over (its slices; RingKv); 1: none
  std::string cp_split = "contiguous";  // context parallel: consecutive slices, or zigzag (two pieces a rank)
  std::string zero_prefetch = "yes";   // --zero 3: the next layer sent while one computes (two layers' storage)
  std::string grad_sum_dtype = "fp32";  // fp32 | bf16: what the ranks' gradients travel in to be summed
  std::string kv_dtype = "fp32";       // fp32 | bf16 | fp8: the chunk-recurrent K/V history's storage
  std::string act_dtype = "fp32";      // fp32 | bf16 | fp8: storage of the activations kept for backward
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip = 1.0;
  std::string clip_norm = "current";  // current | previous: the norm --clip scales by
  bool step_in_backward = false;      // each layer stepped as its gradient is final
  std::string eval_data;       // empty: the bundled eval text when training on the bundled corpus
  int64_t eval_every = 100;    // 0: only at the end
  int64_t save_every = 200;    // 0: only at the end
  int64_t keep = 2;
  bool resume = false;
  std::string resume_dir;      // empty: --out
  std::string budget;          // empty: no limit
  std::string dtype = "fp32";
  int64_t seed = 0;
  int64_t threads = 0;         // 0: all
  int64_t max_nonfinite = 5;
  std::string dump_tokens;
  std::string save_policy = "all";
  int64_t chunk = 0;            // chunk-recurrent training with chunks of this many tokens (0: off)
  int64_t page = 0;             // page length of the K/V store (0: min(64, chunk)); divides chunk
  std::string kv_offload = "none";  // none, host or disk: where past chunks' K/V pages live
  std::string act_offload = "none";  // none, host or disk: where saved activations wait for their backward
  std::string spill_dir;        // disk: the spill file's folder (empty: --out)
  double rope_theta = 0;        // > 0: overrides the model's RoPE base
  std::string rope_scaling;     // non-empty: overrides the model's RoPE scaling (apply_rope_scaling)
  int64_t sparse_pages = 0;     // page-sparse attention: each query page reads its k best earlier pages (0: dense)
  int64_t sink_pages = 1;       // with sparse_pages: the first pages every query page reads
  std::string page_summary = "minmax";  // with sparse_pages: minmax or mean
  int64_t lora = 0;             // LoRA rank on the projections, base frozen (0: train every parameter)
  double lora_alpha = 0;        // 0: 2 * rank
  double lora_dropout = 0;
  std::string lora_targets = "all-linear";
  bool rslora = false;
  bool dora = false;
  std::string modules_to_save;  // with lora: embed_tokens,lm_head trained in full
  std::string base_dtype = "fp32";  // with lora: fp32, nf4 or nf4-dq storage of the frozen projections
  std::string embed_dtype = "auto";  // with lora: auto, fp32, bf16 or nf4 storage of the frozen embedding and head
  bool qlora = false;           // --base-dtype nf4-dq (QLoRA: NF4 with double-quantised scales)
  std::string adapter;          // an adapter folder (oomless's or PEFT's) to continue
  std::string truncation = "split";  // conversations longer than --seq: split, drop or error
  std::string save_dtype = "fp32";   // model (or adapter) weights in checkpoints: fp32 or bf16
  std::string save_optimizer = "yes";  // no: weights-only checkpoints (a run cannot resume from them)

  // Keys are the long flag names without "--" (e.g. "grad-accum"); unknown keys are an error.
  void apply_json(const json::Value& o, const std::string& source);
  json::Value to_json() const;
};

// Checks the settings that need no model or data (ranges, flags that do nothing in the given mode),
// each error naming the flag.
void validate_config(const TrainConfig& c);
// --zero-prefetch: the layers --zero 3 sends ahead of the one computing (no: 0, yes: 1, or 1 to 3); an error
// naming any other value.
int64_t prefetch_depth(const std::string& v);

// The engine a run of `c` builds (model, base storage, adapters, compute and activation settings); errors
// name the flags that do not go together.
EngineOptions engine_options(const TrainConfig& c);
// 1234567 -> "1.23M" (parameter counts in messages).
std::string format_count(int64_t n);
// The largest divisor of C up to 64 (the default K/V page), or 0 when it would be below 8.
int64_t default_page(int64_t C);
// --sparse-pages beside --context-parallel: the ring's page-sparse selection (pages 0 otherwise).
struct RingOptions;
RingOptions ring_options(const TrainConfig& c);

// Fills the settings left at their "default" values for a pretrained model or a random init (above).
void resolve_defaults(TrainConfig& c, bool pretrained);
// Warmup once the run's length is known: an unset warmup becomes 3% of total (pretrained) or
// min(20, total) (random init).
void resolve_warmup(TrainConfig& c, bool pretrained, int64_t total);

// The configuration saved with the newest complete checkpoint of a run folder (trainer_state.json's
// "config"), for `--resume` alone; an error naming the folder when there is none.
json::Value saved_run_config(const std::string& run_dir);

// The option table: every setting of TrainConfig once, with its flag/JSON key, kind, whether a resumed
// run must keep it, and its --help line. apply_json, to_json, the resume check, the CLI's flags and its
// help are all generated from it.
struct TrainOption {
  enum class Kind { text, integer, number, boolean };
  const char* name;   // the long flag without "--", and the JSON key
  Kind kind;
  bool fixed_on_resume;
  const char* arg;    // the value's name in --help ("" for a switch)
  const char* help;   // the help text; '\n' starts a continuation line
  std::string TrainConfig::*text = nullptr;
  int64_t TrainConfig::*integer = nullptr;
  double TrainConfig::*number = nullptr;
  bool TrainConfig::*boolean = nullptr;
};
const std::vector<TrainOption>& train_options();
// The options block of `oomless train --help`, one line (or more) per option in table order.
std::string train_options_help();

// One optimizer step's sequences: T token ids each and their next-token targets (< 0: not supervised).
struct StepBatch {
  std::vector<std::vector<int32_t>> ids, targets;
};
// n sequences of T ids from a fixed pattern below V, each target the next id (the last unsupervised): steps for
// runs that measure time or memory and need no data.
StepBatch synthetic_batch(int64_t n, int64_t T, int64_t V);

struct StepResult {
  int64_t step = 0;        // the step just taken (counting from 1)
  double loss = 0;         // mean cross-entropy over the step's supervised targets (0 with none)
  double lr = 0;
  double grad_norm = 0;    // before clipping
  bool skipped = false;    // non-finite loss or gradients: no update
  int64_t targets = 0;     // supervised targets of the step
  double seconds = 0;
  double tokens_per_s = 0;
  // --kv-dtype fp8: this step's counts of the keys' and values' storage (values stored, saturated,
  // flushed to zero, chunks with a non-finite amax); null otherwise.
  json::Value kv_fp8;
  // --act-dtype fp8: this step's counts per kind of saved activation (values, saturated, flushed, stashes
  // with a non-finite amax), and their totals; null otherwise.
  json::Value act_fp8;
  // Several ranks (data parallel): {"size": N, "peak": [each rank's ledger peak, Device + Host],
  // "bytes_sent": [each rank's bytes sent through the collectives so far], "optimizer": [each rank's optimizer
  // state bytes, every tier]}; null otherwise.
  json::Value ranks;
};

// A training run (setup, step, evaluate, save, resume), shared by `oomless train`, the tests and the
// benches. Setup builds the engine (model/engine.h), the optimizer over the model's TrainableSet, the
// K/V store of chunk-recurrent training, and takes one dry forward + backward on zeros so that every
// workspace is taken from the budget before step 1 (a run that does not fit fails here, naming what to
// change); then the data (when --data is given) and the schedule. With cfg.resume, the newest checkpoint
// of `out` that verifies is loaded: weights or adapter, optimizer state, data position and step, and the
// settings fixed on resume are checked against the saved run.
class Trainer {
 public:
  // log: where setup reports the run (model, parameters, data, memory) and progress; null: quiet.
  Trainer(const TrainConfig& cfg, const std::string& out, std::FILE* log = nullptr);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The next step's sequences from the data (needs --data).
  StepBatch next_batch();
  // One optimizer step on `b` (batch x grad_accum sequences of --seq tokens; the loss of each is
  // normalised by the step's supervised targets); lr: the schedule's value at this step unless given.
  StepResult step(const StepBatch& b, std::optional<double> lr = std::nullopt);
  StepResult step() { return step(next_batch()); }
  // Held-out loss on the first (at most 32) windows of --eval-data; nullopt without eval data.
  std::optional<EvalResult> evaluate();
  // Writes OUT/checkpoint-STEP (keeping the newest --keep); returns its path.
  std::string save();
  // On ranks other than 0 at the moment rank 0 calls save(): with --zero 1, sends this rank's part of the
  // optimizer state as rank 0 writes it (nothing otherwise).
  void serve_save();

  const TrainConfig& config() const;
  const std::string& out() const;
  int64_t steps_done() const;
  int64_t total_steps() const;
  int64_t nonfinite_in_a_row() const;  // steps skipped in a row, up to the last one
  int64_t nonfinite_total() const;     // steps skipped in the whole run
  double epochs_trained() const;       // passes over the data so far (NaN when the data was not counted)
  Engine& engine();
  Optimizer* optimizer();
  PagedKvStore* kv();  // null unless chunk-recurrent
  int64_t chunk() const;  // chunk length of chunk-recurrent training (0: off)
  // Trainable and frozen parameters (count, bytes as held).
  int64_t trainable_params() const;
  int64_t trainable_bytes() const;
  int64_t frozen_params() const;
  int64_t frozen_bytes() const;

  struct State;  // defined in trainer.cpp

 private:
  std::unique_ptr<State> s_;
};

// Runs (or resumes) training; returns the process exit code. Progress goes to stderr, results to stdout.
// plan: a planned run's plan for the report (write_report's summary "plan"), or null.
int run_training(const TrainConfig& cfg, const json::Value& plan = {});

}  // namespace oomless
