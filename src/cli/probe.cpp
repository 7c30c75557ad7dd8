#include <cstdio>

#include "cli/commands.h"
#include "backend/cpu/gemm.h"
#include "core/cpu_info.h"
#include "core/error.h"
#include "plan/probe.h"

namespace oomless::cli {

namespace {
const char* kProbeHelp =
    "usage: oomless probe [--json] [--quick] [--threads N] [--isa PATH]\n"
    "\n"
    "Measures this machine for the planner: CPU model and ISA (AVX2, AVX-512, AMX), cores, fp32 and bf16\n"
    "GEMM GFLOP/s, causal attention forward+backward GFLOP/s (f32, and bf16 K/V with bf16 products as bf16\n"
    "compute runs it) and memory bandwidth (medians of repeats).\n"
    "\n"
    "  --json        print one JSON object instead of a table\n"
    "  --quick       small sizes (under a second), for smoke tests; figures are less representative\n"
    "  --threads N   OpenMP threads (default: all logical CPUs, or OMP_NUM_THREADS)\n"
    "  --isa PATH    GEMM kernels to measure: generic, avx2, avx512 or amx, at most what the CPU has (default:\n"
    "                the best it has, or OOMLESS_ISA, which every command honours)\n";
}

int probe(const std::vector<std::string>& args) {
  bool json = false, quick = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--json") json = true;
    else if (a == "--quick") quick = true;
    else if (a == "--threads") {
      OOM_CHECK(i + 1 < args.size(), "[probe] --threads needs a number");
      int n = 0;
      try {
        n = std::stoi(args[++i]);
      } catch (...) {
        fail("[probe] --threads takes a positive whole number, got '", args[i], "'");
      }
      set_threads(n);
    } else if (a == "--isa") {
      OOM_CHECK(i + 1 < args.size(), "[probe] --isa needs a path: generic, avx2, avx512 or amx");
      set_gemm_isa(parse_gemm_isa(args[++i]));
    } else if (a == "--help" || a == "-h") {
      std::fputs(kProbeHelp, stdout);
      return 0;
    } else {
      fail("[probe] unknown option '", a, "'\n", kProbeHelp);
    }
  }
  ProbeResult r = run_probe(quick);
  std::fputs((json ? r.json() + "\n" : r.text()).c_str(), stdout);
  return 0;
}

}  // namespace oomless::cli
