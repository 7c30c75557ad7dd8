// The optimizer's side of a training step, side by side in one process (random init, whole sequences,
// SavePolicy all):
//
// 1. The clipping norm. Before, the trainer read every gradient once more after backward to take the global
//    norm; now each tensor's sum of squares is taken as backward finishes it (Model::on_grads_final). Times:
//    that separate pass after backward, and what the in-backward sums add to backward.
// 2. Where the optimizer state lives and --step-in-backward: the step's time and the ledger's peak bytes
//    by tier for --optim adamw / adamw8bit with the state in memory or on disk (a spill file under
//    --spill DIR, default build/), with and without --step-in-backward.
//
//   build/release/bench_optim_step [--model preset:smollm2-135m] [--seq 512] [--reps 3] [--spill DIR] [--quick]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/cpu_info.h"
#include "model/model.h"
#include "optim/clip.h"
#include "optim/disk_state.h"
#include "train/trainer.h"

using namespace oomless;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

StepBatch pattern_batch(int64_t T, int64_t V, int salt) {
  StepBatch b;
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>((t * 131 + salt * 7 + 3) % V);
  std::vector<int32_t> tg(ids.begin() + 1, ids.end());
  tg.push_back(-100);
  b.ids.push_back(ids);
  b.targets.push_back(tg);
  return b;
}

double mib(size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

}  // namespace

int main(int argc, char** argv) {
  std::string model = "preset:smollm2-135m", spill = "build";
  int64_t seq = 512;
  int reps = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) model = argv[++i];
    else if (a == "--seq" && i + 1 < argc) seq = std::atoll(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--spill" && i + 1 < argc) spill = argv[++i];
    else if (a == "--quick") model = "preset:tiny", seq = 128, reps = 2;
    else {
      std::fprintf(stderr, "usage: bench_optim_step [--model M] [--seq T] [--reps N] [--spill DIR] [--quick]\n");
      return 2;
    }
  }
  const CpuInfo cpu = detect_cpu();
  std::printf("cpu: %s; isa %s; %d threads\nmodel %s, T = %lld, medians of %d\n\n", cpu.model.c_str(),
              cpu.isa_summary().c_str(), get_threads(), model.c_str(), static_cast<long long>(seq), reps);
  TrainConfig base;
  base.model = model;
  base.seq = seq;
  base.batch = 1;
  base.steps = 1000;
  base.warmup = 1;
  base.lr = 1e-4;
  base.clip = 0;

  // 1. the norm
  {
    Trainer t(base, "");
    Model& m = *t.engine().model;
    Ops& ops = *t.engine().ops;
    const TrainableSet set = m.trainable();
    std::map<int64_t, std::vector<size_t>> groups;
    for (size_t i = 0; i < set.size(); ++i) groups[set[i].group].push_back(i);
    const StepBatch b = pattern_batch(seq, t.engine().src.cfg.V, 0);
    const Tensor ids(const_cast<int32_t*>(b.ids[0].data()), DType::i32, {seq});
    const Tensor tg(const_cast<int32_t*>(b.targets[0].data()), DType::i32, {seq});
    std::vector<double> bwd_plain, bwd_hook, pass, in_sums;
    for (int r = 0; r < reps + 1; ++r) {
      for (int hook = 0; hook < 2; ++hook) {
        m.zero_grads();
        m.forward(ids, tg, true, 1.0 / static_cast<double>(seq - 1));
        double sums = 0, spent = 0;
        if (hook)
          m.on_grads_final([&](int64_t g) {
            const double t0 = now();
            for (size_t i : groups[g]) sums += ops.sum_squares(set[i].grad);
            spent += now() - t0;
          });
        const double t0 = now();
        m.backward(1.0 / static_cast<double>(seq - 1));
        const double t1 = now();
        if (r == 0) continue;  // warm-up
        (hook ? bwd_hook : bwd_plain).push_back(t1 - t0);
        if (hook) {
          in_sums.push_back(spent);
        } else {
          const double p0 = now();
          const double n = global_grad_norm(ops, set);
          pass.push_back(now() - p0);
          if (!std::isfinite(n)) std::printf("non-finite norm\n");
        }
      }
    }
    std::printf("## The clipping norm (%s trainable parameters)\n", std::to_string(trainable_numel(set)).c_str());
    std::printf("backward alone                  %8.1f ms\n", 1e3 * median(bwd_plain));
    std::printf("norm pass after backward (was)  %8.1f ms   the step waited for it\n", 1e3 * median(pass));
    std::printf("backward with in-backward sums  %8.1f ms   (+%.1f ms; the sums themselves %.1f ms)\n",
                1e3 * median(bwd_hook), 1e3 * (median(bwd_hook) - median(bwd_plain)), 1e3 * median(in_sums));
    std::printf("step start after backward: %.1f ms sooner\n\n", 1e3 * (median(pass) - (median(bwd_hook) - median(bwd_plain))));
  }

  // 2. state tiers and step-in-backward
  struct Combo {
    const char* name;
    const char* optim;
    const char* state;
    bool sib;
  };
  std::printf("## Optimizer state and step-in-backward\n");
  std::printf("%-28s %9s %11s %11s %11s %11s %11s\n", "combination", "step s", "grads MiB", "optim dev", "optim host",
              "optim disk", "peak D+H");
  const std::string dir = spill + "/bench-optim-step";
  std::filesystem::create_directories(dir);
  for (const Combo& k : {Combo{"adamw host", "adamw", "host", false}, Combo{"adamw host, in-backward", "adamw", "host", true},
                         Combo{"adamw disk", "adamw", "disk", false}, Combo{"adamw disk, in-backward", "adamw", "disk", true},
                         Combo{"adamw8bit host", "adamw8bit", "host", false},
                         Combo{"adamw8bit disk, in-backward", "adamw8bit", "disk", true}}) {
    TrainConfig c = base;
    c.optim = k.optim;
    c.optim_state = k.state;
    c.step_in_backward = k.sib;
    c.spill_dir = std::string(k.state) == "disk" ? dir : "";
    Trainer t(c, "");
    std::vector<double> s;
    for (int r = 0; r < reps + 1; ++r) {
      const StepResult res = t.step(pattern_batch(seq, t.engine().src.cfg.V, r));
      if (r) s.push_back(res.seconds);
    }
    const Ledger& l = t.engine().mem->ledger;
    size_t grads = 0;
    for (Tier tier : {Tier::Device, Tier::Host}) grads += l.peak(tier, Category::grads);
    std::printf("%-28s %9.2f %11.1f %11.1f %11.1f %11.1f %11.1f\n", k.name, median(s), mib(grads),
                mib(l.peak(Tier::Device, Category::optimizer)), mib(l.peak(Tier::Host, Category::optimizer)),
                mib(l.peak(Tier::Disk, Category::optimizer)),
                mib(l.peak_total(Tier::Device) + l.peak_total(Tier::Host)));
    if (auto* d = dynamic_cast<DiskState*>(t.optimizer())) {
      const OffloadStats io = d->io();
      std::printf("%-28s window %.1f MiB; waited on the disk %.2f s of %.2f s busy over %d steps\n", "",
                  mib(d->window_bytes()), io.wait_seconds, io.busy_seconds, reps + 1);
    }
  }
  return 0;
}
