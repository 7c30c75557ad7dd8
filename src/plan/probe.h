// Measures what the planner's cost model needs from this machine: GEMM and attention throughput and
// memory bandwidth, with the CPU's identity. Every figure is the median of several timed repetitions
// after a warm-up.
#pragma once
#include <string>

#include "core/cpu_info.h"

namespace oomless {

struct ProbeResult {
  CpuInfo cpu;
  double gemm_f32_gflops = 0;   // square GEMM, n = gemm_n
  double gemm_bf16_gflops = 0;
  double attention_gflops = 0;  // causal fwd+bwd, counted as 3.5 * 4*T*T*D*H/2
  double attention_bf16_gflops = 0;  // the same with bf16 K/V and bf16 products (bf16 compute)
  double bandwidth_gbs = 0;     // a[i] = b[i] + s*c[i], bytes read + written
  int gemm_n = 0, attn_T = 0, attn_H = 0, attn_D = 0;
  size_t bandwidth_bytes = 0;
  std::string cuda;             // "not built", "built, no device (...)", or the device
  std::string gemm_path;        // the GEMM kernels the figures ran on (gemm.h: gemm_path)

  std::string text() const;
  std::string json() const;
};

// quick: small sizes (well under a second), for tests and smoke runs.
ProbeResult run_probe(bool quick);

// Median seconds of `reps` calls of fn after one warm-up call.
template <class F> double median_seconds(int reps, F&& fn);

}  // namespace oomless

#include "plan/probe_timing.h"
