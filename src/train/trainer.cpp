#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <map>

#include <omp.h>

#include "core/cpu_info.h"
#include "data/chat.h"
#include "data/dataset.h"
#include "data/text.h"
#include "dist/comm.h"
#include "dist/ring_kv.h"
#include "io/safetensors.h"
#include "memory/arena.h"
#include "model/eval.h"
#include "model/generate.h"
#include "model/adapter_io.h"
#include "model/load.h"
#include "model/model.h"
#include "model/quant_base.h"
#include "kv/paged_kv.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/disk_state.h"
#include "optim/host_placed.h"
#include "optim/galore.h"
#include "optim/schedule.h"
#include "train/checkpoint.h"
#include "train/estimate.h"
#include "train/metrics.h"
#include "train/report.h"

namespace oomless {

namespace fs = std::filesystem;

namespace {

// The first SIGINT/SIGTERM stops the run after the current step (which saves a checkpoint); a second one
// stops at once, without writing a partial checkpoint (saves are atomic: the last complete one stays).
volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) {
  if (g_stop) {
    const char m[] = "\noomless train: second interrupt: stopping now, without saving (the last complete checkpoint "
                     "stays)\n";
    (void)!write(2, m, sizeof m - 1);
    _exit(130);
  }
  g_stop = 1;
  const char m[] = "\noomless train: interrupt: stopping after this step and saving a checkpoint (interrupt again to "
                   "stop at once)\n";
  (void)!write(2, m, sizeof m - 1);
}


std::string binary_id() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "unknown";
  const auto size = fs::file_size(exe, ec);
  const auto time = fs::last_write_time(exe, ec).time_since_epoch().count();
  return exe.filename().string() + ":" + std::to_string(size) + ":" + std::to_string(time);
}

// A checkpoint file of named tensors (safetensors, names as given, in their dtypes; as_bf16: f32 tensors
// rounded to bf16, converted when the file is written), read through ops as the file is written.
CheckpointFile tensors_file(Ops& ops, const std::string& name, const std::vector<NamedTensor>& ts, bool as_bf16 = false) {
  std::vector<NamedTensor> keep = ts;
  return {name, "", [&ops, keep = std::move(keep), name, as_bf16](int fd) {
            std::vector<StWrite> w;
            for (const NamedTensor& t : keep) w.push_back(tensor_entry(ops, t.name, t.t, as_bf16));
            write_safetensors_stream(w, {{"format", "pt"}}, [fd](const void* d, size_t n) { checkpoint_write(fd, d, n); },
                                     name);
          }};
}

// The optimizer's state file: its entries as the optimizer gives them (some may stream from disk).
// Names, dtypes and shapes of a list of entries (a rank's part of a sharded optimizer state, for rank 0).
std::string entries_json(const std::vector<StWrite>& entries) {
  json::Value list = json::Value::array();
  for (const StWrite& e : entries) {
    json::Value o = json::Value::object(), shape = json::Value::array();
    for (int64_t d : e.shape) shape.push_back(json::Value::integer(d));
    o.set("name", json::Value::string(e.name));
    o.set("dtype", json::Value::integer(static_cast<int64_t>(e.dtype)));
    o.set("shape", shape);
    list.push_back(o);
  }
  return json::dump(list);
}

CheckpointFile state_file(const std::string& name, std::vector<StWrite> entries) {
  return {name, "", [entries = std::move(entries), name](int fd) {
            write_safetensors_stream(entries, {{"format", "pt"}}, [fd](const void* d, size_t n) { checkpoint_write(fd, d, n); },
                                     name);
          }};
}

// Reads every named tensor back in place; each must be in the file with the same dtype and size, or as
// bf16 for an f32 tensor (--save-dtype bf16: widened; returns true when any was).
bool read_tensors(Ops& ops, const SafetensorsFile& f, const std::vector<NamedTensor>& ts) {
  bool widened = false;
  for (const NamedTensor& t : ts) {
    const StTensor* st = f.find(t.name);
    const bool bf16 = st && st->dtype == DType::bf16 && t.t.dtype == DType::f32 &&
                      st->nbytes == static_cast<uint64_t>(2 * t.t.numel());
    OOM_CHECK(st && (bf16 || (st->dtype == t.t.dtype && static_cast<uint64_t>(t.t.nbytes()) == st->nbytes)), "[train] ",
              f.path(), ": tensor '", t.name, "' is missing or has another shape/dtype");
    if (bf16) {
      std::vector<float> wide(static_cast<size_t>(t.t.numel()));
      convert(wide.data(), DType::f32, st->data, DType::bf16, t.t.numel());
      ops.upload(t.t, wide.data());
      widened = true;
    } else {
      ops.upload(t.t, st->data);
    }
  }
  return widened;
}

}  // namespace

std::string format_count(int64_t n) {
  char b[32];
  const double x = static_cast<double>(n);
  if (n >= 1000000000) std::snprintf(b, sizeof b, "%.2fB", x / 1e9);
  else if (n >= 1000000) std::snprintf(b, sizeof b, "%.2fM", x / 1e6);
  else if (n >= 1000) std::snprintf(b, sizeof b, "%.1fK", x / 1e3);
  else std::snprintf(b, sizeof b, "%lld", static_cast<long long>(n));
  return b;
}

namespace {

using K = TrainOption::Kind;
TrainOption text(const char* n, bool fixed, const char* arg, const char* help, std::string TrainConfig::*m) {
  TrainOption o{n, K::text, fixed, arg, help};
  o.text = m;
  return o;
}
TrainOption whole(const char* n, bool fixed, const char* arg, const char* help, int64_t TrainConfig::*m) {
  TrainOption o{n, K::integer, fixed, arg, help};
  o.integer = m;
  return o;
}
TrainOption real(const char* n, bool fixed, const char* arg, const char* help, double TrainConfig::*m) {
  TrainOption o{n, K::number, fixed, arg, help};
  o.number = m;
  return o;
}
TrainOption flag(const char* n, bool fixed, const char* help, bool TrainConfig::*m) {
  TrainOption o{n, K::boolean, fixed, "", help};
  o.boolean = m;
  return o;
}

}  // namespace

const std::vector<TrainOption>& train_options() {
  using C = TrainConfig;
  static const std::vector<TrainOption> table = {
      text("model", true, "M", "HF folder, .gguf or preset:NAME (default preset:tiny)", &C::model),
      text("data", true, "D",
           "files or folders, comma-separated: text, .ids, .jsonl ({\"text\"}, {\"messages\"} or\n{\"prompt\", "
           "\"completion\"}) (default: the bundled corpus)",
           &C::data),
      text("out", false, "DIR",
           "run folder: checkpoints, metrics.jsonl, report.html; a new run needs a new\nfolder (default "
           "runs/run-YYYYmmdd-HHMMSS)",
           &C::out),
      whole("seq", true, "T", "tokens per sequence (default 256)", &C::seq),
      whole("batch", true, "B", "sequences per micro-batch (default 8)", &C::batch),
      whole("grad-accum", true, "N", "micro-batches per optimizer step (default 1)", &C::grad_accum),
      whole("steps", false, "n", "total optimizer steps of the run (default: from --epochs)", &C::steps),
      real("epochs", true, "e", "passes over the data when --steps is not given (default 1)", &C::epochs),
      real("lr", true, "x",
           "peak learning rate (default: 2e-5 fine-tuning a pretrained model, 2e-4 with --lora,\n1e-3 from a "
           "random init)",
           &C::lr),
      real("min-lr", true, "x", "floor of the schedule, at most --lr (default 0.1 x --lr)", &C::min_lr),
      whole("warmup", true, "n", "linear warmup steps (default: 3% of the run pretrained, 20 random init)",
            &C::warmup),
      text("schedule", true, "S", "cosine, linear or constant (default cosine)", &C::schedule),
      real("weight-decay", true, "w",
           "decoupled, not on norms and biases (default: 0 pretrained, 0.1 random init)", &C::weight_decay),
      text("optim", true, "NAME",
           "adamw (fp32 moments, 8 bytes a trained parameter) or adamw8bit (bitsandbytes'\nblockwise 8-bit "
           "AdamW: 2 bytes a parameter; tensors under 4096 elements keep fp32),\ngalore or galore8bit (GaLore: "
           "the layers' matrices trained by Adam in an r-dimensional\nprojection of their gradient, fp32 or 8-bit "
           "moments; the rest by AdamW) (default adamw)",
           &C::optim),
      whole("galore-rank", true, "r", "GaLore's rank (default: width / 4)", &C::galore_rank),
      whole("galore-gap", true, "n", "steps between GaLore's projector refreshes (an SVD per matrix) (default 200)",
            &C::galore_gap),
      real("galore-scale", true, "s",
           "GaLore's update scale: the projected Adam step is multiplied by it (default 1,\n"
           "galore_torch's; transformers' Trainer uses 0.25, with a larger --lr)",
           &C::galore_scale),
      text("galore-refresh", true, "all|staggered",
           "all: every projector refreshed at the same step; staggered: layer l's at the\nsteps s with (s-1) mod "
           "gap = l mod gap, spreading the SVDs (default all)",
           &C::galore_refresh),
      text("optim-state", false, "T",
           "where the optimizer state lives: device, host (the optimizer runs there, the parameters\nand gradients brought "
           "to it each step), or disk (a file in --spill-dir, streamed through a\nwindow of three tensors' state while "
           "the threads update)\n(default host; on a CPU run Device and Host are both RAM: nothing is copied)",
           &C::optim_state),
      whole("zero", false, "S",
            "under mpirun: 1 shards the optimizer state over the ranks (ZeRO stage 1: each\nrank steps and keeps the "
            "state of its share of the tensors, then sends their new\nvalues to the others); 2 the gradients too (one "
            "layer's kept at a time, each\nsummed into its owners as backward finishes it, every chunk's); 3 the "
            "layers'\nweights too (each rank keeps its share; a layer's others are sent to every rank\nbefore its "
            "forward and again before its backward, into one layer's storage;\nits matrices in bf16 under --dtype bf16; "
            "with --lora, an f32 base's layer\nweights: the adapters stay whole, 1 shards their state, 2 is refused); "
            "0 none\n(default 0)",
            &C::zero),
      text("zero-prefetch", false, "S",
           "under --zero 3: yes sends the next layer's weights of a pass while one\ncomputes (two layers' storage for "
           "the others' tensors); 2 or 3, as many layers\nahead (one more layer's storage each); no, when the pass "
           "reaches it (one)\n(default yes)",
           &C::zero_prefetch),
      text("grad-sum-dtype", false, "D",
           "under mpirun: fp32 or bf16, what the ranks' gradients travel in to be summed\n(bf16: half the bytes; "
           "each rank's gradient rounded to bf16, the sum taken in fp32\nin rank order and rounded to bf16 once, "
           "the same on every rank) (default fp32)",
           &C::grad_sum_dtype),
      whole("context-parallel", false, "N",
            "under mpirun -np N: every sequence spread over the N ranks in consecutive\nslices of --seq / N tokens, "
            "each rank's queries attending to the earlier slices'\nkeys sent to it (memory for --seq / N tokens a "
            "rank; no --chunk); under\nmpirun -np M x N: M groups of N ranks, data parallel over the groups "
            "(default 1)",
            &C::context_parallel),
      text("cp-split", false, "S",
           "with --context-parallel: contiguous (rank r the r-th slice; the default) or zigzag\n(rank r two pieces of "
           "--seq / 2N, the r-th and the (2N-1-r)-th, so every rank has the\nsame attention work)",
           &C::cp_split),
      real("beta1", true, "b", "AdamW beta1 (default 0.9)", &C::beta1),
      real("beta2", true, "b", "AdamW beta2 (default 0.95)", &C::beta2),
      real("eps", true, "e", "AdamW epsilon (default 1e-8)", &C::eps),
      real("clip", true, "c", "global gradient-norm clip, 0 = off (default 1.0)", &C::clip),
      text("clip-norm", true, "current|previous",
           "the gradient norm --clip scales by: this step's, or the step before's (none at\nstep 1), as "
           "--step-in-backward needs (default current)",
           &C::clip_norm),
      flag("step-in-backward", false,
           "step each layer's parameters as soon as backward finishes their gradient, then\nfree it: one layer's "
           "gradients at a time instead of the model's. One sequence a\nstep (--batch 1 --grad-accum 1), whole "
           "sequences (no --chunk), and --clip 0 or\n--clip-norm previous",
           &C::step_in_backward),
      text("eval-data", false, "F",
           "held-out text, .ids or .jsonl file: loss of its first 32 windows (.jsonl: chats\nscored on their "
           "assistant turns, as training) (default: none, or the bundled eval\ntext with the bundled corpus)",
           &C::eval_data),
      whole("eval-every", false, "n", "evaluate every n steps, and at the end (default 100)", &C::eval_every),
      whole("save-every", false, "n", "checkpoint every n steps, and at the end (default 200)", &C::save_every),
      whole("keep", false, "K", "keep the newest K checkpoints, 0 = all (default 2)", &C::keep),
      text("budget", false, "SIZE", "memory budget for Device+Host, e.g. 24GiB or 24GB; with none of --save-policy,\n"
           "--chunk, --page, --act-offload, --kv-offload, --optim-state given, train chooses them to fit\n"
           "(oomless plan) (default: none)", &C::budget),
      text("dtype", true, "D", "fp32 or bf16 projections (default fp32)", &C::dtype),
      text("save-policy", true, "P",
           "what a layer keeps for backward: all, selective or none (recompute), for every\nlayer or per layer as "
           "a list, e.g. all:0-3,none:4-31 or none,all:0-1 (a bare policy\nfor the layers not named) (default all)",
           &C::save_policy),
      whole("seed", true, "s", "data order, preset and adapter init (default 0)", &C::seed),
      whole("threads", false, "n", "CPU threads (default: all)", &C::threads),
      whole("max-nonfinite", false, "k", "stop after more than k non-finite steps in a row (default 5)",
            &C::max_nonfinite),
      text("dump-tokens", false, "FILE", "write each step's token ids and targets as JSON lines", &C::dump_tokens),
      whole("chunk", true, "C",
            "chunk-recurrent training: activations for C tokens at a time, keys and values of\nearlier chunks in "
            "a paged store (default 0: off)",
            &C::chunk),
      whole("page", true, "P", "tokens per K/V page; divides --chunk (or a --context-parallel slice; default: its "
            "largest\ndivisor up to 64)",
            &C::page),
      text("kv-offload", false, "M", "none, host or disk: where earlier chunks' K/V pages live (default none)",
           &C::kv_offload),
      text("kv-dtype", true, "D",
           "fp32, bf16 or fp8: storage of earlier chunks' keys and values in every tier (bf16:\nhalf the bytes and "
           "the transfers; fp8: E4M3 with delayed scaling, a quarter, saturated\nand flushed values counted in "
           "metrics.jsonl; their gradients stay fp32) (default fp32)",
           &C::kv_dtype),
      text("act-dtype", true, "D",
           "fp32, bf16 or fp8: storage of the activations kept for backward (the\n--save-policy's per-layer "
           "tensors; the residual stream and per-row statistics stay\nfp32). bf16: half their bytes; fp8: E4M3 with "
           "delayed scaling, a quarter, counted\nin metrics.jsonl (default fp32)",
           &C::act_dtype),
      text("backend", false, "B", "where the model computes: cpu; cuda is refused until its kernels exist\n(default cpu)",
           &C::backend),
      text("act-offload", false, "M",
           "none, host or disk: where the activations each layer keeps for backward wait\nbetween its forward and "
           "its backward (two layers' worth stay in memory; the copies\noverlap compute; full-sequence training), "
           "for every layer or per layer as a list,\ne.g. disk:0-19,none (default none)",
           &C::act_offload),
      text("spill-dir", false, "DIR", "disk: folder of the spill file, not tmpfs (default --out)", &C::spill_dir),
      whole("sparse-pages", true, "k",
            "page-sparse attention: each query page reads its own chunk, the first --sink-pages\npages and its k "
            "best-scoring earlier pages (default 0: every page, dense); with\n--context-parallel, only the pages "
            "selected travel between the ranks",
            &C::sparse_pages),
      whole("sink-pages", true, "s", "pages every query page reads with --sparse-pages (default 1)", &C::sink_pages),
      text("page-summary", true, "S",
           "what a page is scored by: minmax (per-dimension bounds of its keys, as Quest;\nthe default) or mean "
           "(of its keys)",
           &C::page_summary),
      real("rope-theta", true, "x",
           "override the model's RoPE base (training past its native context); saved in\nthe checkpoints' "
           "config.json (default: the model's)",
           &C::rope_theta),
      text("rope-scaling", true, "S",
           "override the model's RoPE scaling: linear:F, yarn:F or llama3:F (the model's\ncontext so far is the "
           "original one; it becomes F times longer), none, or a\nrope_scaling JSON object; saved in the "
           "checkpoints' config.json",
           &C::rope_scaling),
      whole("lora", true, "r",
            "LoRA of rank r on the --lora-targets projections; the base is frozen (no base\ngradients or "
            "optimizer state) and checkpoints are PEFT adapter folders (default 0: train\nevery parameter)",
            &C::lora),
      real("lora-alpha", true, "a", "LoRA scale numerator: s = a / r (default 2r)", &C::lora_alpha),
      real("lora-dropout", true, "p", "dropout on the adapters' input (default 0)", &C::lora_dropout),
      text("lora-targets", true, "L",
           "projections to adapt: comma-separated q,k,v,o,gate,up,down (or q_proj, ...), or\nall-linear "
           "(default all-linear)",
           &C::lora_targets),
      flag("rslora", true, "rank-stabilised LoRA: s = a / sqrt(r)", &C::rslora),
      flag("dora", true,
           "DoRA (weight-decomposed LoRA): a trained magnitude per output row of each adapted\nprojection, "
           "y = m / ||W + s B A|| (W x + s B A x), the norm held constant as PEFT does\n(with --lora-dropout: "
           "PEFT's form, the base twice per projection)",
           &C::dora),
      text("base-dtype", true, "D",
           "with --lora: storage of the frozen projection matrices: fp32, bf16 (half the bytes;\nthe values rounded "
           "to bf16, as --dtype bf16 reads fp32 ones), nf4 (bitsandbytes' NF4,\nblocksize 64) or nf4-dq (its scales "
           "double-quantised) (default fp32; a GGUF keeps its\nown blocks, a bitsandbytes 4-bit folder is NF4)",
           &C::base_dtype),
      flag("qlora", true, "QLoRA: --base-dtype nf4-dq (bnb_4bit_quant_type nf4, double quantisation)", &C::qlora),
      text("embed-dtype", true, "D",
           "with --lora: storage of the frozen embedding and LM head: auto (a GGUF's own blocks,\nelse fp32), fp32, "
           "bf16 (as bitsandbytes keeps them) or nf4 (double-quantised with\n--qlora) (default auto)",
           &C::embed_dtype),
      text("modules-to-save", true, "L",
           "with --lora: embed_tokens and/or lm_head (comma-separated) trained in full beside\nthe adapter "
           "and saved in it, as PEFT's modules_to_save (default: none)",
           &C::modules_to_save),
      text("adapter", true, "DIR", "start from this adapter folder (oomless's or PEFT's) instead of a new one",
           &C::adapter),
      text("truncation", true, "R",
           "a conversation or prompt-completion pair longer than --seq: split (across\nsequences; later pieces "
           "train without the start of their prompt), drop, or error\n(default split; how many are long is "
           "printed before step 1)",
           &C::truncation),
      text("save-dtype", false, "D",
           "fp32 or bf16: the model's (or adapter's) weights in checkpoints (default fp32;\nbf16 halves them, and "
           "a run resumed from them continues from rounded weights)",
           &C::save_dtype),
      text("save-optimizer", false, "yes|no",
           "no: checkpoints hold the weights only (no optimizer state: a third of the bytes\nwith fp32 AdamW; "
           "such a checkpoint cannot be resumed) (default yes)",
           &C::save_optimizer),
  };
  return table;
}

