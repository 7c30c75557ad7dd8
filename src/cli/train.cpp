// oomless train: flags (or a JSON config file of the same names) -> TrainConfig -> run_training.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/tier.h"
#include "model/model.h"
#include "plan/planner.h"
#include "train/estimate.h"
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
         "`mpirun -np N oomless train ...` (or srun) trains data parallel: each rank a share of every step's\n"
         "sequences, gradients summed over ranks in a fixed order; rank 0 writes the run folder.\n"
         "With no --data: preset:tiny (or --model) on the bundled KJV corpus, 250 steps unless --steps/--epochs.\n"
         "\n" +
         train_options_help() +
         "  --plan FILE          the settings of a plan made by `oomless plan` for this model and --seq (its\n"
         "                       predicted peak must fit a --budget given beside it)\n"
         "  --resume [DIR]       continue the run in DIR (default --out) from its newest good checkpoint, with its\n"
         "                       saved settings (flags given override steps, eval, save and keep settings)\n"
         "  --config FILE.json   settings file\n";
}
}  // namespace

namespace {

// train's flags (or a JSON config file of the same names, or a run's saved configuration with --resume) read into
// a TrainConfig, for train and for estimate. `extra`: the command's own flags beside them.
struct Parsed {
  TrainConfig config;
  bool help = false;
  bool json = false;
  bool explain = false;
  int64_t ranks = 1;                // estimate --ranks N
  std::string plan;                 // train --plan FILE
  std::vector<std::string> given;   // the settings given by flag or --config file (not the defaults)
};

enum class Command { train, estimate, plan };

Parsed parse_train_flags(const std::vector<std::string>& argv, const char* command, const std::string& help,
                         Command cmd) {
  // --resume takes an optional folder: normalise "--resume" followed by another flag (or nothing).
  std::vector<std::string> args;
  for (size_t i = 0; i < argv.size(); ++i) {
    args.push_back(argv[i]);
    if (argv[i] == "--resume" && (i + 1 == argv.size() || argv[i + 1].rfind("--", 0) == 0)) args.push_back("");
  }
  std::vector<Flag> flags = {{"resume", true}, {"config", true}};
  if (cmd == Command::estimate) flags.push_back({"json", false}), flags.push_back({"ranks", true});
  if (cmd == Command::plan) flags.push_back({"explain", false});
  if (cmd == Command::train) flags.push_back({"plan", true});
  for (const TrainOption& t : train_options()) flags.push_back({t.name, t.kind != TrainOption::Kind::boolean});
  Args a(args, flags, command, help);
  Parsed r;
  if (a.help_requested()) return r.help = true, r;
  r.json = cmd == Command::estimate && a.has("json");
  if (cmd == Command::estimate) r.ranks = a.integer("ranks", 1, 1, 1 << 20);
  r.explain = cmd == Command::plan && a.has("explain");
  if (cmd == Command::train && a.has("plan")) r.plan = a.str("plan");
  TrainConfig& c = r.config;
  // --resume: the run's saved configuration first, so `--resume DIR` alone continues it; a --config file
  // and flags given then apply on top (a fixed setting that differs is refused by the trainer).
  if (a.has("resume")) {
    std::string dir = a.str("resume");
    if (dir.empty()) dir = a.str("out");
    if (dir.empty() && a.has("config")) {
      const json::Value f = json::parse_file(a.str("config"));
      if (f.find("out") && f.at("out").is_string()) dir = f.at("out").as_string();
    }
    OOM_CHECK(!dir.empty(), "[", command, "] --resume needs the run folder: --resume DIR (or --out DIR)");
    c.apply_json(saved_run_config(dir), dir + "'s saved configuration");
    c.out = dir;
  }
  if (a.has("config")) {
    const json::Value f = json::parse_file(a.str("config"));
    c.apply_json(f, a.str("config"));
    if (f.is_object())
      for (const TrainOption& t : train_options())
        if (f.find(t.name)) r.given.push_back(t.name);
  }
  // Flags override the file: apply them through the same key names.
  json::Value o = json::Value::object();
  for (const TrainOption& t : train_options()) {
    if (!a.has(t.name)) continue;
    r.given.push_back(t.name);
    switch (t.kind) {
      case TrainOption::Kind::text: o.set(t.name, json::Value::string(a.str(t.name))); break;
      case TrainOption::Kind::boolean: o.set(t.name, json::Value::boolean(true)); break;
      case TrainOption::Kind::number: {
        const double v = a.number(t.name, 0, 0, 1e30);
        // 0 reads as "the default" for these: refuse it instead of running something the user did not ask for.
        const std::string_view n = t.name;
        OOM_CHECK(v > 0 || (n != "epochs" && n != "lr"), "[", command, "] --", n, " must be above 0, got ", v,
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
  return r;
}

std::string estimate_help() {
  return "usage: oomless estimate [--model M] [train's options] [--budget SIZE] [--json]\n"
         "\n"
         "What `oomless train` with the same options will hold, before it runs: bytes per tier (device, host, disk)\n"
         "and category (weights, grads, optimizer, adapter = static; activations, kv, kv_grad, workspace =\n"
         "dynamic), in closed form from the model's config (no weight is read), and whether the run fits --budget\n"
         "(Device and Host together, as train's --budget). When it does not fit: the changes that make it fit,\n"
         "each with its estimate (exit status 3). train prints the same estimate at setup, before what it then\n"
         "holds. The kernels' scratch is sized for --threads (default: all CPUs).\n"
         "\n"
         "  --json               one JSON object: the estimate, the budget and the changes\n"
         "  --ranks N            a run of N ranks (mpirun -np N oomless train ...): what one rank holds, the\n"
         "                       rank holding the most (with --zero, its share of the optimizer state and\n"
         "                       gradients; with --context-parallel N, its slice and the earlier slices' keys)\n"
         "  (every option of `oomless train --help`)\n";
}

std::string plan_help() {
  return "usage: oomless plan [--model M] [train's options] --budget SIZE [--out plan.json] [--explain]\n"
         "\n"
         "The fastest schedule of `oomless train` with these options that fits --budget: per layer what it keeps\n"
         "for backward (--save-policy), whether saved activations wait on disk (--act-offload), chunk-recurrent\n"
         "training and where its K/V history lives (--chunk, --kv-offload), where the optimizer state lives\n"
         "(--optim-state). Memory from the estimate (`oomless estimate`), time from a cost model measured on this\n"
         "machine (short steps of the model cut to one and four layers, disk bandwidth in --spill-dir or the\n"
         "plan's folder), the choice made by a mixed-integer program (GLPK). Nothing that changes the computed\n"
         "numbers (dtypes, adapters, the batch) is changed. Run the plan with `oomless train ... --plan FILE`;\n"
         "`oomless train --budget SIZE` with none of those flags plans by itself.\n"
         "\n"
         "  --out FILE           where to write the plan (default plan.json)\n"
         "  --explain            print why each choice was made\n"
         "  (every option of `oomless train --help`)\n";
}

}  // namespace

int train(const std::vector<std::string>& argv) {
  const std::string help = train_help();
  Parsed p = parse_train_flags(argv, "train", help, Command::train);
  if (p.help) return std::fputs(help.c_str(), stdout), 0;
  TrainConfig& c = p.config;
  auto given = [&](const std::string& k) { return std::find(p.given.begin(), p.given.end(), k) != p.given.end(); };
  bool planned = false;
  double predicted_peak = 0, predicted_s = 0;
  std::string plan_source, plan_explain;
  int64_t layers = 0;
  if (!p.plan.empty()) {
    // --plan FILE: its settings, for the model and --seq it was made for; the flags it sets are not given twice.
    for (const std::string& k : planned_flags())
      OOM_CHECK(!given(k), "[train] --", k, " is set by --plan ", p.plan, "; drop one of them");
    const ModelSource src = open_model(c.model, static_cast<uint64_t>(c.seed));
    const json::Value file = json::parse_file(p.plan);
    if (const std::string w = apply_plan(c, file, p.plan, src.cfg); !w.empty())
      std::fprintf(stderr, "oomless train: %s\n", w.c_str());
    planned = true;
    plan_source = "--plan " + p.plan;
    layers = src.cfg.L;
    if (const json::Value* x = file.find("explain"); x && x->is_string()) plan_explain = x->as_string();
    if (const json::Value* pr = file.find("predicted"); pr && pr->is_object()) {
      if (const json::Value* x = pr->find("ram_peak"); x && x->is_number()) predicted_peak = x->as_number();
      if (const json::Value* x = pr->find("step_seconds"); x && x->is_number()) predicted_s = x->as_number();
    }
    std::fprintf(stderr, "oomless train: --plan %s: --save-policy %s --chunk %lld --act-offload %s --kv-offload %s "
                 "--optim-state %s\n", p.plan.c_str(), c.save_policy.c_str(), static_cast<long long>(c.chunk),
                 c.act_offload.c_str(), c.kv_offload.c_str(), c.optim_state.c_str());
  } else if (!c.budget.empty() && !c.resume) {
    // --budget with none of the settings a plan chooses: the planner chooses them (explicit flags win).
    bool any = false;
    for (const std::string& k : planned_flags()) any = any || given(k);
    if (!any) {
      const std::string scratch = (c.spill_dir.empty() ? std::string(".") : c.spill_dir) + "/.oomless-plan-" +
                                  std::to_string(static_cast<long long>(getpid()));
      try {
        Plan plan = make_plan(c, parse_size(c.budget), scratch, stderr);
        const std::string flags = plan.global.flags();
        std::fprintf(stderr, "oomless train: planned for --budget %s: --save-policy %s%s%s (predicted peak %s%s; give "
                     "any of --save-policy, --chunk, --act-offload, --kv-offload, --optim-state to choose yourself)\n",
                     c.budget.c_str(), plan.config.save_policy.c_str(), flags.empty() ? "" : " ", flags.c_str(),
                     format_bytes(plan.estimate.ram_peak()).c_str(),
                     plan.pick.seconds > 0 ? (", " + std::to_string(plan.pick.seconds).substr(0, 5) + " s a step").c_str()
                                           : ", everything kept in memory");
        c = plan.config;
        planned = true;
        predicted_peak = static_cast<double>(plan.estimate.ram_peak());
        predicted_s = plan.pick.seconds;
        plan_source = "train --budget " + c.budget + " (no memory option given)";
        plan_explain = plan.explain;
        layers = open_model(c.model, static_cast<uint64_t>(c.seed)).cfg.L;
      } catch (const Error& e) {
        std::fprintf(stderr, "oomless train: no plan: %s\noomless train: running with the settings as given\n", e.what());
      }
      std::error_code ec;
      std::filesystem::remove_all(scratch, ec);
    }
  }
  if (!planned) return run_training(c);
  // A planned run ends with the plan's prediction beside what the run measured (metrics.jsonl: the ledger's
  // Device + Host peak, the median step).
  if (c.out.empty()) {
    char stamp[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
    c.out = std::string("runs/run-") + stamp;
  }
  // The report's plan section (write_report: summary "plan").
  json::Value pj = json::Value::object();
  pj.set("source", json::Value::string(plan_source));
  pj.set("settings", json::Value::string("--save-policy " + c.save_policy + " --chunk " + std::to_string(c.chunk) +
                                         " --act-offload " + c.act_offload + " --kv-offload " + c.kv_offload +
                                         " --optim-state " + c.optim_state));
  pj.set("predicted_peak", json::Value::number(predicted_peak));
  pj.set("predicted_step_s", json::Value::number(predicted_s));
  pj.set("explain", json::Value::string(plan_explain));
  if (layers > 0) {
    const std::vector<SavePolicy> pol = parse_save_policies(c.save_policy, layers);
    const std::vector<Tier> at = parse_act_tiers(c.act_offload, layers);
    json::Value ls = json::Value::array();
    for (int64_t l = 0; l < layers; ++l) {
      json::Value e = json::Value::object();
      e.set("save_policy", json::Value::string(save_policy_name(pol[static_cast<size_t>(l)])));
      const Tier t = at[static_cast<size_t>(l)];
      e.set("activations", json::Value::string(t == Tier::Device ? "memory" : tier_name(t)));
      ls.push_back(std::move(e));
    }
    pj.set("layers", std::move(ls));
  }
  const int rc = run_training(c, pj);
  if (rc != 0) return rc;
  std::vector<double> secs;
  double peak = 0;
  std::ifstream m(c.out + "/metrics.jsonl");
  for (std::string line; std::getline(m, line);) {
    const json::Value o = json::parse(line, "metrics.jsonl");
    if (!o.find("type") || o.at("type").as_string() != "train" || !o.find("memory")) continue;
    const double tps = o.at("tokens_per_s").as_number();
    if (tps > 0) secs.push_back(static_cast<double>(c.seq * c.batch * c.grad_accum) / tps);
    double p = 0;
    for (const char* t : {"device", "host"})
      if (const json::Value* x = o.at("memory").find(t)) p += x->at("total").at("peak").as_number();
    peak = std::max(peak, p);
  }
  if (secs.size() > 1) secs.erase(secs.begin());  // the first step warms up
  std::sort(secs.begin(), secs.end());
  if (!secs.empty())
    std::printf("plan: predicted peak %s%s; measured peak %s, %.3f s a step (median of %zu)\n",
                format_bytes(static_cast<size_t>(predicted_peak)).c_str(),
                predicted_s > 0 ? (", " + std::to_string(predicted_s).substr(0, 6) + " s a step").c_str() : "",
                format_bytes(static_cast<size_t>(peak)).c_str(), secs[secs.size() / 2], secs.size());
  return rc;
}

int estimate(const std::vector<std::string>& argv) {
  const std::string help = estimate_help();
  Parsed p = parse_train_flags(argv, "estimate", help, Command::estimate);
  if (p.help) return std::fputs(help.c_str(), stdout), 0;
  return run_estimate(p.config, p.json, static_cast<int>(p.ranks));
}

int plan(const std::vector<std::string>& argv) {
  const std::string help = plan_help();
  Parsed p = parse_train_flags(argv, "plan", help, Command::plan);
  if (p.help) return std::fputs(help.c_str(), stdout), 0;
  for (const std::string& k : planned_flags())
    OOM_CHECK(std::find(p.given.begin(), p.given.end(), k) == p.given.end(), "[plan] --", k,
              " is what the plan chooses; drop it (or train with it and no plan)");
  const std::string out = p.config.out;  // here: the plan file
  p.config.out.clear();
  return run_plan(p.config, out, p.explain);
}

}  // namespace oomless::cli
