// What this CPU is and can do, detected at run time (cpuid and /proc/cpuinfo), and the thread count.
#pragma once
#include <string>

namespace oomless {

struct CpuInfo {
  std::string model;     // brand string, e.g. "AMD EPYC 9654 96-Core Processor"
  int logical_cpus = 0;  // online logical CPUs
  int threads = 0;       // OpenMP threads oomless will use
  bool avx2 = false, fma = false, avx512f = false, avx512bw = false, avx512_bf16 = false;
  bool amx_tile = false, amx_bf16 = false;
  bool f16c = false, avx512vl = false;  // not in isa_summary (checkpoints compare it)
  bool avx512_vnni = false;             // vpdpbusd (the int8 one-row products); not in isa_summary either
  std::string isa_summary() const;  // "avx2 fma" / "avx512f avx512_bf16 amx_bf16" ...
};

CpuInfo detect_cpu();
// CPUs kept busy by other processes over `seconds` (from /proc/stat, while this process sleeps), or -1
// when /proc/stat cannot be read.
double busy_cpus(double seconds);
// Sets the OpenMP thread count for every kernel (n >= 1).
void set_threads(int n);
int get_threads();

}  // namespace oomless