std::string train_options_help() {
  std::string out;
  for (const TrainOption& o : train_options()) {
    std::string head = std::string("  --") + o.name + (*o.arg ? std::string(" ") + o.arg : "");
    if (head.size() < 23) head.resize(23, ' ');
    else head += ' ';
    std::string body = o.help;
    for (size_t i = 0; (i = body.find('\n', i)) != std::string::npos; i += 24) body.replace(i, 1, "\n" + std::string(23, ' '));
    out += head + body + "\n";
  }
  return out;
}

void TrainConfig::apply_json(const json::Value& o, const std::string& source) {
  OOM_CHECK(o.is_object(), "[train] ", source, ": a config file is a JSON object of flag names and values");
  for (const auto& kv : o.as_object()) {
    const std::string& k = kv.first;
    const json::Value& v = kv.second;
    const TrainOption* opt = nullptr;
    for (const TrainOption& t : train_options())
      if (k == t.name) opt = &t;
    OOM_CHECK(opt, "[train] ", source, ": unknown key \"", k, "\"; keys are the long flag names without --");
    switch (opt->kind) {
      case K::text: this->*(opt->text) = v.as_string(k); break;
      case K::integer: this->*(opt->integer) = v.as_int(k); break;
      case K::number: this->*(opt->number) = v.as_number(k); break;
      case K::boolean: this->*(opt->boolean) = v.as_bool(k); break;
    }
  }
}

json::Value TrainConfig::to_json() const {
  using json::Value;
  Value o = Value::object();
  for (const TrainOption& t : train_options()) {
    switch (t.kind) {
      case K::text: o.set(t.name, Value::string(this->*(t.text))); break;
      case K::integer: o.set(t.name, Value::integer(this->*(t.integer))); break;
      case K::number: o.set(t.name, Value::number(this->*(t.number))); break;
      case K::boolean: o.set(t.name, Value::boolean(this->*(t.boolean))); break;
    }
  }
  return o;
}

namespace {
int train_run(const TrainConfig& c, const std::string& out, const json::Value& plan);

LoraSettings lora_settings(const TrainConfig& c) {
  LoraSettings s;
  s.r = c.lora;
  s.alpha = c.lora_alpha > 0 ? c.lora_alpha : 2.0 * static_cast<double>(c.lora);
  s.dropout = c.lora_dropout;
  s.targets = parse_lora_targets(c.lora_targets);
  s.rslora = c.rslora;
  s.dora = c.dora;
  for (size_t i = 0; i <= c.modules_to_save.size();) {
    size_t j = c.modules_to_save.find(',', i);
    if (j == std::string::npos) j = c.modules_to_save.size();
    const std::string m = c.modules_to_save.substr(i, j - i);
    i = j + 1;
    if (m.empty()) continue;
    OOM_CHECK(m == "embed_tokens" || m == "lm_head", "[train] --modules-to-save: '", m,
              "' is not supported; supported: embed_tokens, lm_head");
    (m == "embed_tokens" ? s.train_embed : s.train_head) = true;
  }
  OOM_CHECK(c.lora > 0 || c.modules_to_save.empty(), "[train] --modules-to-save needs --lora r");
  return s;
}
}

int64_t prefetch_depth(const std::string& v) {
  if (v == "no") return 0;
  if (v == "yes") return 1;
  OOM_CHECK(v == "1" || v == "2" || v == "3", "[train] --zero-prefetch ", v, ": give yes (the next layer sent "
            "while one computes), 2 or 3 (as many layers ahead, one layer's storage each), or no");
  return v[0] - '0';
}

void validate_config(const TrainConfig& c) {
  OOM_CHECK(c.zero >= 0 && c.zero <= 3, "[train] --zero ", c.zero, ": there is no such ZeRO stage; --zero 3 shards the "
            "layers' weights, the gradients and the optimizer state over the ranks, 2 the gradients and the optimizer "
            "state, 1 the optimizer state, 0 none");
  prefetch_depth(c.zero_prefetch);  // names a bad value
  OOM_CHECK(c.grad_sum_dtype == "fp32" || c.grad_sum_dtype == "bf16", "[train] --grad-sum-dtype ", c.grad_sum_dtype,
            ": give fp32 (the gradients summed as they are) or bf16 (sent in bf16: half the bytes)");
  const int64_t cp = c.context_parallel;
  OOM_CHECK(cp >= 1, "[train] --context-parallel ", cp, ": give the number of ranks a sequence is spread over (1: "
            "none)");
  OOM_CHECK(cp > 1 || c.cp_split == "contiguous", "[train] --cp-split ", c.cp_split, " splits a sequence over the ranks "
            "of --context-parallel N: give --context-parallel too (or drop --cp-split)");
  if (cp > 1) {
    OOM_CHECK(c.seq % cp == 0, "[train] --context-parallel ", cp, " cuts each sequence into ", cp, " slices of equal "
              "length: --seq ", c.seq, " is not a multiple of ", cp, " (e.g. --seq ", (c.seq / cp + 1) * cp, ")");
    OOM_CHECK(c.chunk == 0, "[train] --context-parallel with --chunk: a rank holds its slice as one chunk; drop --chunk "
              "(or use more ranks for a shorter slice)");
    OOM_CHECK(c.act_offload == "none", "[train] --context-parallel with --act-offload ", c.act_offload, ": a rank runs "
              "its slice as one chunk of chunk-recurrent training, which offloads no saved activations; drop "
              "--act-offload (more ranks make each slice shorter)");
    OOM_CHECK(c.cp_split == "contiguous" || c.cp_split == "zigzag", "[train] --cp-split ", c.cp_split,
              " is not a split oomless has: contiguous or zigzag");
    if (c.cp_split == "zigzag") {
      OOM_CHECK(c.seq % (2 * cp) == 0, "[train] --cp-split zigzag cuts each sequence into ", 2 * cp, " pieces of equal "
                "length: --seq ", c.seq, " is not a multiple of ", 2 * cp, " (e.g. --seq ",
                (c.seq / (2 * cp) + 1) * 2 * cp, ")");
      OOM_CHECK(c.sparse_pages == 0, "[train] --cp-split zigzag with --sparse-pages is not built: the page-sparse ring "
                "takes contiguous slices (drop one of them)");
      OOM_CHECK(c.lora_dropout == 0, "[train] --cp-split zigzag with --lora-dropout is not built (dropout draws by a "
                "slice's first position): use --cp-split contiguous or drop --lora-dropout");
    }
    if (c.sparse_pages > 0) {  // the slice is the chunk: its pages are the ones selected among
      const int64_t Tl = c.seq / cp, P = c.page > 0 ? c.page : default_page(Tl);
      OOM_CHECK(P > 0 && Tl % P == 0, "[train] --sparse-pages with --context-parallel ", cp, ": a slice of ", Tl,
                " tokens ", c.page > 0 ? "is not whole pages of --page " + std::to_string(c.page)
                                       : std::string("has no divisor from 8 to 64 for a page"),
                ": give --page P dividing ", Tl);
    }
  }
  parse_truncation(c.truncation);
  OOM_CHECK(c.save_dtype == "fp32" || c.save_dtype == "bf16", "[train] --save-dtype ", c.save_dtype,
            " is not supported; use fp32 or bf16");
  OOM_CHECK(c.save_optimizer == "yes" || c.save_optimizer == "no", "[train] --save-optimizer ", c.save_optimizer,
            " is not supported; use yes or no");
  parse_optimizer(c.optim);
  const bool galore = c.optim == "galore" || c.optim == "galore8bit";
  // A run's saved configuration (read back by --resume) holds the scale it resolved: 1, or 0.25 from binaries
  // before 2026-12-05, whose default it was; those count as left out.
  const bool scale_unset = c.galore_scale < 0 || c.galore_scale == 1.0 || c.galore_scale == 0.25;
  OOM_CHECK(galore || (c.galore_rank == 0 && c.galore_gap == 200 && scale_unset && c.galore_refresh == "all"),
            "[train] --galore-rank, --galore-gap, --galore-scale and --galore-refresh need --optim galore or galore8bit");
  OOM_CHECK(!galore || c.lora == 0, "[train] --optim ", c.optim, " projects the gradients of full weight matrices; "
            "with --lora (an adapter already low-rank) use --optim adamw or adamw8bit");
  OOM_CHECK(c.galore_refresh == "all" || c.galore_refresh == "staggered", "[train] --galore-refresh ",
            c.galore_refresh, " is not supported; use all or staggered");
  OOM_CHECK(c.galore_rank >= 0 && c.galore_gap >= 1 && (c.galore_scale == -1 || (c.galore_scale > 0 && std::isfinite(c.galore_scale))),
            "[train] --galore-rank must be at least 1 (or 0: width / 4), --galore-gap at least 1 and --galore-scale positive");
  OOM_CHECK(c.clip_norm == "current" || c.clip_norm == "previous", "[train] --clip-norm ", c.clip_norm,
            " is not supported; use current or previous");
  OOM_CHECK(c.clip_norm == "current" || c.clip > 0, "[train] --clip-norm previous chooses the norm --clip scales by, "
            "and --clip is 0 (off): give --clip c or drop --clip-norm");
  if (c.step_in_backward) {
    OOM_CHECK(c.batch * c.grad_accum == 1, "[train] --step-in-backward steps each layer when its gradient is final, "
              "so a step holds one sequence: --batch ", c.batch, " --grad-accum ", c.grad_accum, " would accumulate ",
              c.batch * c.grad_accum, " sequences' gradients first; use --batch 1 --grad-accum 1 (a longer --seq "
              "for more tokens a step), or drop --step-in-backward");
    OOM_CHECK(c.chunk == 0, "[train] --step-in-backward cannot combine with --chunk: chunk-recurrent training adds "
              "every chunk into every layer's gradient, so none is final before the last chunk; drop one of them");
    OOM_CHECK(c.clip == 0 || c.clip_norm == "previous", "[train] --step-in-backward steps the last layers before "
              "backward reaches the first, so this step's gradient norm is not known in time for --clip ", c.clip,
              ": add --clip-norm previous (scale by the step before's norm) or --clip 0");
  }
  OOM_CHECK(c.seq >= 2, "[train] --seq must be at least 2");
  OOM_CHECK(c.batch >= 1 && c.grad_accum >= 1, "[train] --batch and --grad-accum must be at least 1");
  OOM_CHECK(c.epochs >= 0 && std::isfinite(c.epochs), "[train] --epochs must be a positive number, got ", c.epochs);
  // Flags that would do nothing in this mode are errors, not silently ignored.
  OOM_CHECK(c.kv_offload == "none" || c.chunk > 0, "[train] --kv-offload ", c.kv_offload, " needs --chunk C: only "
            "chunk-recurrent training keeps earlier chunks' K/V pages that could live elsewhere");
  OOM_CHECK(c.kv_dtype == "fp32" || c.kv_dtype == "bf16" || c.kv_dtype == "fp8", "[train] --kv-dtype ", c.kv_dtype,
            " is not a key/value storage oomless has; use fp32, bf16 or fp8");
  OOM_CHECK(c.kv_dtype == "fp32" || c.chunk > 0, "[train] --kv-dtype ", c.kv_dtype, " needs --chunk C: it is the "
            "storage of chunk-recurrent training's key/value pages");
  parse_act_dtype(c.act_dtype);
  const std::vector<SavePolicy> policies = parse_save_policies(c.save_policy, -1);
  const bool keeps_nothing = std::all_of(policies.begin(), policies.end(), [](SavePolicy p) { return p == SavePolicy::none; });
  OOM_CHECK(c.act_dtype == "fp32" || !keeps_nothing || c.chunk > 0, "[train] --act-dtype ", c.act_dtype,
            " with --save-policy none keeps nothing to narrow: only each layer's input is kept (fp32, the checkpoint "
            "the recompute starts from); use --save-policy all or selective, or drop --act-dtype");
  OOM_CHECK(c.page == 0 || c.chunk > 0 || (c.context_parallel > 1 && c.sparse_pages > 0), "[train] --page ", c.page,
            " needs --chunk C: pages are the K/V store of chunk-recurrent training (or, with --context-parallel and "
            "--sparse-pages, what each rank's slice is selected in)");
  OOM_CHECK(c.optim_state == "device" || c.optim_state == "host" || c.optim_state == "disk", "[train] --optim-state ",
            c.optim_state, " is not a place oomless keeps optimizer state; use device, host or disk");
  parse_act_tiers(c.act_offload, -1);  // the syntax; the layers are checked against the model at setup
  OOM_CHECK(c.act_offload == "none" || c.chunk == 0, "[train] --act-offload ", c.act_offload, " with --chunk: chunk-"
            "recurrent training keeps one chunk's activations already; drop one of them");
  OOM_CHECK(c.act_offload == "none" || !keeps_nothing, "[train] --act-offload ", c.act_offload, " with --save-policy ",
            c.save_policy, ": no layer keeps activations to offload; use all or selective on some layers, or drop "
            "--act-offload");
  OOM_CHECK(c.spill_dir.empty() || c.kv_offload == "disk" || c.optim_state == "disk" ||
                c.act_offload.find("disk") != std::string::npos,
            "[train] --spill-dir ", c.spill_dir, " is the folder of the spill files of --kv-offload disk, "
            "--act-offload disk and --optim-state disk; add one of them, or drop --spill-dir");
  {
    const int cpus = detect_cpu().logical_cpus;
    OOM_CHECK(c.threads >= 0 && (cpus <= 0 || c.threads <= cpus), "[train] --threads ", c.threads, " is more than this "
              "machine's ", cpus, " logical CPUs (threads beyond them wait on each other and run many times slower); "
              "use at most ", cpus, " or leave --threads out");
  }
}

