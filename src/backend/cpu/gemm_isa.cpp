// Which GEMM kernels run: the GemmIsa of gemm.h, chosen once from the CPU (cpu_info: cpuid and XCR0) or
// OOMLESS_ISA, switchable by set_gemm_isa. Each ISA's kernel table is built once.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "backend/cpu/gemm.h"
#include "backend/cpu/gemm_kernel.h"
#include "core/cpu_info.h"
#include "core/error.h"

namespace oomless {

namespace {

using namespace gemm_detail;

const CpuInfo& cpu() {
  static const CpuInfo c = detect_cpu();
  return c;
}

Kernels build(GemmIsa isa) {
  Kernels k{};
  k.isa = isa;
  if (isa == GemmIsa::generic) {
    fill_generic(k.micro[0], std::make_integer_sequence<int, kMr>{});
    fill_generic(k.micro[1], std::make_integer_sequence<int, kMr>{});
    fill_generic(k.packed, std::make_integer_sequence<int, kMr>{});
    k.pack_bt = &pack_bt_generic;
    return k;
  }
  k.avx2 = true;
  k.pack_bt = &pack_bt_avx2<float>;
  if (isa == GemmIsa::avx512 || isa == GemmIsa::amx) {
    fill_avx512_kernels(k, cpu().avx512_bf16);
    k.amx = isa == GemmIsa::amx;
    return k;
  }
  fill_avx2<false, false>(k.micro[0], std::make_integer_sequence<int, kMr>{});
  fill_avx2<true, false>(k.micro[1], std::make_integer_sequence<int, kMr>{});
  fill_avx2<true, true>(k.packed, std::make_integer_sequence<int, kMr>{});
  return k;
}

const Kernels& table(GemmIsa isa) {
  static const Kernels generic = build(GemmIsa::generic);
  static const Kernels avx2 = gemm_isa_supported(GemmIsa::avx2) ? build(GemmIsa::avx2) : generic;
  static const Kernels avx512 = gemm_isa_supported(GemmIsa::avx512) ? build(GemmIsa::avx512) : generic;
  static const Kernels amx = gemm_isa_supported(GemmIsa::amx) ? build(GemmIsa::amx) : generic;
  switch (isa) {
    case GemmIsa::generic: return generic;
    case GemmIsa::avx2: return avx2;
    case GemmIsa::avx512: return avx512;
    case GemmIsa::amx: return amx;
  }
  return generic;
}

GemmIsa best() {
  const std::vector<GemmIsa> all = supported_gemm_isas();
  return all.back();
}

std::atomic<const Kernels*> current{nullptr};
std::mutex choose_mu;

const Kernels& current_kernels() {
  const Kernels* k = current.load(std::memory_order_acquire);
  if (k) return *k;
  std::lock_guard<std::mutex> lock(choose_mu);
  k = current.load(std::memory_order_relaxed);
  if (k) return *k;
  GemmIsa isa = best();
  if (const char* env = std::getenv("OOMLESS_ISA"); env && *env) {
    isa = parse_gemm_isa(env);
    OOM_CHECK(gemm_isa_supported(isa), "[gemm] OOMLESS_ISA=", env, ": this CPU has no ", gemm_isa_name(isa),
              " path (it has: ", cpu().isa_summary(), "); use one of the paths `oomless probe` lists");
  }
  k = &table(isa);
  current.store(k, std::memory_order_release);
  return *k;
}

// The avx512 path's bf16 choice (gemm.h): -1 until first use.
std::atomic<int> bf16_pairs{-1};

}  // namespace

double bf16_pair_speed() {
  static const double speed = cpu().avx512f && cpu().avx512_bf16 ? measure_bf16_pair_speed() : 0.0;
  return speed;
}

bool gemm_bf16_pairs() {
  int p = bf16_pairs.load(std::memory_order_acquire);
  if (p >= 0) return p != 0;
  std::lock_guard<std::mutex> lock(choose_mu);
  p = bf16_pairs.load(std::memory_order_relaxed);
  if (p >= 0) return p != 0;
  const bool have = cpu().avx512f && cpu().avx512_bf16;
  if (const char* env = std::getenv("OOMLESS_BF16_GEMM"); env && *env) {
    const std::string_view v(env);
    OOM_CHECK(v == "pairs" || v == "widened", "[gemm] OOMLESS_BF16_GEMM=", v, ": use pairs or widened");
    OOM_CHECK(v == "widened" || have, "[gemm] OOMLESS_BF16_GEMM=pairs: this CPU has no AVX512-BF16 (it has: ",
              cpu().isa_summary(), ")");
    p = v == "pairs";
  } else {
    p = have && bf16_pair_speed() > 1.0;
  }
  bf16_pairs.store(p, std::memory_order_release);
  return p != 0;
}

void set_gemm_bf16_pairs(bool pairs) {
  OOM_CHECK(!pairs || (cpu().avx512f && cpu().avx512_bf16), "[gemm] bf16 pair kernels need AVX512-BF16 (this CPU has: ",
            cpu().isa_summary(), ")");
  std::lock_guard<std::mutex> lock(choose_mu);
  bf16_pairs.store(pairs ? 1 : 0, std::memory_order_release);
}

const char* gemm_isa_name(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::generic: return "generic";
    case GemmIsa::avx2: return "avx2";
    case GemmIsa::avx512: return "avx512";
    case GemmIsa::amx: return "amx";
  }
  return "?";
}

