// oomless train: flags (or a JSON config file of the same names) -> TrainConfig -> run_training.
#include <cstdio>
#include <string_view>

#include "cli/args.h"
#include "cli/commands.h"
#include "train/trainer.h"

namespace oomless::cli {

namespace {
std::string train_help() {
  return "usage: oomless train [--model M --data D] [options]\n"
         "\n"
         "Trains every parameter (fp32 master weights, AdamW), or with --lora a LoRA adapter on a frozen base, on\n"
         "text, .ids or .jsonl data, packed into sequences of --seq tokens with EOS between documents. Checkpoints\n"
         "(OUT/checkpoint-STEP: model.safetensors with Hugging Face names and config.json, or a PEFT adapter\n"
         "folder with --lora; tokenizer files, optimizer state, trainer state) are crash-safe; --resume continues\n"
         "bit-exactly. Flags override a --config file, whose keys are the long flag names without --.\n"
         "With no --data: preset:tiny (or --model) on the bundled KJV corpus, 250 steps unless --steps/--epochs.\n"
         "\n" +
         train_options_help() +
         "  --resume [DIR]       continue the run in DIR (default --out) from its newest good checkpoint, with its\n"
         "                       saved settings (flags given override steps, eval, save and keep settings)\n"
         "  --config FILE.json   settings file\n";
}
}  // namespace

int train(const std::vector<std::string>& argv) {
  // --resume takes an optional folder: normalise "--resume" followed by another flag (or nothing).
  std::vector<std::string> args;
  for (size_t i = 0; i < argv.size(); ++i) {
    args.push_back(argv[i]);
    if (argv[i] == "--resume" && (i + 1 == argv.size() || argv[i + 1].rfind("--", 0) == 0)) args.push_back("");
  }
  std::vector<Flag> flags = {{"resume", true}, {"config", true}};
  for (const TrainOption& t : train_options()) flags.push_back({t.name, t.kind != TrainOption::Kind::boolean});
  const std::string help = train_help();
  Args a(args, flags, "train", help);
  if (a.help_requested()) return std::fputs(help.c_str(), stdout), 0;
  TrainConfig c;
  // --resume: the run's saved configuration first, so `--resume DIR` alone continues it; a --config file
  // and flags given then apply on top (a fixed setting that differs is refused by the trainer).
  if (a.has("resume")) {
    std::string dir = a.str("resume");
    if (dir.empty()) dir = a.str("out");
    if (dir.empty() && a.has("config")) {
      const json::Value f = json::parse_file(a.str("config"));
      if (f.find("out") && f.at("out").is_string()) dir = f.at("out").as_string();
    }
    OOM_CHECK(!dir.empty(), "[train] --resume needs the run folder: --resume DIR (or --out DIR)");
    c.apply_json(saved_run_config(dir), dir + "'s saved configuration");
    c.out = dir;
  }
  if (a.has("config")) c.apply_json(json::parse_file(a.str("config")), a.str("config"));
  // Flags override the file: apply them through the same key names.
  json::Value o = json::Value::object();
  for (const TrainOption& t : train_options()) {
    if (!a.has(t.name)) continue;
    switch (t.kind) {
      case TrainOption::Kind::text: o.set(t.name, json::Value::string(a.str(t.name))); break;
      case TrainOption::Kind::boolean: o.set(t.name, json::Value::boolean(true)); break;
      case TrainOption::Kind::number: {
        const double v = a.number(t.name, 0, 0, 1e30);
        // 0 reads as "the default" for these: refuse it instead of running something the user did not ask for.
        const std::string_view n = t.name;
        OOM_CHECK(v > 0 || (n != "epochs" && n != "lr"), "[train] --", n, " must be above 0, got ", v,
                  n == "epochs" ? " (a fraction of an epoch is fine, e.g. 0.5; or give --steps N)" : "");
        o.set(t.name, json::Value::number(v));
        break;
      }
      case TrainOption::Kind::integer: {
        // --steps 0 would read as "not given" (train by epochs): say so instead of running a whole epoch.
        const std::string_view n = t.name;
        const int64_t min_whole = n == "steps" || n == "seq" || n == "batch" || n == "grad-accum" ? 1 : 0;
        o.set(t.name, json::Value::integer(a.integer(t.name, 0, min_whole, INT64_MAX)));
        break;
      }
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