namespace {
// A run over several ranks (mpirun / srun; data parallel): every rank must have been given the same settings,
// since each computes the same update from the summed gradients. Compared by a hash of the settings; the
// error names the first rank that differs. Then what data parallelism needs of them.
void check_ranks_agree(const TrainConfig& c) {
  const std::string text = json::dump(c.to_json());
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : text) h = (h ^ ch) * 1099511628211ull;
  const std::vector<uint64_t> all = dist::all_u64(h);
  for (size_t r = 1; r < all.size(); ++r)
    OOM_CHECK(all[r] == all[0], "[train] rank ", r, " was started with other settings than rank 0 (every rank of a "
              "run needs the same flags, data and model: one command line for all, e.g. mpirun -np ", all.size(),
              " oomless train ...)");
  // Data parallel over groups of --context-parallel ranks (a group shares each of its sequences).
  const int64_t n = c.batch * c.grad_accum, R = dist::size() / std::max<int64_t>(c.context_parallel, 1);
  int64_t g = c.grad_accum;
  while (c.batch * g % R) ++g;
  OOM_CHECK(n % R == 0, "[train] ", R, c.context_parallel > 1 ? " groups of ranks" : " ranks",
            " share each step's --batch x --grad-accum = ", n, " sequences, which needs a multiple of ", R,
            ": e.g. --batch ", c.batch, " --grad-accum ", g,
            c.context_parallel > 1 ? std::string() : " (or --context-parallel " + std::to_string(R) +
                                                        ": every sequence spread over the ranks)");
  OOM_CHECK(!c.step_in_backward, "[train] --step-in-backward steps each layer during backward, before the ranks' "
            "gradients are summed: run it without mpirun, or drop --step-in-backward");
}
}  // namespace

int run_training(const TrainConfig& c, const json::Value& plan) {
  validate_config(c);
  OOM_CHECK(c.context_parallel == 1 || dist::size() % c.context_parallel == 0, "[train] --context-parallel ",
            c.context_parallel, " spreads each sequence over ", c.context_parallel, " ranks, but ",
            dist::size() == 1 ? "this run is one process: launch it with mpirun -np " + std::to_string(c.context_parallel) +
                                    ", or give --context-parallel 1 (a resumed run keeps its setting unless given)"
                              : "the run has " + std::to_string(dist::size()) + ", not a multiple of it: use "
                                    "--context-parallel " + std::to_string(dist::size()) + " (every rank holds a "
                                    "slice) or a divisor of " + std::to_string(dist::size()) + " (data parallel "
                                    "over groups of that many ranks)");
  if (c.threads > 0) {
    set_threads(static_cast<int>(c.threads));
  } else if (dist::local_size() > 1) {  // ranks sharing this machine share its CPUs
    set_threads(std::max(1, omp_get_num_procs() / dist::local_size()));
  }
  if (c.threads > omp_get_num_procs())
    std::fprintf(stderr, "oomless train: %swarning: --threads %lld, but this process may run on %d CPU%s only (its "
                 "affinity; under mpirun, --bind-to none or --map-by slot:PE=%lld gives a rank more)\n",
                 dist::rank_prefix().c_str(), static_cast<long long>(c.threads), omp_get_num_procs(),
                 omp_get_num_procs() == 1 ? "" : "s", static_cast<long long>(c.threads));
  if (dist::distributed()) check_ranks_agree(c);
  const bool writer = dist::rank() == 0;  // rank 0 writes the run folder: metrics, checkpoints, report
  std::string out = c.resume && !c.resume_dir.empty() ? c.resume_dir : c.out;
  if (out.empty()) {
    OOM_CHECK(!c.resume, "[train] --resume needs the run folder: --resume DIR (or --out DIR)");
    char stamp[32];
    const std::time_t now = static_cast<std::time_t>(dist::all_u64(static_cast<uint64_t>(std::time(nullptr)))[0]);  // rank 0's
    std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
    out = std::string("runs/run-") + stamp;
  }
  // A new run never writes over an earlier one: its checkpoints and metrics stay as they are.
  if (!c.resume && fs::exists(out) && writer) {
    bool used = false;
    for (const auto& e : fs::directory_iterator(out)) used |= e.path().filename().string().rfind("checkpoint-", 0) == 0;
    OOM_CHECK(!used, "[train] ", out, " already holds a run (checkpoints); continue it with --resume, or give a new --out");
    // Metrics of a run that stopped before its first checkpoint: start them again.
    if (fs::exists(MetricsWriter::path_in(out))) MetricsWriter::truncate_after(MetricsWriter::path_in(out), 0);
  }
  const bool created = !fs::exists(out);
  if (writer) fs::create_directories(out);
  // No --data: the bundled corpus, written once into the run folder so the data pipeline (and a resumed
  // run) reads it like any file.
  TrainConfig cfg_local = c;
  if (c.data.empty()) {
    const std::string dir = out + "/bundled-data";
    if (writer) fs::create_directories(dir);
    auto put = [&](const std::string& p, std::string_view text) {
      if (!writer || (fs::exists(p) && fs::file_size(p) == text.size())) return;
      std::FILE* f = std::fopen(p.c_str(), "wb");
      OOM_CHECK(f && std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fclose(f) == 0,
                "[train] cannot write the bundled corpus to ", p, ": ", std::strerror(errno));
    };
    // Training documents are the chapters (heading, blank line, verses), as JSONL, so each epoch visits
    // them in a shuffled order instead of reading the Bible front to back.
    std::string jsonl;
    const std::string_view text = bundled_train_text();
    size_t i = 0;
    while (i < text.size()) {
      size_t head_end = text.find("\n\n", i);
      if (head_end == std::string_view::npos) head_end = text.size();
      size_t body_end = head_end < text.size() ? text.find("\n\n", head_end + 2) : text.size();
      if (body_end == std::string_view::npos) body_end = text.size();
      std::string chapter(text.substr(i, body_end - i));
      while (!chapter.empty() && chapter.back() == '\n') chapter.pop_back();
      if (!chapter.empty()) {
        json::Value o = json::Value::object();
        o.set("text", json::Value::string(chapter + "\n"));
        jsonl += json::dump(o) + "\n";
      }
      i = body_end + 2;
    }
    put(dir + "/kjv-train.jsonl", jsonl);
    put(dir + "/kjv-eval.txt", bundled_eval_text());
    cfg_local.data = dir + "/kjv-train.jsonl";
    // The embedded default is sized to finish in minutes on a 2-core machine.
    if (cfg_local.steps == 0 && cfg_local.epochs == 0) cfg_local.steps = 250;
    if (cfg_local.eval_data.empty()) cfg_local.eval_data = dir + "/kjv-eval.txt";
    if (writer)
      std::fprintf(stderr, "oomless train: no --data: training %s on the bundled KJV corpus (%s)\n", c.model.c_str(),
                   cfg_local.data.c_str());
  }
  dist::barrier();  // the other ranks read what rank 0 wrote
  try {
    return train_run(cfg_local, out, plan);
  } catch (...) {
    // A new run that failed before its first checkpoint leaves no folder behind when it made the folder
    // (it holds at most the bundled corpus and a metrics file of no step).
    if (created && writer) {
      std::error_code ec;
      bool saved = false;
      for (const auto& e : fs::directory_iterator(out, ec)) saved |= e.path().filename().string().rfind("checkpoint-", 0) == 0;
      if (!saved) fs::remove_all(out, ec);
    }
    throw;
  }
}

// A transformer layer's group of gradients (not the embedding's, the final norm's or the head's).
bool is_layer_group(int64_t g) { return g >= 0 && g != kHeadGroup; }

struct Trainer::State {
  TrainConfig c;
  std::string out;
  Engine e;
  TrainableSet trained;
  // Data parallel (several ranks): a bucket of gradients downloaded for the sum over ranks, and the ranks'
  // copies of this rank's part of it (dist::sum_floats).
  Buffer dp_stage;
  int64_t dp_bucket = 0;
  // --zero 1: the rank that owns each trained tensor (dist::owners), the tensors this rank owns (the optimizer's
  // set) and each trained tensor's index in it (-1: another rank's).
  std::vector<int> owner;
  TrainableSet owned;
  std::vector<int64_t> owned_at;
  // --zero 2 (over several ranks): the gradients of the owned layer tensors (their owned[k].grad views it); the
  // model keeps one layer's at a time (and the embedding's, the norm's and the head's whole).
  bool zero2 = false;
  Buffer owned_grads;
  // --zero 3 (over several ranks): the layers' tensors of other ranks are views into one layer's storage, or k + 1
  // (Engine::gathered; --zero-prefetch k layers ahead: layer l's in copy l % (k + 1)), filled from their owners
  // before a pass reads them. In an adapter run the frozen base's layer weights are sharded so (the adapters stay
  // whole on every rank, their optimizer state sharded as --zero 1 does). Per layer, its sharded tensors and the
  // rank that holds each (empty: none sharded); the layer each copy holds (-1: none, or stale after a step); the
  // layer the model asked for last (a pass's direction); the layers on their way into their copies while another
  // computes, in the order they were sent, each with its messages. Under bf16 compute the projection weights
  // travel in bf16 (the values the products read: each owner rounds its own into the wire buffer of the copy, each
  // other rank widens them into the copy on arrival), the other tensors (norms, biases) in f32.
  bool zero3 = false;
  struct LayerTensor {
    Tensor t;
    int owner = 0;
    int64_t half_at = -1;  // bf16 on the wire: its offset in a wire buffer (bytes), else -1
  };
  std::vector<std::vector<LayerTensor>> layer_tensors;
  std::vector<Buffer> wire;  // per gathered copy: the layer's bf16 tensors
  struct Flight {
    int64_t layer = -1;
    std::vector<dist::Request> requests;
    std::vector<std::pair<Tensor, Tensor>> widen;  // (bf16 arrived, its f32 place): widened when done
  };
  int copies = 1;
  std::vector<int64_t> gathered_in;
  int64_t last_fetch = -1;
  std::deque<Flight> flights;
  std::vector<int64_t> opt_entries_of;  // per rank, its optimizer state entries at the last save (0: none sent)
  std::unique_ptr<Optimizer> opt;
  std::unique_ptr<PagedKvStore> kv;
  std::unique_ptr<RingKv> ring;  // --context-parallel: the earlier slices' keys (kv stays empty)
  int64_t C = 0;  // chunk length (0: whole sequences)
  std::unique_ptr<Dataset> data;
  ScheduleSettings sched;
  int64_t total = 0, step = 0, nonfinite_total = 0, nonfinite_run = 0;
  double prev_norm = NAN;  // the last finite step's gradient norm (--clip-norm previous)
  std::map<int64_t, std::vector<size_t>> groups;  // Trainable::group -> its indices in `trained`
  int64_t per_epoch = 0;  // sequences in an epoch (0: not counted)
  std::vector<int32_t> eval_stream;
  Sequences eval_seqs;
};

EngineOptions engine_options(const TrainConfig& c) {
  // An adapter run on a GGUF keeps the base's projection matrices in the file's blocks (frozen: read
  // by the GEMM as they are); anything else holds every parameter in f32.
  OOM_CHECK(c.lora > 0 || (!c.qlora && c.base_dtype == "fp32"), "[train] --qlora and --base-dtype ",
            c.qlora ? "nf4-dq" : c.base_dtype, " make a frozen quantised base: they need --lora r");
  OOM_CHECK(!c.qlora || c.base_dtype == "fp32" || c.base_dtype == "nf4-dq", "[train] --qlora is --base-dtype nf4-dq; "
            "drop one of --qlora and --base-dtype ", c.base_dtype);
  // Trained embeddings (modules_to_save) are fp32 masters.
  OOM_CHECK(c.modules_to_save.empty() || c.embed_dtype == "auto" || c.embed_dtype == "fp32", "[train] --embed-dtype ",
            c.embed_dtype, " stores a frozen embedding and head; --modules-to-save trains them (fp32): drop one");
  if (c.lora == 0) {
    OOM_CHECK(c.adapter.empty(), "[train] --adapter ", c.adapter, " needs --lora r (the adapter's rank)");
    OOM_CHECK(!c.dora, "[train] --dora needs --lora r (DoRA is a kind of LoRA adapter)");
  }
  OOM_CHECK(c.rope_theta == 0 || (c.rope_theta > 0 && std::isfinite(c.rope_theta)),
            "[train] --rope-theta must be a positive number, got ", c.rope_theta);
  EngineOptions o;
  o.model = c.model;
  o.backend = c.backend;
  o.seed = static_cast<uint64_t>(c.seed);
  o.budget = c.budget.empty() ? (size_t{1} << 46) : parse_size(c.budget);
  o.rope_theta = c.rope_theta;
  o.rope_scaling = c.rope_scaling;
  o.keep_quantised = c.lora > 0;
  o.base_dtype = c.qlora ? "nf4-dq" : c.base_dtype;
  o.embed_dtype = c.modules_to_save.empty() ? c.embed_dtype : "fp32";
  // --lora: adapters on a frozen base (PEFT's default init, or --adapter's tensors).
  if (c.lora > 0) {
    o.lora = lora_settings(c);
    o.lora_seed = static_cast<uint64_t>(c.seed) + 1;
    o.adapter = c.adapter;
  }
  o.dtype = parse_compute_dtype(c.dtype);
  o.save_policy = c.save_policy;
  o.act_store = parse_act_dtype(c.act_dtype);
  o.act_offload = c.act_offload == "host" ? Tier::Host : c.act_offload == "disk" ? Tier::Disk : Tier::Device;
  if (c.act_offload != "none" && c.act_offload != "host" && c.act_offload != "disk") o.act_tiers = c.act_offload;
  o.spill_dir = c.spill_dir;
  // --zero 3: the layers' tensors of other ranks in k + 1 copies while the next k layers are sent ahead
  // (--zero-prefetch k; yes: 1), else one (used where `held` is given).
  o.gathered_copies = c.zero >= 3 ? 1 + static_cast<int>(prefetch_depth(c.zero_prefetch)) : 1;
  return o;
}