GemmIsa parse_gemm_isa(std::string_view name) {
  if (name == "generic") return GemmIsa::generic;
  if (name == "avx2") return GemmIsa::avx2;
  if (name == "avx512") return GemmIsa::avx512;
  if (name == "amx") return GemmIsa::amx;
  fail("[gemm] unknown ISA '", name, "'; use generic, avx2, avx512 or amx");
}

bool gemm_isa_supported(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::generic: return true;
    case GemmIsa::avx2: return cpu().avx2 && cpu().fma;
    case GemmIsa::avx512: return cpu().avx2 && cpu().fma && cpu().avx512f;
    case GemmIsa::amx:  // the bf16 pair kernels serve the products too small for tiles
      return cpu().avx2 && cpu().fma && cpu().avx512f && cpu().avx512bw && cpu().avx512_bf16 && cpu().amx_tile &&
             cpu().amx_bf16 && amx_os_permits();
  }
  return false;
}

std::vector<GemmIsa> supported_gemm_isas() {
  std::vector<GemmIsa> out;
  for (GemmIsa i : {GemmIsa::generic, GemmIsa::avx2, GemmIsa::avx512, GemmIsa::amx})
    if (gemm_isa_supported(i)) out.push_back(i);
  return out;
}

GemmIsa gemm_isa() { return current_kernels().isa; }

void set_gemm_isa(GemmIsa isa) {
  OOM_CHECK(gemm_isa_supported(isa), "[gemm] this CPU has no ", gemm_isa_name(isa), " path (it has: ",
            cpu().isa_summary(), ")");
  std::lock_guard<std::mutex> lock(choose_mu);
  current.store(&table(isa), std::memory_order_release);
}

std::string gemm_path() {
  const Kernels& k = current_kernels();
  std::string s = gemm_isa_name(k.isa);
  if (k.isa == GemmIsa::amx) s += " (f32 zmm, bf16 amx tiles; one-row bf16 x W vdpbf16ps)";
  else if (k.isa == GemmIsa::avx512 && !k.packed_pairs[1]) s += " (f32 zmm, bf16 widened)";
  else if (k.isa == GemmIsa::avx512) {
    char speed[96];
    std::snprintf(speed, sizeof speed, "; vdpbf16ps at %.2fx the FMA rate here)", bf16_pair_speed());
    s += std::string(gemm_bf16_pairs() ? " (f32 zmm, bf16 vdpbf16ps" : " (f32 zmm, bf16 widened") + speed;
  }
  else if (k.isa == GemmIsa::avx2) s += " (f32 ymm, bf16 widened)";
  return s;
}

namespace gemm_detail {
const Kernels& kernels() { return current_kernels(); }
}  // namespace gemm_detail

}  // namespace oomless
