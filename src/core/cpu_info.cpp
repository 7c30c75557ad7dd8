#include "core/cpu_info.h"

#include <cpuid.h>
#include <omp.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "core/error.h"

namespace oomless {

namespace {
bool os_saves_avx512() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0xe6) == 0xe6;
}
}  // namespace

CpuInfo detect_cpu() {
  CpuInfo info;
  unsigned a = 0, b = 0, c = 0, d = 0;
  char brand[49] = {};
  if (__get_cpuid_max(0x80000000, nullptr) >= 0x80000004) {
    for (unsigned i = 0; i < 3; ++i) {
      __get_cpuid(0x80000002 + i, &a, &b, &c, &d);
      std::memcpy(brand + 16 * i, &a, 4);
      std::memcpy(brand + 16 * i + 4, &b, 4);
      std::memcpy(brand + 16 * i + 8, &c, 4);
      std::memcpy(brand + 16 * i + 12, &d, 4);
    }
  }
  info.model = brand;
  while (!info.model.empty() && info.model.back() == ' ') info.model.pop_back();
  if (__get_cpuid(1, &a, &b, &c, &d)) {
    info.fma = c & (1u << 12);
    info.f16c = c & (1u << 29);
  }
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    info.avx2 = b & (1u << 5);
    bool zmm = os_saves_avx512();
    info.avx512f = zmm && (b & (1u << 16));
    info.avx512bw = zmm && (b & (1u << 30));
    info.avx512vl = zmm && (b & (1u << 31));
    info.avx512_vnni = zmm && (c & (1u << 11));
    info.amx_bf16 = d & (1u << 22);
    info.amx_tile = d & (1u << 24);
  }
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) info.avx512_bf16 = info.avx512f && (a & (1u << 5));
  info.logical_cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  info.threads = omp_get_max_threads();
  return info;
}

std::string CpuInfo::isa_summary() const {
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512_bf16, "avx512_bf16");
  add(amx_tile, "amx_tile");
  add(amx_bf16, "amx_bf16");
  return s.empty() ? "baseline x86-64" : s;
}

namespace {
// The aggregate cpu line of /proc/stat: busy and total jiffies.
bool read_stat(unsigned long long* busy, unsigned long long* total) {
  FILE* f = std::fopen("/proc/stat", "r");
  if (!f) return false;
  unsigned long long v[8] = {};
  const int n = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                            &v[6], &v[7]);
  std::fclose(f);
  if (n < 4) return false;
  *total = 0;
  for (unsigned long long x : v) *total += x;
  *busy = *total - v[3] - v[4];  // all but idle and iowait
  return true;
}
}  // namespace

double busy_cpus(double seconds) {
  unsigned long long b0, t0, b1, t1;
  if (!read_stat(&b0, &t0)) return -1;
  usleep(static_cast<useconds_t>(seconds * 1e6));
  if (!read_stat(&b1, &t1) || t1 <= t0) return -1;
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return static_cast<double>(b1 - b0) / static_cast<double>(t1 - t0) * static_cast<double>(cpus > 0 ? cpus : 1);
}

void set_threads(int n) {
  OOM_CHECK(n >= 1, "[threads] thread count must be at least 1, got ", n);
  omp_set_num_threads(n);
}

int get_threads() { return omp_get_max_threads(); }

}  // namespace oomless