namespace {

// The model's part of a checkpoint: the adapter (PEFT's names; the base is unchanged) or every parameter.
std::vector<NamedTensor> model_state(Engine& e) {
  return e.adapters ? adapter_tensors(*e.adapters, *e.params, e.src.cfg) : e.params->named();
}

bool in_buffer(const Tensor& t, const Buffer& b) {
  const char* p = static_cast<const char*>(t.data);
  return p >= b.as<char>() && p < b.as<char>() + b.size();
}

// Trained tensor i's values from its owner on every rank: the transport reads and writes the tensor where it lies
// (dist/comm.h), in pieces of the data-parallel bucket.
void from_owner(Trainer::State& s, size_t i) {
  const Tensor& p = s.trained[i].param;
  for (int64_t o = 0, total = p.numel(); o < total; o += s.dp_bucket) {
    const int64_t len = std::min(s.dp_bucket, total - o);
    dist::broadcast(static_cast<float*>(p.data) + o, len * static_cast<int64_t>(sizeof(float)), s.owner[i]);
  }
}

// --zero 3: the rank holding each of the model's parameters (param_specs order), as ZeRO shards them.
std::vector<int> spec_owners(const std::vector<ParamSpec>& specs) {
  std::vector<int64_t> sizes;
  for (const ParamSpec& p : specs) sizes.push_back(numel_of(p.shape));
  return dist::owners(sizes, dist::size());
}

// --zero 3: the messages that bring layer l's tensors of other ranks into its gathered copy: each tensor sent by
// its owner to every other rank, straight from and into the tensors' memory, in pieces of at most 1 GiB. Every rank
// posts them in the same order under one tag (MPI matches a pair's messages in order), above the context-parallel
// ring's (dist/ring_kv.cpp: 0 to 63999).
constexpr int kGatherTag = 64000;
void post_layer(Trainer::State& s, int64_t l, Trainer::State::Flight* out) {
  out->layer = l;
  constexpr int64_t kPiece = int64_t{1} << 30;
  for (const auto& [t, owner, half_at] : s.layer_tensors[static_cast<size_t>(l)]) {
    char* p = static_cast<char*>(t.data);
    int64_t bytes = static_cast<int64_t>(t.nbytes());
    if (half_at >= 0) {  // in bf16, through the copy's wire buffer (converted by the backend, where t lies)
      const Buffer& w = s.wire[static_cast<size_t>(l % s.copies)];
      p = w.as<char>() + half_at;
      bytes = t.numel() * 2;
      const Tensor h(p, DType::bf16, {t.numel()}, w.tier()), f = t.reshape({t.numel()});
      if (owner == dist::rank()) s.e.ops->convert(h, f);
      else out->widen.push_back({h, f});
    }
    for (int64_t o = 0, total = bytes; o < total; o += kPiece) {
      const int64_t len = std::min(kPiece, total - o);
      if (owner != dist::rank()) {
        out->requests.push_back(dist::irecv(p + o, len, owner, kGatherTag));
        continue;
      }
      for (int r = 0; r < dist::size(); ++r)
        if (r != owner) out->requests.push_back(dist::isend(p + o, len, r, kGatherTag));
    }
  }
}
// The oldest layer in flight arrived: its messages done, its bf16 tensors widened, its copy holding it.
void finish_layer(Trainer::State& s) {
  Trainer::State::Flight& f = s.flights.front();
  for (dist::Request& r : f.requests) dist::wait(r);
  for (const auto& [h, t] : f.widen) s.e.ops->convert(t, h);  // exact
  s.gathered_in[static_cast<size_t>(f.layer % s.copies)] = f.layer;
  s.flights.pop_front();
}
void finish_layers(Trainer::State& s) {
  while (!s.flights.empty()) finish_layer(s);
}
bool in_flight(const Trainer::State& s, int64_t l) {
  for (const Trainer::State::Flight& f : s.flights)
    if (f.layer == l) return true;
  return false;
}
void post_flight(Trainer::State& s, int64_t l) {
  s.gathered_in[static_cast<size_t>(l % s.copies)] = -1;
  s.flights.emplace_back();
  post_layer(s, l, &s.flights.back());
}

// --zero 3: layer l's tensors of other ranks into its gathered copy (nothing when it holds them already), before
// the model reads them; with k + 1 copies, then the next k layers of the pass into the other copies while this one
// computes (the pass's direction from the layer asked for before: a forward climbs from 0, a backward descends
// from the layer the forward ended on; nothing past either end, so no pass is sent ahead into the next, where an
// evaluation or a step may come first). Layers arrive in the order they were sent; every rank sends them in the
// same order.
void gather_layer(Trainer::State& s, int64_t l) {
  const int64_t prev = s.last_fetch, L = s.e.src.cfg.L;
  s.last_fetch = l;
  if (in_flight(s, l)) {  // sent ahead: it and those sent before it have arrived
    while (s.flights.front().layer != l) finish_layer(s);
    finish_layer(s);
  }
  if (s.gathered_in[static_cast<size_t>(l % s.copies)] != l) {  // the pass turned or began elsewhere
    finish_layers(s);
    post_flight(s, l);
    finish_layer(s);
  }
  if (s.copies < 2) return;
  const int dir = l == prev + 1 ? 1 : l == prev - 1 ? -1 : l == 0 ? 1 : l == L - 1 ? -1 : 0;
  for (int64_t k = 1; dir != 0 && k < s.copies; ++k) {
    const int64_t next = l + dir * k;
    if (next < 0 || next >= L) break;
    if (s.gathered_in[static_cast<size_t>(next % s.copies)] == next || in_flight(s, next)) continue;  // there
    bool taken = false;  // its copy still awaited by another layer on its way (a turned pass): let those arrive
    for (const Trainer::State::Flight& f : s.flights) taken |= f.layer % s.copies == next % s.copies;
    if (taken) finish_layers(s);
    post_flight(s, next);
  }
}

// --zero 3: every gathered copy stale (the owners' tensors have changed: a step of full training, a resume).
void stale_layers(Trainer::State& s) {
  finish_layers(s);
  std::fill(s.gathered_in.begin(), s.gathered_in.end(), -1);
}

}  // namespace

void resolve_defaults(TrainConfig& c, bool pretrained) {
  if (c.lr <= 0) c.lr = pretrained ? (c.lora > 0 ? 2e-4 : 2e-5) : 1e-3;
  if (c.weight_decay < 0) c.weight_decay = pretrained ? 0.0 : 0.1;
  if (c.min_lr < 0) c.min_lr = 0.1 * c.lr;
}

void resolve_warmup(TrainConfig& c, bool pretrained, int64_t total) {
  if (c.warmup < 0)
    c.warmup = pretrained ? std::max<int64_t>(1, static_cast<int64_t>(std::ceil(0.03 * static_cast<double>(total))))
                          : 20;
}

namespace {

// The newest checkpoint of a run folder that verifies, and its trainer_state.json.
struct SavedRun {
  std::string path;
  json::Value state;
};
SavedRun find_saved_run(const std::string& run_dir) {
  auto warn = [](const std::string& w) { std::fprintf(stderr, "oomless train: warning: %s\n", w.c_str()); };
  std::optional<FoundCheckpoint> ck = find_latest_checkpoint(run_dir, warn);
  OOM_CHECK(ck.has_value(), "[train] --resume: no complete checkpoint in ", run_dir,
            "; give the run folder (--resume DIR or --out DIR), or start without --resume");
  json::Value st = json::parse_file(ck->path + "/trainer_state.json");
  OOM_CHECK(st.find("config") && st.at("config").is_object(), "[train] --resume: ", ck->path,
            "/trainer_state.json holds no \"config\"");
  return {ck->path, std::move(st)};
}

}  // namespace

json::Value saved_run_config(const std::string& run_dir) { return find_saved_run(run_dir).state.at("config"); }

namespace {

const char* kind_words(const std::string& kind) {
  if (kind == "hf") return "Hugging Face folder";
  if (kind == "gguf") return "GGUF";
  if (kind == "config") return "config.json alone, random init";
  return "preset, random init";
}

// The ledger's peak per category over every tier, as "weights 1.2 GiB, grads ..." (categories held only).
std::string ledger_line(const Ledger& l) {
  std::string out;
  for (int ci = 0; ci < kCategoryCount; ++ci) {
    size_t b = 0;
    for (int t = 0; t < kTierCount; ++t) b += l.peak(static_cast<Tier>(t), static_cast<Category>(ci));
    if (b == 0) continue;
    out += (out.empty() ? "" : ", ") + std::string(category_name(static_cast<Category>(ci))) + " " + format_bytes(b);
  }
  return out;
}

}  // namespace

StepBatch synthetic_batch(int64_t n, int64_t T, int64_t V) {
  StepBatch b;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int32_t> ids(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>((t * 131 + i * 17 + 3) % V);
    std::vector<int32_t> tg(ids.begin() + 1, ids.end());
    tg.push_back(-100);
    b.ids.push_back(std::move(ids));
    b.targets.push_back(std::move(tg));
  }
  return b;
}

int64_t default_page(int64_t C) {
  for (int64_t p = std::min<int64_t>(64, C); p >= 8; --p)
    if (C % p == 0) return p;
  return 0;
}

RingOptions ring_options(const TrainConfig& c) {
  RingOptions sp;
  sp.zigzag = c.context_parallel > 1 && c.cp_split == "zigzag";
  if (c.context_parallel <= 1 || c.sparse_pages == 0) return sp;
  const int64_t Tl = c.seq / c.context_parallel;
  sp.P = c.page > 0 ? c.page : default_page(Tl);
  sp.pages = c.sparse_pages;
  sp.sinks = c.sink_pages;
  sp.S = parse_page_summary(c.page_summary) == PageSummary::mean ? 1 : 2;
  return sp;
}

namespace {

// Setup ran out of memory: what the run holds and needs, and the changes that cut the most, exact where
// they are static (from the model's parameter count), never blaming a flag the user did not give.
[[noreturn]] void out_of_budget(const TrainConfig& c, const std::string& what, const Ledger* ledger) {
  std::string msg = std::string("[train] the run does not fit ") +
                    (c.budget.empty() ? "in this machine's memory" : "--budget " + c.budget) + ": " + what;
  if (ledger) msg += "\nheld when it failed: " + ledger_line(*ledger);
  ModelConfig cfg;
  try {
    cfg = open_model(c.model, static_cast<uint64_t>(c.seed)).cfg;
  } catch (const Error&) {
    fail(msg);
  }
  const double P = static_cast<double>(cfg.param_count());
  auto gb = [](double b) { return format_bytes(static_cast<size_t>(b)); };
  if (c.seq > cfg.max_position)
    msg += "\n--seq " + std::to_string(c.seq) + " is past the model's max_position_embeddings (" +
           std::to_string(cfg.max_position) + ")";
  if (c.lora == 0) {
    const bool eight = c.optim == "adamw8bit";
    msg += "\nthis run trains every parameter: weights " + gb(4 * P) + ", gradients " + gb(4 * P) + ", " +
           (eight ? "AdamW8bit state " + gb(2 * P) + " (10 bytes a parameter)"
                  : "AdamW state " + gb(8 * P) + " (16 bytes a parameter)") +
           " before activations";
    msg += "\nchanges that fit more: --lora 16 (the base frozen: no base gradients or optimizer state, saves about " +
           gb(12 * P) + "), --lora 16 --qlora (also the frozen projections in NF4, about 0.5 byte a parameter)";
    if (!eight) msg += ", --optim adamw8bit (8-bit optimizer state, saves about " + gb(6 * P) + ")";
  } else if (!c.qlora && c.base_dtype == "fp32") {
    msg += "\nchanges that fit more: --qlora (the frozen projections in NF4, about " + gb(3.4 * P) + " less)";
  } else {
    msg += "\nchanges that fit more:";
  }
  if (c.chunk == 0)
    msg += ", --chunk 512 (activations for 512 tokens at a time instead of --seq " + std::to_string(c.seq) +
           "; with --kv-offload host or disk for long sequences)";
  if (c.save_policy != "none") msg += ", --save-policy none (keep each layer's input only, recompute in backward)";
  if (c.act_dtype == "fp32" && (c.save_policy != "none" || c.chunk > 0))
    msg += ", --act-dtype bf16 (the activations kept for backward in half the bytes; fp8: a quarter)";
  if (c.batch > 1) msg += ", --batch 1 --grad-accum " + std::to_string(c.batch * c.grad_accum) + " (the same step)";
  if (!c.budget.empty()) msg += ", or a larger --budget";
  msg += "\n`oomless estimate` with these flags and --budget lists what each change saves; `oomless plan` chooses the "
         "fastest that fits";
  fail(msg);
}

}  // namespace

