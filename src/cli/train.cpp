// oomless train: flags (or a JSON config file of the same names) -> TrainConfig -> run_training.
#include <cstdio>

#include "cli/args.h"
#include "cli/commands.h"
#include "train/trainer.h"

namespace oomless::cli {

namespace {
const char* kTrainHelp =
    "usage: oomless train [--model M --data D] [options]\n"
    "\n"
    "Trains every parameter (fp32 master weights, AdamW) on text, .ids or .jsonl data, packed into sequences of\n"
    "--seq tokens with EOS between documents. Checkpoints (OUT/checkpoint-STEP: model.safetensors with Hugging\n"
    "Face names, config.json, tokenizer files, optimizer state, trainer state) are crash-safe; --resume continues\n"
    "bit-exactly. Flags override a --config file, whose keys are the long flag names without --.\n"
    "With no --data: preset:tiny (or --model) on the bundled KJV corpus, 250 steps unless --steps/--epochs.\n"
    "\n"
    "  --model M            HF folder, .gguf or preset:NAME (default preset:tiny)\n"
    "  --data D             files or folders, comma-separated: text, .ids, .jsonl ({\"text\"} or {\"messages\"})\n"
    "                       (default: the bundled corpus)\n"
    "  --out DIR            run folder: checkpoints, metrics.jsonl, report.html; a new run needs a new\n"
    "                       folder (default runs/run-YYYYmmdd-HHMMSS)\n"
    "  --seq T              tokens per sequence (default 256)\n"
    "  --batch B            sequences per micro-batch (default 8)\n"
    "  --grad-accum N       micro-batches per optimizer step (default 1)\n"
    "  --steps n            total optimizer steps of the run (default: from --epochs)\n"
    "  --epochs e           passes over the data when --steps is not given (default 1)\n"
    "  --lr x               peak learning rate (default 1e-3)\n"
    "  --min-lr x           floor of the schedule (default 1e-4)\n"
    "  --warmup n           linear warmup steps (default 20)\n"
    "  --schedule S         cosine, linear or constant (default cosine)\n"
    "  --weight-decay w     decoupled, not on norms and biases (default 0.1)\n"
    "  --beta1 b --beta2 b  AdamW betas (default 0.9, 0.95)\n"
    "  --eps e              AdamW epsilon (default 1e-8)\n"
    "  --clip c             global gradient-norm clip, 0 = off (default 1.0)\n"
    "  --eval-data F        held-out text or .ids file: loss of its first 32 windows (default: none, or the\n"
    "                       bundled eval text with the bundled corpus)\n"
    "  --eval-every n       evaluate every n steps, and at the end (default 100)\n"
    "  --save-every n       checkpoint every n steps, and at the end (default 200)\n"
    "  --keep K             keep the newest K checkpoints, 0 = all (default 2)\n"
    "  --resume [DIR]       continue from the newest good checkpoint in DIR (default --out)\n"
    "  --budget SIZE        memory budget for Device+Host, e.g. 24GiB or 24GB (default: none)\n"
    "  --dtype D            fp32 or bf16 projections (default fp32)\n"
    "  --save-policy P      all, selective or none (recompute) (default all)\n"
    "  --seed s             data order and preset init (default 0)\n"
    "  --threads n          CPU threads (default: all)\n"
    "  --max-nonfinite k    stop after more than k non-finite steps in a row (default 5)\n"
    "  --dump-tokens FILE   write each step's token ids and targets as JSON lines\n"
    "  --chunk C            chunk-recurrent training: activations for C tokens at a time, keys and values of\n"
    "                       earlier chunks in a paged store (default 0: off)\n"
    "  --page P             tokens per K/V page; divides --chunk (default min(64, C))\n"
    "  --kv-offload M       none, host or disk: where earlier chunks' K/V pages live (default none)\n"
    "  --spill-dir DIR      disk: folder of the spill file, not tmpfs (default --out)\n"
    "  --sparse-pages k     page-sparse attention: each query page reads its own chunk, the first --sink-pages\n"
    "                       pages and its k best-scoring earlier pages (default 0: every page, dense)\n"
    "  --sink-pages s       pages every query page reads with --sparse-pages (default 1)\n"
    "  --page-summary S     what a page is scored by: minmax (per-dimension bounds of its keys, as Quest;\n"
    "                       the default) or mean (of its keys)\n"
    "  --rope-theta x       override the model's RoPE base (training past its native context); saved in\n"
    "                       the checkpoints' config.json (default: the model's)\n"
    "  --rope-scaling S     override the model's RoPE scaling: linear:F, yarn:F or llama3:F (the model's\n"
    "                       context so far is the original one; it becomes F times longer), none, or a\n"
    "                       rope_scaling JSON object; saved in the checkpoints' config.json\n"
    "  --config FILE.json   settings file\n";
}

int train(const std::vector<std::string>& argv) {
  // --resume takes an optional folder: normalise "--resume" followed by another flag (or nothing).
  std::vector<std::string> args;
  for (size_t i = 0; i < argv.size(); ++i) {
    args.push_back(argv[i]);
    if (argv[i] == "--resume" && (i + 1 == argv.size() || argv[i + 1].rfind("--", 0) == 0)) args.push_back("");
  }
  const std::vector<Flag> flags = {
      {"model", true}, {"data", true}, {"out", true}, {"seq", true}, {"batch", true}, {"grad-accum", true},
      {"steps", true}, {"epochs", true}, {"lr", true}, {"min-lr", true}, {"warmup", true}, {"schedule", true},
      {"weight-decay", true}, {"beta1", true}, {"beta2", true}, {"eps", true}, {"clip", true},
      {"eval-data", true}, {"eval-every", true}, {"save-every", true}, {"keep", true}, {"resume", true},
      {"budget", true}, {"dtype", true}, {"seed", true}, {"threads", true}, {"max-nonfinite", true},
      {"dump-tokens", true}, {"config", true}, {"save-policy", true}, {"chunk", true}, {"page", true},
      {"kv-offload", true}, {"spill-dir", true}, {"rope-theta", true}, {"rope-scaling", true},
      {"sparse-pages", true}, {"sink-pages", true}, {"page-summary", true}};
  Args a(args, flags, "train", kTrainHelp);
  if (a.help_requested()) return std::fputs(kTrainHelp, stdout), 0;
  TrainConfig c;
  if (a.has("config")) c.apply_json(json::parse_file(a.str("config")), a.str("config"));
  // Flags override the file: apply them through the same key names.
  json::Value o = json::Value::object();
  for (const Flag& f : flags) {
    if (!a.has(f.name) || f.name == "config" || f.name == "resume") continue;
    const std::string v = a.str(f.name);
    const bool text = f.name == "model" || f.name == "data" || f.name == "out" || f.name == "schedule" ||
                      f.name == "eval-data" || f.name == "budget" || f.name == "dtype" || f.name == "dump-tokens" ||
                      f.name == "save-policy" || f.name == "kv-offload" || f.name == "spill-dir" ||
                      f.name == "rope-scaling" || f.name == "page-summary";
    if (text) {
      o.set(f.name, json::Value::string(v));
    } else {
      const bool whole = f.name != "lr" && f.name != "min-lr" && f.name != "weight-decay" && f.name != "beta1" &&
                         f.name != "beta2" && f.name != "eps" && f.name != "clip" && f.name != "epochs" &&
                         f.name != "rope-theta";
      // --steps 0 would read as "not given" (train by epochs): say so instead of running a whole epoch.
      const int64_t min_whole = f.name == "steps" ? 1 : 0;
      o.set(f.name, whole ? json::Value::integer(a.integer(f.name, 0, min_whole, INT64_MAX))
                          : json::Value::number(a.number(f.name, 0, 0, 1e30)));
    }
  }
  c.apply_json(o, "command line");
  if (a.has("resume")) {
    c.resume = true;
    c.resume_dir = a.str("resume");
  }
  return run_training(c);
}

}  // namespace oomless::cli
