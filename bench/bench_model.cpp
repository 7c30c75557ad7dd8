// Whole-model training throughput: one forward + backward of a sequence of T tokens (full sequence,
// SavePolicy all) for preset:tiny and preset:smollm2-135m (random init) at T = 1024 and 4096, fp32 and bf16.
// MFU = (6 * matmul params * T + causal attention FLOPs) / (step time * the same run's GEMM rate), the
// GEMM rate being the median of a model-shaped product (T x E) . (E x F) in the same dtype, timed in this
// process right before the model. Causal attention forward + backward: 6 * L * H * D * T^2.
//
//   build/release/bench_model [--reps N] [--quick] [--threads N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_info.h"
#include "memory/arena.h"
#include "model/config.h"
#include "model/model.h"
#include "plan/probe_timing.h"

using namespace oomless;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// GFLOP/s of c (T, F) = a (T, E) . b (F, E)^T in dtype dt (bf16 operands or f32), median of reps.
double gemm_rate(Ops& ops, Arena& arena, int64_t T, int64_t E, int64_t F, DType dt, int reps) {
  Buffer a = arena.alloc(static_cast<size_t>(dtype_bytes(dt, T * E)), Category::workspace);
  Buffer b = arena.alloc(static_cast<size_t>(dtype_bytes(dt, F * E)), Category::workspace);
  Buffer c = arena.alloc(static_cast<size_t>(T * F * 4), Category::workspace);
  std::vector<float> r(static_cast<size_t>(std::max(T, F) * E));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (float& x : r) x = u(rng);
  convert(a.data(), dt, r.data(), DType::f32, T * E);
  convert(b.data(), dt, r.data(), DType::f32, F * E);
  Tensor ta = a.view(dt, {T, E}), tb = b.view(dt, {F, E}), tc = c.view(DType::f32, {T, F});
  ops.matmul(tc, ta, tb, false, true, false);
  std::vector<double> s;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now();
    ops.matmul(tc, ta, tb, false, true, false);
    s.push_back(now() - t0);
  }
  return 2.0 * static_cast<double>(T * E * F) / median(s) / 1e9;
}

size_t peak_rss_kib() {
  FILE* f = std::fopen("/proc/self/status", "r");
  char line[256];
  size_t v = 0;
  while (f && std::fgets(line, sizeof line, f))
    if (!std::strncmp(line, "VmHWM:", 6)) v = std::strtoull(line + 6, nullptr, 10);
  if (f) std::fclose(f);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 3;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--quick") quick = true;
    else if (a == "--threads" && i + 1 < argc) set_threads(std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: bench_model [--reps N] [--quick] [--threads N]\n");
      return 2;
    }
  }
  std::printf("threads %d; step = forward + backward of one sequence, SavePolicy all; median of %d\n\n",
              get_threads(), reps);
  std::printf("%-14s %6s %5s %9s %10s %9s %9s %7s %12s %10s\n", "model", "T", "dtype", "step s", "tokens/s",
              "GFLOP/s", "GEMM", "MFU", "activations", "peak RSS");
  const std::vector<std::string> models = quick ? std::vector<std::string>{"micro"}
                                                : std::vector<std::string>{"tiny", "smollm2-135m"};
  const std::vector<int64_t> lengths = quick ? std::vector<int64_t>{256} : std::vector<int64_t>{1024, 4096};
  for (const std::string& name : models) {
    const ModelConfig cfg = preset_config(name);
    for (int64_t T : lengths) {
      for (ComputeDType cd : {ComputeDType::f32, ComputeDType::bf16}) {
        CpuMemory mem(size_t{20} << 30);
        auto ops = make_ops("cpu", &mem.device);
        ParamSet params(cfg, DType::f32, mem.device, Category::weights);
        init_random(*ops, params, 1);
        Model m(cfg, *ops, params, mem.device, {cd, SavePolicy::all});
        m.reserve(T, true);
        std::vector<int32_t> ids(static_cast<size_t>(T)), tg(static_cast<size_t>(T));
        std::mt19937_64 rng(2);
        for (auto& x : ids) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(cfg.V));
        for (int64_t t = 0; t < T; ++t) tg[t] = t + 1 < T ? ids[t + 1] : -100;
        const double gemm = gemm_rate(*ops, mem.device, T, cfg.E, cfg.F, cd == ComputeDType::bf16 ? DType::bf16 : DType::f32, 5);
        mem.ledger.reset_peaks();
        std::vector<double> s;
        for (int r = 0; r < reps + 1; ++r) {  // the first step warms up and is not counted
          const double t0 = now();
          CeResult ce = m.forward(Tensor(ids.data(), DType::i32, {T}), Tensor(tg.data(), DType::i32, {T}), true);
          m.backward(1.0 / static_cast<double>(ce.count));
          if (r > 0) s.push_back(now() - t0);
        }
        const double step = median(s);
        const double matmul_params = static_cast<double>(cfg.param_count() - (cfg.tied ? 0 : cfg.V * cfg.E));
        const double flops = 6.0 * matmul_params * static_cast<double>(T) +
                             6.0 * static_cast<double>(cfg.L * cfg.H * cfg.D) * static_cast<double>(T * T);
        const double rate = flops / step / 1e9;
        std::printf("%-14s %6lld %5s %9.3f %10.0f %9.1f %9.1f %6.1f%% %12s %10s\n", name.c_str(),
                    static_cast<long long>(T), cd == ComputeDType::bf16 ? "bf16" : "fp32", step,
                    static_cast<double>(T) / step, rate, gemm, 100.0 * rate / gemm,
                    format_bytes(mem.ledger.peak(Tier::Device, Category::activations)).c_str(),
                    format_bytes(peak_rss_kib() * 1024).c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