Trainer::Trainer(const TrainConfig& cfg_in, const std::string& out, std::FILE* log) : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.c = cfg_in;
  s.out = out;
  TrainConfig& c = s.c;
  auto say = [log](const char* fmt, auto... args) {
    if (!log) return;
    std::fprintf(log, fmt, args...);
    std::fflush(log);
  };
  validate_config(c);
  // A resumed run keeps the saved values of the settings left at their defaults (which may depend on the
  // run's length, e.g. the warmup).
  // The checkpoint is found (and its files hashed) once, here.
  std::optional<SavedRun> resumed;
  if (c.resume) resumed = find_saved_run(out);
  if (resumed) {
    const json::Value& saved = resumed->state.at("config");
    auto keep = [&](const char* key, double& v) {
      if (v < 0 || (v == 0 && std::string_view(key) == "lr"))
        if (saved.find(key) && saved.at(key).is_number()) v = saved.at(key).as_number();
    };
    keep("lr", c.lr);
    keep("min-lr", c.min_lr);
    keep("weight-decay", c.weight_decay);
    if (c.warmup < 0 && saved.find("warmup") && saved.at("warmup").is_number()) c.warmup = saved.at("warmup").as_int();
    keep("galore-scale", c.galore_scale);
  }
  if (c.galore_scale < 0) c.galore_scale = 1.0;
  // Model, memory, optimizer: everything is reserved here, before step 1.
  if (const char* busy = std::getenv("OOMLESS_WAIT_CHOSEN"))
    say("oomless train: %s CPUs were busy with other work at start: waiting threads sleep (OMP_WAIT_POLICY=passive; "
        "set OMP_WAIT_POLICY to choose)\n", busy);
  say("oomless train: opening %s\n", c.model.c_str());
  bool pretrained = false;
  try {  // every OutOfBudget of setup becomes one error with the run's memory and what to change
  // The folder of the spill files (--act-offload, --optim-state and --kv-offload disk): --spill-dir, or the run
  // folder, made when a spill file needs it.
  auto spill_folder = [&](const char* flag) {
    if (!c.spill_dir.empty()) return c.spill_dir;
    OOM_CHECK(!out.empty(), "[train] ", flag, " disk needs a folder for its file: give --spill-dir DIR or --out DIR");
    fs::create_directories(out);
    return out;
  };
  EngineOptions eo = engine_options(c);
  if (c.act_offload.find("disk") != std::string::npos) eo.spill_dir = spill_folder("--act-offload");
  // --zero 3 over several ranks: this rank keeps its share of the layers' tensors (the owners --zero 1 and 2 give
  // the optimizer state), and the embedding, final norm and head whole. In an adapter run, its share of the frozen
  // base's layer tensors (an f32 base: load_base refuses a quantised one), the adapters whole.
  s.zero3 = c.zero >= 3 && dist::distributed() && c.lora == 0;
  const bool base_sharded = c.zero >= 3 && dist::distributed() && c.lora > 0;
  OOM_CHECK(!base_sharded || !c.dora, "[train] --zero 3 with --dora: DoRA's magnitudes are set from every layer's "
            "base weights, which --zero 3 spreads over the ranks; use --zero 1 with --dora, or LoRA with --zero 3");
  s.copies = eo.gathered_copies;
  s.gathered_in.assign(static_cast<size_t>(s.copies), -1);
  s.wire.resize(static_cast<size_t>(s.copies));
  if (s.zero3 || base_sharded)
    eo.held = [](const std::vector<ParamSpec>& specs) {
      std::vector<bool> held;
      for (int o : spec_owners(specs)) held.push_back(o == dist::rank());
      return held;
    };
  // What the run will hold, in closed form before anything is allocated (train/estimate.h); setup below
  // reports what it then holds. An estimate that cannot be made is left out: setup names what is wrong.
  try {
    TrainConfig ec = c;
    if (ec.spill_dir.empty() && (c.kv_offload == "disk" || c.act_offload.find("disk") != std::string::npos ||
                                 c.optim_state == "disk"))
      ec.spill_dir = out.empty() ? "." : out;
    const MemoryEstimate est = estimate_training(ec);
    say("oomless train: estimate: peak %s (%s)\n", format_bytes(est.ram_peak()).c_str(), est.line().c_str());
  } catch (const Error&) {
  }
  s.e = build_engine(eo);
  Model& model = *s.e.model;
  const ModelConfig& cfg = s.e.src.cfg;
  pretrained = s.e.src.kind == "hf" || s.e.src.kind == "gguf";

  resolve_defaults(c, pretrained);
  OOM_CHECK(std::isfinite(c.lr) && std::isfinite(c.min_lr) && c.min_lr <= c.lr, "[train] --min-lr ", c.min_lr,
            " is above --lr ", c.lr, ": the schedule decays from --lr down to --min-lr (default 0.1 x --lr); lower "
            "--min-lr or leave it out");
  say("oomless train: model %s (%s): %lld layers, width %lld, vocabulary %lld, %s parameters\n", c.model.c_str(),
      kind_words(s.e.src.kind), static_cast<long long>(cfg.L), static_cast<long long>(cfg.E),
      static_cast<long long>(cfg.V), format_count(cfg.param_count()).c_str());
  if (c.seq > cfg.max_position && c.rope_scaling.empty())
    say("oomless train: warning: --seq %lld is past the model's max_position_embeddings (%lld): positions beyond "
        "it were never trained; --rope-scaling yarn:F (or linear:F) stretches its RoPE to F times its context\n",
        static_cast<long long>(c.seq), static_cast<long long>(cfg.max_position));
  // --zero 2 over several ranks: one layer's gradients at a time here; each is summed into its owner's buffer as
  // backward finishes it.
  s.zero2 = c.zero >= 2 && dist::distributed() && !s.e.adapters;
  OOM_CHECK(c.zero != 2 || !dist::distributed() || !s.e.adapters, "[train] --zero 2 shards the base model's gradients, "
            "and an adapter run has none (its own are small, and --zero 1 sums each into its owner): use --zero 1 "
            "with --lora, or --zero 3 to shard the frozen base's layer weights as well");
  if ((c.step_in_backward || s.zero2) && !s.e.adapters) model.share_layer_grads();
  // --zero 2 with --chunk: each chunk's layer gradients summed into their owners as that chunk's backward finishes
  // the layer (the owners' buffers add the chunks up), so one layer's are kept over chunks too.
  model.hook_every_chunk(s.zero2 && c.chunk > 0);
  s.trained = model.trainable();
  for (size_t i = 0; i < s.trained.size(); ++i) s.groups[s.trained[i].group].push_back(i);
  // ZeRO stage 1: this rank's optimizer covers its share of the tensors only.
  {
    std::vector<int64_t> sizes;
    for (const Trainable& t : s.trained) sizes.push_back(t.param.numel());
    s.owner = c.zero >= 1 ? dist::owners(sizes, dist::size()) : std::vector<int>(s.trained.size(), dist::rank());
    s.owned_at.assign(s.trained.size(), -1);
    for (size_t i = 0; i < s.trained.size(); ++i)
      if (s.owner[i] == dist::rank()) {
        s.owned_at[i] = static_cast<int64_t>(s.owned.size());
        s.owned.push_back(s.trained[i]);
      }
    OOM_CHECK(!s.owned.empty() || c.zero == 0, "[train] --zero ", c.zero, " over ", dist::size(), " ranks leaves rank ",
              dist::rank(), " no tensor of the ", s.trained.size(), " trained: use fewer ranks, or --zero 0");
    if (s.zero2) {  // the owned layer tensors' gradients, whole, in a buffer of this rank's (others: the model's)
      int64_t total = 0;
      for (const Trainable& t : s.owned)
        if (is_layer_group(t.group)) total += t.param.numel();
      s.owned_grads = s.e.mem->device.alloc(sizeof(float) * static_cast<size_t>(total), Category::grads,
                                            "--zero 2 gradients of this rank's tensors");
      float* g = s.owned_grads.as<float>();
      for (Trainable& t : s.owned) {
        if (!is_layer_group(t.group)) continue;
        Tensor v = t.param;
        v.data = g;
        v.tier = Tier::Device;
        t.grad = v;
        g += t.param.numel();
      }
      s.e.ops->zero(s.owned_grads.view(DType::u8, {static_cast<int64_t>(s.owned_grads.size())}));
    }
  }
  {
    const AdamWSettings adam{c.lr, c.beta1, c.beta2, c.eps, c.weight_decay};
    const GaLoreSettings galore{c.galore_rank > 0 ? c.galore_rank : std::max<int64_t>(cfg.E / 4, 1), c.galore_gap,
                                c.galore_scale, false, c.galore_refresh == "staggered"};
    if (c.optim_state == "disk") {
      const std::string dir = spill_folder("--optim-state");
      s.opt = std::make_unique<DiskState>(
          s.owned,
          [name = c.optim, adam, galore](const TrainableSet& one, Arena& arena) {
            return make_optimizer(name, one, arena, adam, galore);
          },
          // AdamW and AdamW8bit update element by element (in whole blocks); GaLore projects its matrices whole
          [galore_run = c.optim.rfind("galore", 0) == 0](const Trainable& t) { return !galore_run || !galore_projects(t); },
          dir, s.e.mem->device);
    } else {
      if (c.optim_state == "device") {
        s.opt = make_optimizer(c.optim, s.owned, s.e.mem->device, adam, galore);
      } else {  // state in host memory: the optimizer runs on the host (optim/host_placed.h)
        s.opt = std::make_unique<HostPlaced>(make_optimizer(c.optim, s.owned, s.e.mem->host, adam, galore),
                                             *s.e.host_ops);
      }
    }
  }
  say("oomless train: %s trainable parameters (%s)%s%s%s\n", format_count(trainable_params()).c_str(),
      format_bytes(static_cast<size_t>(trainable_bytes())).c_str(), s.e.adapters ? "; frozen base " : "",
      s.e.adapters ? format_count(frozen_params()).c_str() : "",
      s.e.adapters ? (" (" + format_bytes(static_cast<size_t>(frozen_bytes())) + " as held)").c_str() : "");
  // Chunk-recurrent mode: activations for one chunk, K/V of earlier chunks in a paged store.
  s.C = c.chunk > 0 ? std::min(c.chunk, c.seq) : 0;
  const int64_t C = s.C;
  OOM_CHECK(c.sparse_pages == 0 || C > 0 || c.context_parallel > 1, "[train] --sparse-pages ", c.sparse_pages,
            " needs --chunk C: page-sparse attention selects among the pages of chunk-recurrent training's K/V store "
            "(or, with --context-parallel, among the earlier ranks' slices)");
  {
    if (c.context_parallel > 1) {
      model.reserve(c.seq / c.context_parallel, true, true);
      s.ring = std::make_unique<RingKv>(kv_dims(cfg), *s.e.ops, s.e.mem->device, s.e.mem->host,
                                        static_cast<int>(c.context_parallel), ring_options(c));
    } else if (C > 0) {
      PagedKvOptions ko;
      ko.C = C;
      ko.P = c.page > 0 ? c.page : default_page(C);
      OOM_CHECK(ko.P > 0, "[train] --chunk ", C, " has no divisor from 8 to 64 for the K/V page: give --page P (a "
                "divisor of --chunk) or a --chunk that is a multiple of 64");
      ko.offload = parse_kv_offload(c.kv_offload);
      if (ko.offload == KvOffload::disk) ko.spill_dir = spill_folder("--kv-offload");
      ko.sparse_pages = c.sparse_pages;
      ko.sink_pages = c.sink_pages;
      ko.summary = parse_page_summary(c.page_summary);
      ko.kv_dtype = c.kv_dtype == "bf16" ? DType::bf16 : c.kv_dtype == "fp8" ? DType::f8_e4m3 : DType::f32;
      model.reserve(C, true, true);
      s.kv = std::make_unique<PagedKvStore>(kv_dims(cfg), *s.e.ops, s.e.mem->device, s.e.mem->host, ko, c.seq, true);
    } else {
      model.reserve(c.seq, true);
    }
    // A dry forward + backward on zeros before step 1: the kernels' workspaces (GEMM packing, cross-entropy
    // chunks) are taken from the arena on first use, so a budget too small for them fails here, at setup,
    // not in the middle of the run. Chunk-recurrent: two chunks suffice (a chunk with history; every call
    // of a longer sequence has the same shapes or smaller ones, and the store reserved its pages for
    // --seq already), so the dry run does not cost a whole long step.
    const int64_t dry_T = s.kv ? std::min<int64_t>(c.seq, 2 * C) : c.seq;
    say("oomless train: setup: one dry forward + backward of %lld tokens to reserve every workspace...\n",
        static_cast<long long>(dry_T));
    std::vector<int32_t> zeros(static_cast<size_t>(dry_T), 0);
    const Tensor z(zeros.data(), DType::i32, {dry_T});
    if (s.ring) {
      const int64_t Tl = c.seq / c.context_parallel;
      model.chunked_step(Tensor(zeros.data(), DType::i32, {Tl}), Tensor(zeros.data(), DType::i32, {Tl}), Tl, *s.ring,
                         0.0, s.ring->first(c.seq), s.ring->second(c.seq));
    } else if (s.kv) {
      model.chunked_step(z, z, C, *s.kv, 0.0);
    } else {
      model.forward(z, z, true, 0.0);  // the training step's path, so its workspaces are the ones reserved
      model.backward(0.0);
    }
    model.zero_grads();
    if (ActStorage* as = model.act_storage()) as->reset();  // the dry run's zeros are no scaling history
  }
  } catch (const OutOfBudget& e) {
    out_of_budget(c, e.what(), s.e.mem ? &s.e.mem->ledger : nullptr);
  }
  if (dist::distributed()) {
    int64_t most = 0;
    for (const auto& t : s.trained) {
      OOM_CHECK(t.grad.dtype == DType::f32, "[train] data parallel sums f32 gradients; ", t.name, "'s is ",
                dtype_name(t.grad.dtype));
      most = std::max(most, t.grad.numel());
    }
    s.dp_bucket = std::min<int64_t>(most, dist::kSumBucket);
    const size_t bytes = sizeof(float) * static_cast<size_t>(2 * s.dp_bucket + dist::size());
    try {
      s.dp_stage = s.e.mem->host.alloc(bytes, Category::workspace, "data-parallel gradient sum");
    } catch (const OutOfBudget& e) {
      out_of_budget(c, e.what(), &s.e.mem->ledger);
    }
  }
  // --zero 3 under bf16 compute: the layers' projection weights travel in bf16 (State::wire).
  const bool half_wire = parse_compute_dtype(c.dtype) == ComputeDType::bf16;
  if (s.zero3) {
    // Each tensor's owner is the rank that loaded it into its own storage: the optimizer's owner (dist::owners
    // over the same sizes in the same order).
    s.layer_tensors.assign(static_cast<size_t>(s.e.src.cfg.L), {});
    for (size_t i = 0; i < s.trained.size(); ++i) {
      const bool here = s.e.gathered.size() == 0 || !in_buffer(s.trained[i].param, s.e.gathered);
      OOM_CHECK(!is_layer_group(s.trained[i].group) || (s.owner[i] == dist::rank()) == here,
                "[train] internal: --zero 3 placed ", s.trained[i].name, " against its owner");
      if (is_layer_group(s.trained[i].group))
        s.layer_tensors[static_cast<size_t>(s.trained[i].group)].push_back(
            {s.trained[i].param, s.owner[i], half_wire && is_projection_weight(s.trained[i].name) ? 0 : -1});
    }
  } else if (c.zero >= 3 && dist::distributed()) {  // an adapter run: the frozen base's layer tensors
    const std::vector<ParamSpec> specs = param_specs(s.e.src.cfg);
    const std::vector<int> own = spec_owners(specs);  // as `held` was given to load_base
    s.layer_tensors.assign(static_cast<size_t>(s.e.src.cfg.L), {});
    for (size_t i = 0; i < specs.size(); ++i) {
      const int64_t l = layer_of_name(specs[i].name);
      if (l < 0) continue;
      const Tensor* t = s.e.params->find(specs[i].name);
      OOM_CHECK(t && t->data && t->dtype == DType::f32 && (own[i] == dist::rank()) == !in_buffer(*t, s.e.gathered),
                "[train] internal: --zero 3 placed the base's ", specs[i].name, " against its owner");
      s.layer_tensors[static_cast<size_t>(l)].push_back(
          {*t, own[i], half_wire && is_projection_weight(specs[i].name) ? 0 : -1});
    }
  }
  if (!s.layer_tensors.empty()) {
    // The bf16 tensors' places in a layer's wire buffer (the same in every layer), one buffer a gathered copy (none
    // under f32 compute).
    size_t wire = 0;
    for (std::vector<Trainer::State::LayerTensor>& layer : s.layer_tensors) {
      size_t at = 0;
      for (Trainer::State::LayerTensor& x : layer) {
        if (x.half_at < 0) continue;
        x.half_at = static_cast<int64_t>(at);
        at += (static_cast<size_t>(x.t.numel()) * 2 + 63) / 64 * 64;
      }
      wire = std::max(wire, at);
    }
    for (int k = 0; k < s.copies && wire > 0; ++k) {
      try {
        s.wire[static_cast<size_t>(k)] = s.e.mem->device.alloc(wire, Category::workspace, "ZeRO-3 bf16 wire");
      } catch (const OutOfBudget& e) {
        out_of_budget(c, e.what(), &s.e.mem->ledger);
      }
    }
    // The setup's dry run above read whatever the gathered layers held (the last loaded): only their shapes count.
    s.e.model->on_layer_weights([&s](int64_t l) { gather_layer(s, l); });
  }
  const ModelConfig& cfg = s.e.src.cfg;
  {
    const Ledger& l = s.e.mem->ledger;
    const size_t peak = l.peak_total(Tier::Device) + l.peak_total(Tier::Host);
    say("oomless train: memory after setup: peak %s%s%s (%s)\n", format_bytes(peak).c_str(),
        c.budget.empty() ? "" : " of --budget ", c.budget.empty() ? "" : c.budget.c_str(), ledger_line(l).c_str());
  }
  OOM_CHECK(cfg.eos_id.has_value(), "[train] ", c.model, " names no end-of-sequence token (eos_token_id); packing "
            "needs one between documents");
  cfg.check_sequence(c.seq);

  const ModelSource& src = s.e.src;
  const int64_t seqs_per_step = c.batch * c.grad_accum;
  if (!c.data.empty()) {
    std::vector<std::string> paths;
    for (size_t i = 0; i <= c.data.size();) {
      size_t j = c.data.find(',', i);
      if (j == std::string::npos) j = c.data.size();
      if (j > i) paths.push_back(c.data.substr(i, j - i));
      i = j + 1;
    }
    DatasetOptions dopt;
    dopt.paths = paths;
    dopt.T = c.seq;
    dopt.seed = c.seed;
    dopt.eos_id = *cfg.eos_id;
    dopt.vocab = cfg.V;
    dopt.truncation = parse_truncation(c.truncation);
    s.data = std::make_unique<Dataset>(dopt, src.tokenizer ? &*src.tokenizer : nullptr, src.tokenizer_config);
    // One pass over a second reader counts the first epoch: its sequences (for --epochs and the steps per
    // epoch) and supervised targets (none: nothing would train). Documents are tokenized as they stream by;
    // nothing is kept.
    // A large corpus with --steps given is not counted (a pass tokenizes all of it).
    uintmax_t bytes = 0;
    for (const std::string& p : paths) {
      std::error_code ec;
      if (fs::is_regular_file(p, ec)) bytes += fs::file_size(p, ec);
      else if (fs::is_directory(p, ec))
        for (const auto& f : fs::recursive_directory_iterator(p, ec))
          if (f.is_regular_file(ec)) bytes += f.file_size(ec);
    }
    const bool count = c.steps == 0 || bytes <= (uintmax_t{256} << 20);
    int64_t per_epoch = 0, supervised = 0;
    if (count) {
      say("oomless train: reading the data (%lld document%s, %s)...\n", static_cast<long long>(s.data->documents()),
          s.data->documents() == 1 ? "" : "s",
          format_bytes(static_cast<size_t>(bytes)).c_str());
      Dataset counter(dopt, src.tokenizer ? &*src.tokenizer : nullptr, src.tokenizer_config);
      std::vector<int32_t> ia(static_cast<size_t>(c.seq)), ib(static_cast<size_t>(c.seq));
      while (counter.next(ia.data(), ib.data()) == 0) {
        ++per_epoch;
        for (int32_t t : ib) supervised += t >= 0;
      }
      OOM_CHECK(supervised > 0, "[train] ", c.data, " has no supervised token in an epoch (", per_epoch,
                " sequences): chat data needs assistant turns, text needs more than one token");
      if (counter.long_documents() > 0)
        say("oomless train: %lld conversation%s longer than --seq %lld: %s (--truncation split|drop|error)\n",
            static_cast<long long>(counter.long_documents()), counter.long_documents() == 1 ? " is" : "s are",
            static_cast<long long>(c.seq),
            c.truncation == "drop" ? "dropped" : "split across sequences, later pieces training without the start of "
                                                 "their prompt");
    }
    s.per_epoch = per_epoch;
    const double steps_per_epoch = static_cast<double>(per_epoch) / static_cast<double>(seqs_per_step);
    s.total = c.steps;
    if (s.total == 0) {
      const double ep = c.epochs > 0 ? c.epochs : 1.0;
      s.total = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(ep * std::max(steps_per_epoch, 1.0 / static_cast<double>(seqs_per_step)))));
    }
    if (!count)
      say("oomless train: data: %lld documents, %s (not counted with --steps given: a pass would tokenize all of "
          "it)\n", static_cast<long long>(s.data->documents()), format_bytes(static_cast<size_t>(bytes)).c_str());
    if (count)
    say("oomless train: data: %lld document%s; one epoch = %lld sequences of %lld tokens (%lld supervised targets) = "
        "%.1f steps of %lld x %lld sequences (%lld tokens a step); %lld step%s = %.2f epochs\n",
        static_cast<long long>(s.data->documents()), s.data->documents() == 1 ? "" : "s",
        static_cast<long long>(per_epoch), static_cast<long long>(c.seq),
        static_cast<long long>(supervised), steps_per_epoch, static_cast<long long>(c.batch),
        static_cast<long long>(c.grad_accum), static_cast<long long>(seqs_per_step * c.seq),
        static_cast<long long>(s.total), s.total == 1 ? "" : "s", static_cast<double>(s.total) / std::max(steps_per_epoch, 1e-300));
    if (count && per_epoch < seqs_per_step)
      say("oomless train: warning: the data holds %lld sequence%s of --seq %lld and a step takes %lld: each step "
          "repeats the data about %.0f times (lower --batch/--grad-accum or add data)\n",
          static_cast<long long>(per_epoch), per_epoch == 1 ? "" : "s", static_cast<long long>(c.seq),
          static_cast<long long>(seqs_per_step), static_cast<double>(seqs_per_step) / static_cast<double>(std::max<int64_t>(per_epoch, 1)));
  } else {
    OOM_CHECK(c.steps > 0, "[train] without --data the steps' sequences come from the caller: give --steps N");
    s.total = c.steps;
  }
  const bool warmup_given = c.warmup >= 0;
  resolve_warmup(c, pretrained, s.total);
  if (c.warmup >= s.total && s.total > 1)
    say("oomless train: warning: %s %lld covers the whole run of %lld steps: the learning rate reaches --lr %g "
        "only at the last step (give a smaller --warmup)\n", warmup_given ? "--warmup" : "the default warmup",
        static_cast<long long>(c.warmup), static_cast<long long>(s.total), c.lr);
  // A warmup longer than the run covers the whole run.
  s.sched = ScheduleSettings{c.schedule, c.lr, c.min_lr, std::min(c.warmup, s.total), s.total};
  validate(s.sched);
  say("oomless train: schedule: lr %g (%s), warmup %lld step%s, %s down to %g; weight decay %g\n", c.lr,
      cfg_in.lr > 0 ? "given" : c.resume ? "the saved run's" : pretrained ? "fine-tuning default" : "random-init default",
      static_cast<long long>(std::min(c.warmup, s.total)), std::min(c.warmup, s.total) == 1 ? "" : "s",
      c.schedule.c_str(), c.min_lr, c.weight_decay);

  // Resume: the newest checkpoint that verifies.
  if (resumed) {
    auto warn = [](const std::string& w) { std::fprintf(stderr, "oomless train: warning: %s\n", w.c_str()); };
    const SavedRun* ck = &*resumed;
    const json::Value& st = ck->state;
    const json::Value& saved = st.at("config");
    const json::Value now = c.to_json();
    TrainConfig older;  // settings a run saved by an older binary lacks: their defaults, resolved as above
    older.galore_scale = 1.0;
    const json::Value defaults = older.to_json();
    for (const TrainOption& opt : train_options()) {
      if (!opt.fixed_on_resume) continue;
      const char* k = opt.name;
      const json::Value& was = saved.find(k) ? saved.at(k) : defaults.at(k);
      OOM_CHECK(json::dump(was) == json::dump(now.at(k)), "[train] --resume: --", k, " was ", json::dump(was),
                " in the saved run and is ", json::dump(now.at(k)),
                " now; only steps, save, eval and keep settings may change on resume (--resume alone continues "
                "with the saved settings)");
    }
    if (st.at("threads").as_int() != get_threads() || st.at("isa").as_string() != detect_cpu().isa_summary() ||
        st.at("binary").as_string() != binary_id())
      warn("the thread count, CPU instruction set or binary differs from the saved run's: results may differ in the "
           "last bits from an uninterrupted run");
    OOM_CHECK(fs::exists(ck->path + "/optimizer.safetensors"), "[train] --resume: ", ck->path, " holds no optimizer "
              "state (it was saved with --save-optimizer no), so the run cannot continue from it; start a new run "
              "from its weights with ", s.e.adapters ? "--adapter " : "--model ", ck->path);
    bool rounded = false;
    if (s.e.adapters) {
      const SafetensorsFile af = SafetensorsFile::open(ck->path + "/" + kAdapterWeights);
      for (const StTensor& t : af.tensors()) rounded |= t.dtype == DType::bf16;
      load_adapter(*s.e.ops, ck->path, cfg, *s.e.adapters, *s.e.params);
    } else {
      rounded = read_tensors(*s.e.ops, SafetensorsFile::open(ck->path + "/model.safetensors"), model_state(s.e));
      if (s.zero3) stale_layers(s);
    }
    if (rounded)
      warn("the checkpoint's weights are bf16 (--save-dtype bf16): the run continues from the rounded weights, not "
           "bit-exactly as an uninterrupted run would");
    {
      std::optional<StateFileSubset> part;  // --zero 1: this rank's share of the run's state
      if (s.owned.size() < s.trained.size()) part.emplace();
      s.opt->load_state(*s.e.ops, SafetensorsFile::open(ck->path + "/optimizer.safetensors"));
    }
    OOM_CHECK(s.data, "[train] --resume needs the run's --data");
    s.data->restore(st.at("data"));
    s.step = st.at("step").as_int();
    s.nonfinite_total = st.at("nonfinite_total").as_int();
    if (st.find("prev_grad_norm") && st.at("prev_grad_norm").is_number()) s.prev_norm = st.at("prev_grad_norm").as_number();
    if (s.kv && s.kv->options().kv_dtype == DType::f8_e4m3) {
      OOM_CHECK(st.find("kv_amax"), "[train] --resume: ", ck->path, "/trainer_state.json has no fp8 amax history "
                "(kv_amax) for --kv-dtype fp8; the checkpoint is damaged or another run's");
      s.kv->restore_amax(st.at("kv_amax"));
    }
    if (ActStorage* as = s.e.model->act_storage(); as && as->storage() == DType::f8_e4m3) {
      OOM_CHECK(st.find("act_amax"), "[train] --resume: ", ck->path, "/trainer_state.json has no fp8 amax history "
                "(act_amax) for --act-dtype fp8; the checkpoint is damaged or another run's");
      as->restore_amax(st.at("act_amax"));
    }
    if (dist::rank() == 0) MetricsWriter::truncate_after(MetricsWriter::path_in(out), s.step);
    say("oomless train: resumed from %s (step %lld of %lld)\n", ck->path.c_str(), static_cast<long long>(s.step),
        static_cast<long long>(s.total));
  }

  // Held-out loss: the first (at most 32) windows of --eval-data, read once; .jsonl (chats) and folders
  // are packed as training packs them and scored on the targets training supervises.
  if (!c.eval_data.empty() && reads_as_documents(c.eval_data)) {
    DatasetOptions dopt;
    dopt.paths = {c.eval_data};
    dopt.T = c.seq;
    dopt.eos_id = *cfg.eos_id;
    dopt.vocab = cfg.V;
    dopt.truncation = parse_truncation(c.truncation);
    s.eval_seqs = document_sequences(dopt, src.tokenizer ? &*src.tokenizer : nullptr, src.tokenizer_config, 32);
    OOM_CHECK(s.eval_seqs.supervised() > 0, "[train] --eval-data ", c.eval_data, " has no supervised token (chat data needs "
              "assistant turns)");
  } else if (!c.eval_data.empty()) {
    s.eval_stream = is_ids_file(c.eval_data) ? read_ids_file(c.eval_data, cfg.V)
                                             : src.require_tokenizer().encode(read_text_file(c.eval_data), true);
    s.eval_stream.resize(std::min<size_t>(s.eval_stream.size(), static_cast<size_t>(32 * c.seq)));
    OOM_CHECK(static_cast<int64_t>(s.eval_stream.size()) >= c.seq, "[train] --eval-data ", c.eval_data,
              " holds fewer than --seq ", c.seq, " tokens");
  }
}

Trainer::~Trainer() = default;

const TrainConfig& Trainer::config() const { return s_->c; }
const std::string& Trainer::out() const { return s_->out; }
int64_t Trainer::steps_done() const { return s_->step; }
int64_t Trainer::total_steps() const { return s_->total; }
int64_t Trainer::nonfinite_in_a_row() const { return s_->nonfinite_run; }
int64_t Trainer::nonfinite_total() const { return s_->nonfinite_total; }
double Trainer::epochs_trained() const {
  if (s_->per_epoch <= 0) return NAN;
  return static_cast<double>(s_->step * s_->c.batch * s_->c.grad_accum) / static_cast<double>(s_->per_epoch);
}
Engine& Trainer::engine() { return s_->e; }
Optimizer* Trainer::optimizer() { return s_->opt.get(); }
PagedKvStore* Trainer::kv() { return s_->kv.get(); }
int64_t Trainer::chunk() const { return s_->C; }
int64_t Trainer::trainable_params() const { return trainable_numel(s_->trained); }
int64_t Trainer::trainable_bytes() const { return dtype_bytes(DType::f32, trainable_params()); }
int64_t Trainer::frozen_params() const { return s_->e.adapters ? s_->e.src.cfg.param_count() : 0; }
int64_t Trainer::frozen_bytes() const { return s_->e.adapters ? static_cast<int64_t>(s_->e.base_bytes()) : 0; }

StepBatch Trainer::next_batch() {
  State& s = *s_;
  OOM_CHECK(s.data, "[train] no --data to draw a step's sequences from");
  const size_t n = static_cast<size_t>(s.c.batch * s.c.grad_accum), T = static_cast<size_t>(s.c.seq);
  StepBatch b{std::vector<std::vector<int32_t>>(n, std::vector<int32_t>(T)), {}};
  b.targets = b.ids;
  for (size_t i = 0; i < n; ++i) s.data->next(b.ids[i].data(), b.targets[i].data());
  return b;
}

StepResult Trainer::step(const StepBatch& b, std::optional<double> lr_given) {
  State& s = *s_;
  const TrainConfig& c = s.c;
  Model& model = *s.e.model;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n = static_cast<int64_t>(b.ids.size());
  OOM_CHECK(n >= 1 && b.targets.size() == b.ids.size(), "[train] a step needs sequences and as many target rows");
  StepResult r;
  r.step = ++s.step;
  r.lr = lr_given ? *lr_given : lr_at(s.sched, r.step);
  // N, the step's supervised targets, before any backward.
  for (int64_t i = 0; i < n; ++i) {
    OOM_CHECK(static_cast<int64_t>(b.ids[static_cast<size_t>(i)].size()) == c.seq &&
                  b.targets[static_cast<size_t>(i)].size() == b.ids[static_cast<size_t>(i)].size(),
              "[train] every sequence of a step holds --seq ", c.seq, " ids and as many targets");
    for (int32_t t : b.targets[static_cast<size_t>(i)]) r.targets += t >= 0;
  }
  const int64_t N = r.targets;
  Ops& ops = *s.e.ops;
  const int64_t opt_step = r.step - s.nonfinite_total;  // Adam's step count: steps taken, skipped ones left out
  // |g|^2 of each trainable tensor, taken as backward finishes its gradient (Model::on_grads_final) and
  // summed in the set's order at the end: the clipping norm without a pass over the gradients after
  // backward, bit for bit global_grad_norm's.
  std::vector<double> sq(s.trained.size(), 0.0);
  std::vector<char> done(s.trained.size(), 0);
  const double clip_prev =
      c.clip > 0 && c.clip_norm == "previous" && std::isfinite(s.prev_norm) && s.prev_norm > c.clip
          ? c.clip / (s.prev_norm + 1e-6) : 1.0;
  bool halted = false;  // --step-in-backward: a non-finite loss or gradient stopped the stepping
  // The positions in the optimizer's set (this rank's tensors under --zero 1, else all) of trained tensors `which`.
  auto mine = [&](const std::vector<size_t>& which) {
    std::vector<size_t> own;
    for (size_t i : which)
      if (s.owned_at[i] >= 0) own.push_back(static_cast<size_t>(s.owned_at[i]));
    return own;
  };
  auto on_final = [&](int64_t g) {
    const auto it = s.groups.find(g);
    if (it == s.groups.end()) return;
    double part = 0;
    for (size_t i : it->second) part += sq[i] = ops.sum_squares(s.trained[i].grad), done[i] = 1;
    if (!c.step_in_backward) return;
    halted |= !std::isfinite(part);
    if (halted) return;
    if (clip_prev != 1.0)
      for (size_t i : it->second) ops.scale(s.trained[i].grad, clip_prev);
    s.opt->step_tensors(ops, s.owned, mine(it->second), r.lr, opt_step);
    for (size_t i : it->second) ops.fill(s.trained[i].grad, 0.0);
  };
  struct Disarm {
    Model& m;
    ~Disarm() { m.on_grads_final(nullptr); }
  } disarm{model};
  const Fp8Stats fp8_before = s.kv ? s.kv->fp8_stats() : Fp8Stats{};
  ActStorage* act_st = model.act_storage();
  const std::array<ActCounts, kActKinds> act_before = act_st ? act_st->counts() : std::array<ActCounts, kActKinds>{};
  // Several ranks (data parallel): this rank takes its share of the step's sequences, [i0, i1); every rank drew
  // the whole step (the same data stream), so N counts the step's targets on every rank alike.
  const bool dp = dist::distributed();
  // --context-parallel P: every rank of a group of P takes each of the group's sequences, its slice of it (Tl
  // tokens at r Tl for the group's rank r); the groups (ranks / P) share the step's sequences as data parallel.
  const bool cp = s.ring != nullptr;
  const int64_t Tl = c.seq / c.context_parallel, at = cp ? s.ring->first(c.seq) : 0;
  const int64_t groups = dist::size() / c.context_parallel, group = dist::rank() / c.context_parallel;
  const int64_t i0 = n * group / groups, i1 = n * (group + 1) / groups;
  // --zero 2: a group of gradients, final for this sequence, summed over the ranks into its tensors' owners'
  // buffers (+=), then zeroed for the next layer's backward. Every rank runs as many sequences, so the groups
  // come in the same order everywhere.
  const bool half_sums = c.grad_sum_dtype == "bf16";  // --grad-sum-dtype bf16: the ranks' sums in bf16 halves
  std::function<void(int64_t)> to_owners = [&](int64_t g) {
    const auto it = s.groups.find(g);
    if (it == s.groups.end() || !is_layer_group(g)) return;  // the embedding's, norm's, head's: summed at the end
    float* stage = s.dp_stage.as<float>();
    float* scratch = stage + s.dp_bucket;
    const int64_t piece = std::max<int64_t>(1, s.dp_bucket / dist::size());
    for (size_t i : it->second) {
      const Tensor& gr = s.trained[i].grad;
      const bool mine_t = s.owner[i] == dist::rank();
      for (int64_t o = 0, total = gr.numel(); o < total; o += piece) {
        const int64_t len = std::min(piece, total - o);
        ops.download(stage, Tensor(static_cast<float*>(gr.data) + o, DType::f32, {len}, gr.tier));
        dist::sum_floats_to(stage, len, scratch, s.owner[i], half_sums);
        if (!mine_t) continue;
        const Tensor& og = s.owned[static_cast<size_t>(s.owned_at[i])].grad;
        const Tensor dst(static_cast<float*>(og.data) + o, DType::f32, {len}, og.tier);
        ops.download(scratch, dst);
        for (int64_t j = 0; j < len; ++j) scratch[j] += stage[j];
        ops.upload(dst, scratch);
      }
      ops.fill(gr, 0.0);
    }
  };
  try {
    model.zero_grads();
    if (s.zero2) ops.zero(s.owned_grads.view(DType::u8, {static_cast<int64_t>(s.owned_grads.size())}));
    double loss_sum = 0;
    for (int64_t i = i0; i < i1 && N > 0; ++i) {
      const Tensor id_t(const_cast<int32_t*>(b.ids[static_cast<size_t>(i)].data()), DType::i32, {c.seq});
      const Tensor tg_t(const_cast<int32_t*>(b.targets[static_cast<size_t>(i)].data()), DType::i32, {c.seq});
      // LoRA dropout masks: one seed per (run seed, step, sequence), so a resumed run draws the same ones.
      model.set_dropout_seed((static_cast<uint64_t>(c.seed) * 0x9E3779B97F4A7C15ull) ^
                             (static_cast<uint64_t>(r.step) << 20) ^ static_cast<uint64_t>(i));
      if (i + 1 == n && !dp) model.on_grads_final(on_final);  // the last pass into the gradients (dp: after the sum)
      if (s.zero2) model.on_grads_final(to_owners);  // every pass: each group summed into its owners as it is final
      if (cp) {
        const int64_t t1 = s.ring->second(c.seq);
        std::vector<int32_t> pieces;  // zigzag: the two pieces side by side
        const int32_t* ids_at = b.ids[static_cast<size_t>(i)].data() + at;
        const int32_t* tg_at = b.targets[static_cast<size_t>(i)].data() + at;
        if (t1 >= 0) {
          const int64_t h = Tl / 2;
          const int32_t* id0 = b.ids[static_cast<size_t>(i)].data();
          const int32_t* tg0 = b.targets[static_cast<size_t>(i)].data();
          pieces.insert(pieces.end(), id0 + at, id0 + at + h);
          pieces.insert(pieces.end(), id0 + t1, id0 + t1 + h);
          pieces.insert(pieces.end(), tg0 + at, tg0 + at + h);
          pieces.insert(pieces.end(), tg0 + t1, tg0 + t1 + h);
          ids_at = pieces.data();
          tg_at = pieces.data() + Tl;
        }
        const Tensor ids_r(const_cast<int32_t*>(ids_at), DType::i32, {Tl});
        const Tensor tg_r(const_cast<int32_t*>(tg_at), DType::i32, {Tl});
        loss_sum += model.chunked_step(ids_r, tg_r, Tl, *s.ring, 1.0 / static_cast<double>(N), at, t1).loss_sum;
      } else if (s.kv) {
        loss_sum += model.chunked_step(id_t, tg_t, s.C, *s.kv, 1.0 / static_cast<double>(N)).loss_sum;
      } else {
        const double scale = 1.0 / static_cast<double>(N);
        CeResult ce = model.forward(id_t, tg_t, true, scale);
        halted |= c.step_in_backward && !std::isfinite(ce.loss_sum);
        model.backward(scale);
        loss_sum += ce.loss_sum;
      }
    }
    if (dp) {  // the ranks' losses and gradients summed, in rank order: the same on every rank
      const std::vector<double> parts = dist::all_f64(loss_sum);
      loss_sum = 0;
      for (double v : parts) loss_sum += v;
      float* stage = s.dp_stage.as<float>();
      // --zero 1: each gradient summed on its owner only (the others' copies are left as they are: no rank reads
      // them), in pieces whose N copies fit the scratch; the sum is the all-reduce's, bit for bit (rank order).
      const bool to_owner = c.zero >= 1;
      const int64_t piece = to_owner ? std::max<int64_t>(1, s.dp_bucket / dist::size()) : s.dp_bucket;
      for (size_t i = 0; i < s.trained.size(); ++i) {
        if (s.zero2 && is_layer_group(s.trained[i].group)) continue;  // --zero 2: summed during backward
        const Tensor& g = s.trained[i].grad;
        const bool owned = s.owner[i] == dist::rank();
        for (int64_t o = 0, total = g.numel(); o < total; o += piece) {
          const int64_t len = std::min(piece, total - o);
          const Tensor part(static_cast<float*>(g.data) + o, DType::f32, {len}, g.tier);
          ops.download(stage, part);
          if (to_owner)
            dist::sum_floats_to(stage, len, stage + s.dp_bucket, s.owner[i], half_sums);
          else
            dist::sum_floats(stage, len, stage + s.dp_bucket, half_sums);
          if (!to_owner || owned) ops.upload(part, stage);
        }
      }
      if (to_owner) {  // |g|^2 of each tensor from its owner, in the set's order on every rank
        std::vector<double> own;
        for (size_t i = 0; i < s.trained.size(); ++i)
          if (s.owner[i] == dist::rank()) own.push_back(ops.sum_squares(s.owned[static_cast<size_t>(s.owned_at[i])].grad));
        const std::vector<double> all = dist::all_doubles(own);
        size_t k = 0;
        for (int rk = 0; rk < dist::size(); ++rk)
          for (size_t i = 0; i < s.trained.size(); ++i)
            if (s.owner[i] == rk) sq[i] = all[k++], done[i] = 1;
      }
    }
    r.loss = N > 0 ? loss_sum / static_cast<double>(N) : 0.0;
    double sum = 0;
    for (size_t i = 0; i < s.trained.size(); ++i) sum += done[i] ? sq[i] : ops.sum_squares(s.trained[i].grad);
    r.grad_norm = std::sqrt(sum);
    r.skipped = !std::isfinite(r.loss) || !std::isfinite(r.grad_norm);
    if (r.skipped) {
      ++s.nonfinite_run, ++s.nonfinite_total;
    } else {
      s.nonfinite_run = 0;
      // Tensors backward has not stepped: all of them, or (--step-in-backward) those it never reached.
      std::vector<size_t> rest;
      for (size_t i = 0; i < s.trained.size(); ++i)
        if (!c.step_in_backward || !done[i]) rest.push_back(i);
      if (!rest.empty()) {
        const TrainableSet& grads = s.zero2 ? s.owned : s.trained;  // --zero 2: this rank's tensors' only
        if (c.clip > 0 && c.clip_norm == "current") {
          clip_grads(ops, grads, c.clip, r.grad_norm);
        } else if (clip_prev != 1.0) {
          for (size_t i : rest)
            if (!s.zero2 || s.owned_at[i] >= 0) ops.scale(s.zero2 ? s.owned[static_cast<size_t>(s.owned_at[i])].grad : s.trained[i].grad, clip_prev);
        }
        const std::vector<size_t> own = mine(rest);
        if (!own.empty()) s.opt->step_tensors(ops, s.owned, own, r.lr, opt_step);
        // --zero 1 and 2: each tensor's new values from the rank that stepped it (--zero 3: the layers' are sent
        // when a pass needs them).
        if (dp && c.zero >= 1)
          for (size_t i : rest)
            if (!s.zero3 || !is_layer_group(s.trained[i].group)) from_owner(s, i);
      }
      s.prev_norm = r.grad_norm;
    }
    if (s.zero3) stale_layers(s);  // --zero 3: the owners' tensors have stepped (a frozen base has not)
  } catch (const OutOfBudget& e) {
    // Setup reserves everything a step needs; reaching this is a bug in that reservation.
    fail("[train] ran out of memory budget at step ", r.step, ", after setup had reserved the run: ", e.what());
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.tokens_per_s = static_cast<double>(n * c.seq) / r.seconds;
  if (dp) {
    const Ledger& l = s.e.mem->ledger;
    json::Value peaks = json::Value::array(), sent = json::Value::array();
    for (uint64_t v : dist::all_u64(l.peak_total(Tier::Device) + l.peak_total(Tier::Host)))
      peaks.push_back(json::Value::integer(static_cast<int64_t>(v)));
    for (uint64_t v : dist::all_u64(dist::bytes_sent())) sent.push_back(json::Value::integer(static_cast<int64_t>(v)));
    r.ranks = json::Value::object();
    r.ranks.set("size", json::Value::integer(dist::size()));
    r.ranks.set("peak", peaks);
    r.ranks.set("bytes_sent", sent);
    for (Category cat : {Category::optimizer, Category::weights}) {  // each rank's peak of the category
      json::Value per = json::Value::array();
      size_t mine = 0;
      for (int t = 0; t < kTierCount; ++t) mine += l.peak(static_cast<Tier>(t), cat);
      for (uint64_t v : dist::all_u64(mine)) per.push_back(json::Value::integer(static_cast<int64_t>(v)));
      r.ranks.set(category_name(cat), per);
    }
  }
  if (s.kv && s.kv->options().kv_dtype == DType::f8_e4m3) {
    const Fp8Stats now = s.kv->fp8_stats();
    auto part = [](const Fp8Counts& a, const Fp8Counts& b) {
      json::Value o = json::Value::object();
      o.set("values", json::Value::integer(static_cast<int64_t>(a.values - b.values)));
      o.set("saturated", json::Value::integer(static_cast<int64_t>(a.saturated - b.saturated)));
      o.set("flushed", json::Value::integer(static_cast<int64_t>(a.flushed - b.flushed)));
      o.set("nonfinite_chunks", json::Value::integer(static_cast<int64_t>(a.nonfinite_chunks - b.nonfinite_chunks)));
      return o;
    };
    r.kv_fp8 = json::Value::object();
    r.kv_fp8.set("k", part(now.k, fp8_before.k));
    r.kv_fp8.set("v", part(now.v, fp8_before.v));
  }
  if (act_st && act_st->storage() == DType::f8_e4m3) {
    r.act_fp8 = json::Value::object();
    ActCounts total;
    auto entry = [](const ActCounts& c) {
      json::Value o = json::Value::object();
      o.set("values", json::Value::integer(static_cast<int64_t>(c.values)));
      o.set("saturated", json::Value::integer(static_cast<int64_t>(c.saturated)));
      o.set("flushed", json::Value::integer(static_cast<int64_t>(c.flushed)));
      o.set("nonfinite", json::Value::integer(static_cast<int64_t>(c.nonfinite)));
      return o;
    };
    for (int k = 0; k < kActKinds; ++k) {
      const ActCounts& a = act_st->counts()[static_cast<size_t>(k)];
      const ActCounts& b = act_before[static_cast<size_t>(k)];
      const ActCounts d{a.values - b.values, a.saturated - b.saturated, a.flushed - b.flushed, a.nonfinite - b.nonfinite};
      if (d.values == 0) continue;
      total.values += d.values, total.saturated += d.saturated, total.flushed += d.flushed, total.nonfinite += d.nonfinite;
      r.act_fp8.set(act_kind_name(static_cast<ActKind>(k)), entry(d));
    }
    r.act_fp8.set("all", entry(total));
  }
  return r;
}

std::optional<EvalResult> Trainer::evaluate() {
  State& s = *s_;
  if (s.ring) {  // context parallel: every rank scores its slice of each window; the sums over its group's ranks
    const int64_t Tl = s.c.seq / s.c.context_parallel;
    const EvalSlice slice{s.ring->first(s.c.seq), Tl, s.ring->second(s.c.seq)};
    if (s.eval_seqs.ids.empty() && s.eval_stream.empty()) return std::nullopt;
    EvalResult r = !s.eval_seqs.ids.empty()
                       ? evaluate_sequences(*s.e.model, s.eval_seqs.ids, s.eval_seqs.targets, s.ring.get(), 0, {}, slice)
                       : oomless::evaluate(*s.e.model, s.eval_stream, s.c.seq, false, s.ring.get(), 0, {}, slice);
    const std::vector<double> sums = dist::all_f64(r.loss_sum);
    const std::vector<uint64_t> counts = dist::all_u64(static_cast<uint64_t>(r.predictions));
    r.loss_sum = 0;
    r.predictions = 0;
    const size_t P = static_cast<size_t>(s.c.context_parallel), g0 = static_cast<size_t>(dist::rank()) / P * P;
    for (size_t k = g0; k < g0 + P; ++k) r.loss_sum += sums[k], r.predictions += static_cast<int64_t>(counts[k]);
    return r;
  }
  if (!s.eval_seqs.ids.empty()) return evaluate_sequences(*s.e.model, s.eval_seqs.ids, s.eval_seqs.targets, s.kv.get(), s.C);
  if (s.eval_stream.empty()) return std::nullopt;
  return oomless::evaluate(*s.e.model, s.eval_stream, s.c.seq, false, s.kv.get(), s.C);
}

std::string Trainer::save() {
  State& s = *s_;
  const ModelSource& src = s.e.src;
  std::vector<CheckpointFile> files;
  const bool bf16 = s.c.save_dtype == "bf16";
  s.opt_entries_of.assign(static_cast<size_t>(dist::size()), 0);
  if (s.e.adapters) {
    // A PEFT adapter folder: the base is unchanged, so only the adapter is written.
    files.push_back(tensors_file(*s.e.ops, kAdapterWeights, model_state(s.e), bf16));
    files.push_back({kAdapterConfig, adapter_config_text(s.e.adapters->settings(), s.c.model, src.cfg.tied), {}});
  } else if (s.zero3) {
    // --zero 3: the layers' tensors of other ranks read from their owners as the file is written (each serves its
    // optimizer entries, if sharded, then its layer tensors: serve_save).
    files.push_back({"model.safetensors", "", [&s, bf16](int fd) {
                       std::vector<int64_t> next = s.opt_entries_of;  // each rank's first layer tensor entry
                       std::vector<StWrite> w;
                       for (size_t i = 0; i < s.trained.size(); ++i) {
                         const Trainable& t = s.trained[i];
                         const int r = s.owner[i];
                         if (r == 0 || !is_layer_group(t.group)) {
                           w.push_back(tensor_entry(*s.e.ops, t.name, t.param, bf16));
                           continue;
                         }
                         StWrite e{t.name, bf16 ? DType::bf16 : DType::f32, {}, nullptr, {}};
                         for (int d = 0; d < t.param.ndim; ++d) e.shape.push_back(t.param.dims[d]);
                         e.read = [r, k = next[static_cast<size_t>(r)]++](void* dst, size_t off, size_t n) {
                           dist::read_remote(r, k, dst, off, n);
                         };
                         w.push_back(std::move(e));
                       }
                       write_safetensors_stream(w, {{"format", "pt"}},
                                                [fd](const void* d, size_t n) { checkpoint_write(fd, d, n); },
                                                "model.safetensors");
                     }});
    files.push_back({"config.json", json::dump(src.cfg.to_json(), 2) + "\n", {}});
    files.push_back({"generation_config.json", json::dump(generation_config(src), 2) + "\n", {}});
  } else {
    files.push_back(tensors_file(*s.e.ops, "model.safetensors", model_state(s.e), bf16));
    files.push_back({"config.json", json::dump(src.cfg.to_json(), 2) + "\n", {}});
    files.push_back({"generation_config.json", json::dump(generation_config(src), 2) + "\n", {}});
  }
  const bool sharded = s.owned.size() < s.trained.size() && s.c.save_optimizer == "yes";
  if (s.c.save_optimizer == "yes") {
    std::vector<StWrite> entries = s.opt->state_entries(*s.e.ops);
    if (sharded) {  // --zero 1: every rank's part in the one file, the others' read from them as it is written
      const std::vector<std::string> lists = dist::gather_strings(entries_json(entries));
      for (size_t r = 1; r < lists.size(); ++r) {
        const json::Value list = json::parse(lists[r]);
        s.opt_entries_of[r] = static_cast<int64_t>(list.size());
        for (size_t k = 0; k < list.size(); ++k) {
          const json::Value& e = list[k];
          StWrite w{e.at("name").as_string(), static_cast<DType>(e.at("dtype").as_int()), {}, nullptr, {}};
          for (size_t d = 0; d < e.at("shape").size(); ++d) w.shape.push_back(e.at("shape")[d].as_int());
          w.read = [r, k](void* dst, size_t off, size_t n) {
            dist::read_remote(static_cast<int>(r), static_cast<int64_t>(k), dst, off, n);
          };
          entries.push_back(std::move(w));
        }
      }
    }
    files.push_back(state_file("optimizer.safetensors", std::move(entries)));
  }
  if (src.tokenizer_json.size()) files.push_back({"tokenizer.json", src.tokenizer_json, {}});
  if (!src.tokenizer_config.is_null()) files.push_back({"tokenizer_config.json", json::dump(src.tokenizer_config, 2) + "\n", {}});
  json::Value st = json::Value::object();
  st.set("step", json::Value::integer(s.step));
  st.set("total_steps", json::Value::integer(s.total));
  st.set("nonfinite_total", json::Value::integer(s.nonfinite_total));
  if (std::isfinite(s.prev_norm)) st.set("prev_grad_norm", json::Value::number(s.prev_norm));
  if (s.kv && s.kv->options().kv_dtype == DType::f8_e4m3) st.set("kv_amax", s.kv->amax_state());
  if (ActStorage* as = s.e.model->act_storage(); as && as->storage() == DType::f8_e4m3)
    st.set("act_amax", as->amax_state());
  st.set("data", s.data ? s.data->state() : json::Value());
  st.set("config", s.c.to_json());
  st.set("threads", json::Value::integer(get_threads()));
  st.set("isa", json::Value::string(detect_cpu().isa_summary()));
  st.set("binary", json::Value::string(binary_id()));
  st.set("lr", json::Value::number(lr_at(s.sched, std::max<int64_t>(s.step, 1))));
  files.push_back({"trainer_state.json", json::dump(st, 2) + "\n", {}});
  const std::string path = save_checkpoint(s.out, s.step, files, {static_cast<int>(s.c.keep)});
  if (sharded || s.zero3) dist::end_reads();
  return path;
}

void Trainer::serve_save() {
  State& s = *s_;
  const bool sharded = s.owned.size() < s.trained.size() && s.c.save_optimizer == "yes";
  if (!sharded && !s.zero3) return;
  std::vector<StWrite> entries;
  if (sharded) {
    entries = s.opt->state_entries(*s.e.ops);
    dist::gather_strings(entries_json(entries));
  }
  if (s.zero3)  // then this rank's layer tensors, in the trained order (as rank 0 asks for them)
    for (size_t i = 0; i < s.trained.size(); ++i)
      if (s.owner[i] == dist::rank() && is_layer_group(s.trained[i].group))
        entries.push_back(tensor_entry(*s.e.ops, s.trained[i].name, s.trained[i].param, s.c.save_dtype == "bf16"));
  dist::serve_reads([&](int64_t k, void* dst, size_t off, size_t n) {
    const StWrite& e = entries[static_cast<size_t>(k)];
    e.read(dst, off, n);  // every in-memory entry reads through Ops (tensor_entry)
  });
}

namespace {

bool ends_with_jsonl(const std::string& p) { return p.size() >= 6 && p.compare(p.size() - 6, 6, ".jsonl") == 0; }

// The messages of a .jsonl file's first conversation up to and including its first user turn (empty when
// the first line is not a conversation with one).
std::vector<ChatMessage> first_user_turn(const std::string& path) {
  std::vector<ChatMessage> conv;
  try {
    conv = read_first_conversation(path);
  } catch (const Error&) {
    return {};  // not a conversation: the sample is prompted with text
  }
  for (size_t i = 0; i < conv.size(); ++i)
    if (conv[i].role == "user") return std::vector<ChatMessage>(conv.begin(), conv.begin() + static_cast<std::ptrdiff_t>(i) + 1);
  return {};
}

// The first n words of a text file (or of a .jsonl's first "text"), for the end-of-run sample's prompt.
std::string first_words(const std::string& path, int n) {
  std::string text;
  if (is_ids_file(path)) return "";
  try {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) return "";
    char buf[4096];
    const size_t got = std::fread(buf, 1, sizeof buf, f);
    std::fclose(f);
    text.assign(buf, got);
    if (ends_with_jsonl(path)) {
      const json::Value v = json::parse(text.substr(0, text.find('\n')), path);
      text = v.is_object() && v.find("text") && v.at("text").is_string() ? v.at("text").as_string() : "";
    }
  } catch (const Error&) {
    return "";
  }
  std::string out;
  int words = 0;
  for (size_t i = 0; i < text.size() && words < n;) {
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
    const size_t j = i;
    while (i < text.size() && !std::isspace(static_cast<unsigned char>(text[i]))) ++i;
    if (i > j) out += (out.empty() ? "" : " ") + text.substr(j, i - j), ++words;
  }
  return out;
}

int train_run(const TrainConfig& c, const std::string& out, const json::Value& plan) {
  // Several ranks: rank 0 speaks, evaluates and writes the run folder; the others train their share of each step.
  const bool writer = dist::rank() == 0;
  Trainer tr(c, out, writer ? stderr : nullptr);
  Engine& e = tr.engine();
  const int64_t total = tr.total_steps();
  std::optional<MetricsWriter> metrics;
  if (writer) metrics.emplace(out);
  if (writer) metrics->set_params(tr.trainable_params(), tr.trainable_bytes(), tr.frozen_params(), tr.frozen_bytes());
  // Context parallel: every rank scores its slice; --zero 3: every rank runs the evaluation (the layers' weights
  // come from all of them), rank 0 reports it.
  const bool all_evaluate = c.context_parallel > 1 || (c.zero >= 3 && dist::distributed());
  auto run_eval = [&](int64_t s) {
    if (!writer && !all_evaluate) return;
    const std::optional<EvalResult> r = tr.evaluate();
    if (!r || !writer) return;
    metrics->write_eval(s, r->loss(), std::exp(r->loss()));
    std::fprintf(stderr, "%seval at step %lld: loss %.4f  ppl %.2f\n", isatty(2) ? "\n" : "", static_cast<long long>(s),
                 r->loss(), std::exp(r->loss()));
  };
  auto save = [&]() {  // every rank: rank 0 writes, the others send their part of a sharded optimizer state
    if (writer)
      std::fprintf(stderr, "oomless train: saved %s\n", tr.save().c_str());
    else
      tr.serve_save();
  };

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::FILE* dump = c.dump_tokens.empty() || !writer ? nullptr : std::fopen(c.dump_tokens.c_str(), c.resume ? "ab" : "wb");
  OOM_CHECK(c.dump_tokens.empty() || !writer || dump, "[train] cannot write --dump-tokens ", c.dump_tokens, ": ", std::strerror(errno));
  const bool tty = isatty(2);
  double last_loss = 0;
  auto t_start = std::chrono::steady_clock::now();
  const int64_t first = tr.steps_done();
  // A signal reaches the ranks at different moments: they stop together, at the first step boundary where any
  // has seen it.
  auto stopping = [&]() { return dist::distributed() ? dist::any(g_stop != 0) : g_stop != 0; };
  bool stopped = false;
  while (tr.steps_done() < total && !(stopped = stopping())) {
    const StepBatch b = tr.next_batch();
    if (dump) std::fputs((dump_line(tr.steps_done() + 1, b.ids, b.targets) + "\n").c_str(), dump);
    const StepResult r = tr.step(b);
    const int64_t step = r.step;
    if (r.skipped && writer) {
      std::fprintf(stderr, "oomless train: step %lld skipped: non-finite %s (%lld in a row, %lld in all)\n",
                   static_cast<long long>(step), std::isfinite(r.loss) ? "gradients" : "loss",
                   static_cast<long long>(tr.nonfinite_in_a_row()), static_cast<long long>(tr.nonfinite_total()));
    }
    if (!r.skipped) last_loss = r.loss;
    if (writer)
      metrics->write_step(step, r.loss, r.lr, r.grad_norm, r.tokens_per_s, r.skipped, e.mem->ledger, r.kv_fp8, r.act_fp8,
                          r.ranks);
    OOM_CHECK(tr.nonfinite_in_a_row() <= c.max_nonfinite, "[train] ", tr.nonfinite_in_a_row(),
              " steps in a row had a non-finite loss or gradient (more than --max-nonfinite ", c.max_nonfinite,
              "); lower --lr, check the data, or use fp32; the last checkpoint is in ", out);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    const double eta = elapsed / static_cast<double>(step - first) * static_cast<double>(total - step);
    if (writer) std::fprintf(stderr, tty ? "\rstep %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  ETA %.0fs  memory peak %s   "
                             : "step %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  ETA %.0fs  memory peak %s\n",
                 static_cast<long long>(step), static_cast<long long>(total), r.loss, r.lr, r.tokens_per_s, eta,
                 format_bytes(e.mem->ledger.peak_total(Tier::Device) + e.mem->ledger.peak_total(Tier::Host)).c_str());
    if (c.eval_every > 0 && step % c.eval_every == 0 && step < total) run_eval(step);
    if (c.save_every > 0 && step % c.save_every == 0 && step < total) save();
  }
  const int64_t step = tr.steps_done();
  // Context parallel, --zero 3: the final evaluation takes every rank, unless the ranks stopped.
  const bool final_eval = all_evaluate ? !stopped : !g_stop;
  if (!writer) {
    if (all_evaluate && final_eval) run_eval(step);
    save();
    return stopped ? 130 : 0;
  }
  if (tty) std::fprintf(stderr, "\n");
  PagedKvStore* kv = tr.kv();
  if (kv && kv->options().offload != KvOffload::none) {
    // What moving the history cost: bytes each way and the time compute waited for them.
    const OffloadStats st = kv->stats();
    const int dev = static_cast<int>(Tier::Device);
    const int tier = static_cast<int>(kv->options().offload == KvOffload::host ? Tier::Host : Tier::Disk);
    const double run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    std::printf("kv offload (%s%s%s): %s out, %s in; compute waited %.2f s on transfers (%.1f%% of %.1f s)\n",
                kv_offload_name(kv->options().offload), *kv->io_name() ? ", " : "", kv->io_name(),
                format_bytes(st.bytes[dev][tier]).c_str(), format_bytes(st.bytes[tier][dev]).c_str(), st.wait_seconds,
                run_s > 0 ? 100.0 * st.wait_seconds / run_s : 0.0, run_s);
  }
  if (c.act_offload != "none") {
    const OffloadStats st = e.model->act_offload_stats();
    const int dev = static_cast<int>(Tier::Device), host = static_cast<int>(Tier::Host), disk = static_cast<int>(Tier::Disk);
    const double run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    std::printf("activation offload (%s): %s out, %s in; compute waited %.2f s on transfers (%.1f%% of %.1f s)\n",
                c.act_offload.c_str(), format_bytes(st.bytes[dev][host] + st.bytes[dev][disk]).c_str(),
                format_bytes(st.bytes[host][dev] + st.bytes[disk][dev]).c_str(), st.wait_seconds,
                run_s > 0 ? 100.0 * st.wait_seconds / run_s : 0.0, run_s);
  }
  if (dump) std::fclose(dump);
  if (final_eval) run_eval(step);
  save();
  // The report shows the values the run used: the thread count, and the epochs the steps amounted to.
  json::Value shown = tr.config().to_json();
  shown.set("threads", json::Value::integer(get_threads()));
  json::Value summary = json::Value::object();
  summary.set("model", json::Value::string(c.model));
  if (plan.is_object()) summary.set("plan", plan);
  summary.set("total_steps", json::Value::integer(tr.total_steps()));
  if (std::isfinite(tr.epochs_trained())) {
    summary.set("epochs", json::Value::number(tr.epochs_trained()));
    if (c.epochs == 0) shown.set("epochs", json::Value::number(tr.epochs_trained()));
  }
  const std::string report = write_report(out, shown, summary);
  std::printf("trained %lld steps; last loss %.4f; checkpoint in %s/checkpoint-%lld; metrics in %s; report in %s\n",
              static_cast<long long>(step), last_loss, out.c_str(), static_cast<long long>(step),
              MetricsWriter::path_in(out).c_str(), report.c_str());
  if (!g_stop && e.src.tokenizer && c.zero >= 3 && dist::distributed()) {
    if (e.adapters)
      std::printf("sample: skipped (--zero 3 spreads each layer's base weights over the ranks, which have finished: "
                  "oomless generate --model %s --adapter %s/checkpoint-%lld)\n", c.model.c_str(), out.c_str(),
                  static_cast<long long>(step));
    else
      std::printf("sample: skipped (--zero 3 spreads each layer's weights over the ranks, which have finished; the "
                  "checkpoint holds them all: oomless generate --model %s/checkpoint-%lld)\n", out.c_str(),
                  static_cast<long long>(step));
  } else if (!g_stop && e.src.tokenizer) {
    // A sample from the trained weights, greedy, so a person sees what the run learned: for chat data the
    // first user turn of the eval (else training) data's first conversation, answered through the chat
    // template; for text the first words of the eval (else training) data.
    const Tokenizer& tok = *e.src.tokenizer;
    GenerateOptions gopt;
    gopt.max_new = 40;
    gopt.stop_id = e.src.cfg.eos_id;
    std::vector<int32_t> p;
    std::string shown;
    const std::string from = !c.eval_data.empty() ? c.eval_data : c.data.substr(0, c.data.find(','));
    std::vector<ChatMessage> conv;
    if (ends_with_jsonl(from)) conv = first_user_turn(from);
    const ChatTemplate ct = ChatTemplate::from_config(e.src.tokenizer_config);
    if (!conv.empty() && ct.kind() != ChatTemplate::Kind::none) {
      std::vector<uint8_t> mask;
      ct.render(conv, tok, p, mask, true);
      if (const std::optional<int32_t> eot = tok.token_to_id(ct.end_of_turn())) gopt.stop_ids = {*eot};
      gopt.max_new = 64;
      shown = "(chat) user: " + conv.back().content + "\nassistant: ";
    } else {
      shown = c.data == out + "/bundled-data/kjv-train.jsonl" ? "And God said" : first_words(from, 6);
      p = tok.encode(shown, true);
    }
    try {
      const std::vector<int32_t> gen = generate(*e.model, e.mem->device, p, gopt);
      std::printf("sample: %s%s\n", shown.c_str(), tok.decode(gen, true).c_str());
    } catch (const OutOfBudget&) {
      std::printf("sample: skipped (its KV cache does not fit in what --budget leaves after training)\n");
    } catch (const Error& err) {
      std::printf("sample: skipped (%s)\n", err.what());
    }
  }
  return g_stop ? 130 : 0;
}

}  // namespace

}  // namespace oomless
