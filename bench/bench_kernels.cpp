// Kernel benchmarks: GEMM at model shapes through oomless (CpuOps::matmul) beside oneDNN called
// directly (one multi-threaded primitive created once), the products with a dimension of at most 32 (decode
// rows, 16 rows, a LoRA adapter's rank) against the memory bound, causal attention forward+backward, the
// optimizer steps (fp32 AdamW, AdamW8bit) over one large tensor, and the one-row products of decoding
// over GGUF blocks (f32 against 8-bit activations), and a decode step's attention (its direct kernels against
// Gemm::tile).
// Runs alternate (ours on each path, direct, ours, ...) and each figure is the median of `--reps` runs.
// --isa names the GEMM paths to run side by side (comma-separated, or all: every path this CPU has;
// default: the one in use, see OOMLESS_ISA in gemm.h); attention runs on the default path. --tables picks the
// tables after the GEMM one, whose rates are the attention table's reference.
//
// usage: bench_kernels [--reps N] [--quick] [--threads N] [--isa LIST] [--tables LIST]
#include <dnnl.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "triad.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm.h"
#include "core/cpu_info.h"
#include "core/q8_act.h"
#include "io/gguf.h"
#include "memory/arena.h"

using namespace oomless;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct GemmCase {
  const char* what;
  int64_t M, N, K;
  bool ta, tb;
  bool in_median = true;  // among the model shapes whose median ratio and rates the summary and attention use
};

// oneDNN called directly: one primitive for the whole product, oneDNN's own threading and scratchpad.
struct Direct {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  dnnl::matmul prim;
  dnnl::memory am, bm, cm;
  bool ok = false;
  Direct(const GemmCase& g, DType t, void* a, void* b, float* c) {
    using dt = dnnl::memory::data_type;
    dt ab = t == DType::bf16 ? dt::bf16 : dt::f32;
    dnnl::memory::desc ad({g.M, g.K}, ab, g.ta ? dnnl::memory::dims{1, g.M} : dnnl::memory::dims{g.K, 1});
    dnnl::memory::desc bd({g.K, g.N}, ab, g.tb ? dnnl::memory::dims{1, g.K} : dnnl::memory::dims{g.N, 1});
    dnnl::memory::desc cd({g.M, g.N}, dt::f32, dnnl::memory::dims{g.N, 1});
    try {
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), eng);
      prim = dnnl::matmul(pd);
      am = dnnl::memory(ad, eng, a);
      bm = dnnl::memory(bd, eng, b);
      cm = dnnl::memory(cd, eng, c);
      ok = true;
    } catch (const dnnl::error&) {
      ok = false;  // no implementation for this dtype on this CPU
    }
  }
  void run() {
    prim.execute(strm, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    strm.wait();
  }
};

void fill(void* p, DType t, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> tmp(static_cast<size_t>(n));
  for (auto& v : tmp) v = d(rng);
  convert(p, t, tmp.data(), DType::f32, n);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 5;
  bool quick = false;
  std::string isa_list, tables = "all";
  std::vector<GemmCase> given;  // --shape: the GEMM table's shapes instead of the model shapes
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) set_threads(std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--isa") && i + 1 < argc) isa_list = argv[++i];
    else if (!std::strcmp(argv[i], "--tables") && i + 1 < argc) tables = argv[++i];
    else if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) {
      long long m = 0, n = 0, k = 0;
      int ta = 0, tb = 0;
      if (std::sscanf(argv[++i], "%lld,%lld,%lld,%d,%d", &m, &n, &k, &ta, &tb) < 3 || m < 1 || n < 1 || k < 1) {
        std::fprintf(stderr, "bench_kernels: --shape %s: give M,N,K[,TA,TB] (TA, TB: 1 for a transposed operand)\n",
                     argv[i]);
        return 2;
      }
      given.push_back({"given", m, n, k, ta != 0, tb != 0});
    } else {
      std::fprintf(stderr, "usage: bench_kernels [--reps N] [--quick] [--threads N] [--isa LIST|all] [--tables LIST|all]\n"
                           "                     [--shape M,N,K[,TA,TB] ...]\n"
                           "  --shape:  the GEMM table's shapes (repeatable) instead of the model shapes\n"
                           "  --tables: which tables after the GEMM one (always run: the others' reference rate), a\n"
                           "            comma-separated list of attention, decode, optim, rows (default all)\n");
      return 2;
    }
  }
  auto table = [&](const char* name) {
    return tables == "all" || ("," + tables + ",").find(std::string(",") + name + ",") != std::string::npos;
  };
  for (size_t p = 0; tables != "all" && p <= tables.size();) {
    const size_t q = std::min(tables.find(',', p), tables.size());
    const std::string t = tables.substr(p, q - p);
    if (t != "attention" && t != "decode" && t != "optim" && t != "rows") {
      std::fprintf(stderr, "bench_kernels: --tables: unknown table '%s' (known: attention, decode, optim, rows, or all)\n",
                   t.c_str());
      return 2;
    }
    p = q + 1;
  }
  const GemmIsa default_isa = gemm_isa();
  std::vector<GemmIsa> isas;
  try {
    if (isa_list == "all") isas = supported_gemm_isas();
    for (size_t p = 0; !isa_list.empty() && isa_list != "all" && p <= isa_list.size();) {
      const size_t q = std::min(isa_list.find(',', p), isa_list.size());
      const GemmIsa isa = parse_gemm_isa(isa_list.substr(p, q - p));
      if (!gemm_isa_supported(isa)) fail("this CPU has no ", gemm_isa_name(isa), " path");
      isas.push_back(isa);
      p = q + 1;
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_kernels: --isa %s: %s\n", isa_list.c_str(), e.what());
    return 2;
  }
  if (isas.empty()) isas.push_back(default_isa);
  if (isas.size() > 1) isas.erase(std::remove(isas.begin(), isas.end(), GemmIsa::generic), isas.end());
  CpuInfo cpu = detect_cpu();
  std::printf("# oomless kernel bench\n\ncpu: %s, %d threads, isa: %s, gemm path: %s\n\n", cpu.model.c_str(),
              get_threads(), cpu.isa_summary().c_str(), gemm_path().c_str());
  CpuMemory mem(size_t(20) << 30);
  CpuOps ops(&mem.device);

  // SmolLM2-135M's widths (E 576, F 1536, V 49152) and a Llama-style one (E 2048, F 5632).
  std::vector<int64_t> Ts = quick ? std::vector<int64_t>{1024} : std::vector<int64_t>{1024, 4096};
  std::vector<GemmCase> cases;
  for (int64_t T : Ts) {
    cases.push_back({"T x E . E   (q/o proj)", T, 576, 576, false, false});
    cases.push_back({"T x E . F   (up/gate)", T, 1536, 576, false, false});
    cases.push_back({"T x F . E   (down)", T, 576, 1536, false, false});
    cases.push_back({"T x E . V^T (lm head)", T, quick ? 8192 : 49152, 576, false, true});
    cases.push_back({"E x T . F   (weight grad)", 576, 1536, T, true, false});
    cases.push_back({"T x 2048 . 5632", T, 5632, 2048, false, false});
  }
  cases.push_back({"skinny 1 x E . F (decode)", 1, 1536, 576, false, false});
  cases.push_back({"skinny 1 x E . W^T (decode, x W^T)", 1, 1536, 576, false, true});
  cases.push_back({"skinny 1 x E . V^T (decode, lm head)", 1, 49152, 576, false, true});
  cases.push_back({"skinny 16 x 2048 . 5632", 16, 5632, 2048, false, false});
  // A chunk's rows (chunk-recurrent training with --chunk 64 or 128), left out of the medians above (kept
  // comparable with earlier runs).
  cases.push_back({"chunk 64 x E . F", 64, 1536, 576, false, false, false});
  cases.push_back({"chunk 128 x 2048 . 5632", 128, 5632, 2048, false, false, false});
  // The six products of a rank-16 LoRA adapter on a 576 x 576 projection over 1024 rows (z = x A^T, y += s z B^T;
  // dz = dy B, dx += dz A, dA = dz^T x, dB = dy^T z), left out of the medians too.
  cases.push_back({"lora z = x . A^T (r 16)", 1024, 16, 576, false, true, false});
  cases.push_back({"lora z . B^T (r 16)", 1024, 576, 16, false, true, false});
  cases.push_back({"lora dz = dy . B (r 16)", 1024, 16, 576, false, false, false});
  cases.push_back({"lora dz . A (r 16)", 1024, 576, 16, false, false, false});
  cases.push_back({"lora dA = dz^T . x (r 16)", 16, 576, 1024, true, false, false});
  cases.push_back({"lora dB = dy^T . z (r 16)", 576, 16, 1024, true, false, false});
  if (!given.empty()) cases = given;

  std::printf("## GEMM (median of %d alternating runs)\n\n", reps);
  std::printf("| shape | M | N | K | dtype | path | oomless GFLOP/s | oneDNN direct GFLOP/s | ratio |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  double ref_rate = 0;
  std::vector<double> f32_ratios, f32_rates, bf16_rates;
  // Products with a dimension of at most 32 (decode rows, 16 rows, an adapter's rank): their medians on the
  // main path (the default one, or the first given) and oneDNN's, for the table against the memory bound.
  struct SmallRow {
    const GemmCase* g;
    DType t;
    double ours, theirs;  // seconds (theirs 0: no oneDNN product)
  };
  std::vector<SmallRow> small;
  for (DType t : {DType::f32, DType::bf16}) {
    for (const GemmCase& g : cases) {
      size_t esz = dtype_bytes(t, 1);
      Buffer a = mem.device.alloc(esz * g.M * g.K, Category::workspace, "bench a");
      Buffer b = mem.device.alloc(esz * g.K * g.N, Category::workspace, "bench b");
      Buffer c = mem.device.alloc(sizeof(float) * g.M * g.N, Category::workspace, "bench c");
      fill(a.data(), t, g.M * g.K, 1);
      fill(b.data(), t, g.K * g.N, 2);
      Tensor ta(a.data(), t, {g.ta ? g.K : g.M, g.ta ? g.M : g.K});
      Tensor tb(b.data(), t, {g.tb ? g.N : g.K, g.tb ? g.K : g.N});
      Tensor tc = c.view(DType::f32, {g.M, g.N});
      Direct direct(g, t, a.data(), b.data(), c.as<float>());
      std::vector<std::vector<double>> ours(isas.size());
      std::vector<double> theirs;
      for (GemmIsa isa : isas) {  // warm-up: packing buffers, primitive creation
        set_gemm_isa(isa);
        ops.matmul(tc, ta, tb, g.ta, g.tb, false);
      }
      if (direct.ok) direct.run();
      // Each repetition runs the paths and oneDNN in turn, the turn's first one rotating from one repetition to
      // the next: a slot's position in the turn moves its time (the second of two runs of the same path was
      // measured up to 10% faster), and rotating spreads that over every slot alike.
      const size_t slots = isas.size() + (direct.ok ? 1 : 0);
      for (int r = 0; r < reps; ++r) {
        for (size_t j = 0; j < slots; ++j) {
          const size_t i = (j + static_cast<size_t>(r)) % slots;
          const double t0 = now();
          if (i == isas.size()) {
            direct.run();
            theirs.push_back(now() - t0);
            continue;
          }
          set_gemm_isa(isas[i]);
          const double t1 = now();
          ops.matmul(tc, ta, tb, g.ta, g.tb, false);
          ours[i].push_back(now() - t1);
        }
      }
      set_gemm_isa(default_isa);
      double flops = 2.0 * g.M * g.N * g.K;
      for (size_t i = 0; i < isas.size(); ++i) {
        double r_ours = flops / median(ours[i]) * 1e-9;
        const bool main_path = isas[i] == default_isa || (i == 0 && std::find(isas.begin(), isas.end(), default_isa) == isas.end());
        const bool model_shape = g.M > 16 && g.in_median && main_path;
        if (t == DType::f32 && model_shape) f32_rates.push_back(r_ours);
        if (t == DType::bf16 && model_shape) bf16_rates.push_back(r_ours);
        if (main_path && std::min({g.M, g.N, g.K}) <= 32)
          small.push_back({&g, t, median(ours[i]), direct.ok ? median(theirs) : 0.0});
        if (direct.ok) {
          double r_dir = flops / median(theirs) * 1e-9;
          if (t == DType::f32 && model_shape) f32_ratios.push_back(r_ours / r_dir);
          std::printf("| %s | %lld | %lld | %lld | %s | %s | %.1f | %.1f | %.2f |\n", g.what, (long long)g.M,
                      (long long)g.N, (long long)g.K, dtype_name(t), gemm_isa_name(isas[i]), r_ours, r_dir,
                      r_ours / r_dir);
        } else {
          std::printf("| %s | %lld | %lld | %lld | %s | %s | %.1f | n/a (no %s matmul on this CPU) | - |\n", g.what,
                      (long long)g.M, (long long)g.N, (long long)g.K, dtype_name(t), gemm_isa_name(isas[i]), r_ours,
                      dtype_name(t));
        }
      }
      std::fflush(stdout);
    }
  }
  // The small products against the memory bound: the bytes they must move (A and B read, C written) over the
  // triad's bandwidth, measured here after the table.
  if (!small.empty()) {
    const double triad = bench::triad_bytes_per_s();
    std::printf("\n## Products with a dimension of at most 32 against the memory bound (%s path)\n\n"
                "Bound: the bytes of A and B read and of C written over the triad, %.1f GB/s here (operands that "
                "stay in cache can beat it).\n\n"
                "| shape | M | N | K | dtype | MiB | oomless ms | oneDNN ms | bound ms | oomless / bound | oneDNN / bound |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|\n",
                gemm_isa_name(std::find(isas.begin(), isas.end(), default_isa) != isas.end() ? default_isa : isas[0]),
                triad * 1e-9);
    for (const SmallRow& r : small) {
      const GemmCase& g = *r.g;
      const double bytes = static_cast<double>(dtype_bytes(r.t, g.M * g.K) + dtype_bytes(r.t, g.K * g.N)) +
                           4.0 * static_cast<double>(g.M * g.N);
      const double bound = bytes / triad;
      if (r.theirs > 0)
        std::printf("| %s | %lld | %lld | %lld | %s | %.2f | %.3f | %.3f | %.3f | %.2f | %.2f |\n", g.what,
                    (long long)g.M, (long long)g.N, (long long)g.K, dtype_name(r.t), bytes / 1048576.0, r.ours * 1e3,
                    r.theirs * 1e3, bound * 1e3, r.ours / bound, r.theirs / bound);
      else
        std::printf("| %s | %lld | %lld | %lld | %s | %.2f | %.3f | - | %.3f | %.2f | - |\n", g.what, (long long)g.M,
                    (long long)g.N, (long long)g.K, dtype_name(r.t), bytes / 1048576.0, r.ours * 1e3, bound * 1e3,
                    r.ours / bound);
    }
  }
  // The attention ratio's reference: the median of this run's f32 model-shape GEMM rates.
  if (!f32_rates.empty()) ref_rate = median(f32_rates);
  if (!f32_ratios.empty())
    std::printf("\nf32 model-shape ratio oomless/direct (%s): median %.2f, min %.2f\n", gemm_isa_name(default_isa), median(f32_ratios),
                *std::min_element(f32_ratios.begin(), f32_ratios.end()));

  // Causal attention: f32 products over f32 and bf16 K/V (the rate against the f32 GEMMs'), and bf16 products
  // over bf16 K/V as bf16 compute runs them (against the bf16 GEMMs': on amx, AMX tiles).
  const double bf16_ref = bf16_rates.empty() ? 0.0 : median(bf16_rates);
  if (table("attention")) {
  std::printf("\n## Causal attention forward+backward (median of %d runs)\n\n", reps);
  std::printf("FLOPs counted as 4*T*T*D*H/2 forward and 2.5x that backward; reference GEMM rates %.1f (f32) and %.1f "
              "(bf16) GFLOP/s: medians of this run's model-shape GEMMs on the default path\n\n",
              ref_rate, bf16_ref);
  std::printf("The last column times one reference GEMM (1024 x 1536 x 576, up/gate, the products' dtype) beside each "
              "repetition (after it, before it every other time) and takes the median of the repetitions' ratios: a "
              "machine whose speed moves between the tables moves both sides of it together.\n\n");
  std::printf("| T | H | Hkv | D | K/V | products | fwd GFLOP/s | fwd+bwd GFLOP/s | fwd+bwd / GEMM of the products' dtype | "
              "the same, GEMM beside each repetition |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  // The reference GEMM run beside each repetition: the up/gate shape at T 1024, f32 and bf16 operands.
  const int64_t gM = 1024, gN = 1536, gK = 576;
  Buffer ga32 = mem.device.alloc(sizeof(float) * gM * gK, Category::workspace, "ref a"),
         gb32 = mem.device.alloc(sizeof(float) * gK * gN, Category::workspace, "ref b"),
         ga16 = mem.device.alloc(dtype_bytes(DType::bf16, gM * gK), Category::workspace, "ref a bf16"),
         gb16 = mem.device.alloc(dtype_bytes(DType::bf16, gK * gN), Category::workspace, "ref b bf16"),
         gc = mem.device.alloc(sizeof(float) * gM * gN, Category::workspace, "ref c");
  fill(ga32.data(), DType::f32, gM * gK, 6);
  fill(gb32.data(), DType::f32, gK * gN, 7);
  fill(ga16.data(), DType::bf16, gM * gK, 6);
  fill(gb16.data(), DType::bf16, gK * gN, 7);
  const Tensor gcv = gc.view(DType::f32, {gM, gN});
  struct AttnCase {
    int64_t T, H, Hkv, D;
  };
  int64_t TA = quick ? 1024 : 4096;
  for (int mode = 0; mode < 3; ++mode)  // f32 K/V, bf16 K/V, bf16 K/V with bf16 products
  for (AttnCase ac : {AttnCase{TA, 9, 3, 64}, AttnCase{TA, 8, 2, 128}}) {
    const DType kvt = mode == 0 ? DType::f32 : DType::bf16;
    const bool bf16_products = mode == 2;
    int64_t T = ac.T, H = ac.H, Hkv = ac.Hkv, D = ac.D;
    auto act = [&](int64_t n, Category c, const char* w) { return mem.device.alloc(sizeof(float) * n, c, w); };
    Buffer q = act(T * H * D, Category::activations, "q"), o = act(T * H * D, Category::activations, "o");
    Buffer dq = act(T * H * D, Category::activations, "dq"), dout = act(T * H * D, Category::activations, "dout");
    Buffer lse = act(T * H, Category::activations, "lse");
    Buffer kv = mem.device.alloc(dtype_bytes(kvt, 2 * T * Hkv * D), Category::kv, "kv");
    Buffer dkv = act(2 * T * Hkv * D, Category::kv_grad, "dkv");
    Buffer pos = mem.device.alloc(sizeof(int32_t) * T, Category::activations, "pos");
    fill(q.data(), DType::f32, T * H * D, 3);
    fill(dout.data(), DType::f32, T * H * D, 4);
    fill(kv.data(), kvt, 2 * T * Hkv * D, 5);
    for (int64_t t = 0; t < T; ++t) pos.as<int32_t>()[t] = static_cast<int32_t>(t);
    KvBlock blk{kv.data(), kv.as<char>() + dtype_bytes(kvt, T * Hkv * D), 0, static_cast<int32_t>(T)};
    KvBlock dblk{dkv.as<float>(), dkv.as<float>() + T * Hkv * D, 0, static_cast<int32_t>(T)};
    KvBlocks kvs{&blk, 1, Hkv, T, D, kvt}, dkvs{&dblk, 1, Hkv, T, D, DType::f32};
    kvs.bf16_products = bf16_products;
    Tensor tq = q.view(DType::f32, {T, H, D}), to = o.view(DType::f32, {T, H, D});
    Tensor tdq = dq.view(DType::f32, {T, H, D}), tdo = dout.view(DType::f32, {T, H, D});
    Tensor tl = lse.view(DType::f32, {H, T}), tp = pos.view(DType::i32, {T});
    double scale = 1.0 / std::sqrt(static_cast<double>(D));
    std::vector<double> fwd, both, beside;
    const DType gt = bf16_products ? DType::bf16 : DType::f32;
    const Tensor gav((bf16_products ? ga16 : ga32).data(), gt, {gM, gK}), gbv((bf16_products ? gb16 : gb32).data(), gt, {gK, gN});
    const double f = 4.0 * T * T * D * H / 2;
    ops.attention_forward(to, tl, tq, kvs, tp, scale);
    ops.matmul(gcv, gav, gbv, false, false, false);
    for (int r = 0; r < reps; ++r) {
      double tg = 0;  // the reference GEMM: after the attention pass, or before it every other repetition
      auto gemm = [&] {
        const double g0 = now();
        ops.matmul(gcv, gav, gbv, false, false, false);
        tg = now() - g0;
      };
      if (r % 2) gemm();
      double t0 = now();
      ops.attention_forward(to, tl, tq, kvs, tp, scale);
      double t1 = now();
      ops.attention_backward(tdq, dkvs, tdo, tq, kvs, to, tl, tp, scale);
      double t2 = now();
      if (r % 2 == 0) gemm();
      fwd.push_back(t1 - t0);
      both.push_back(t2 - t0);
      beside.push_back((3.5 * f / (t2 - t0)) / (2.0 * gM * gN * gK / tg));
    }
    double r_fwd = f / median(fwd) * 1e-9, r_both = 3.5 * f / median(both) * 1e-9;
    const double ref = bf16_products ? bf16_ref : ref_rate;
    std::printf("| %lld | %lld | %lld | %lld | %s | %s | %.1f | %.1f | %.2f | %.2f |\n", (long long)T, (long long)H,
                (long long)Hkv, (long long)D, dtype_name(kvt), bf16_products ? "bf16" : "f32", r_fwd, r_both,
                ref > 0 ? r_both / ref : 0.0, median(beside));
    std::fflush(stdout);
  }
  }
  // A decode step's attention: one position, SmolLM2's 9 query and 3 KV heads (D 64), over 30 layers' caches of
  // 1024 positions (--quick: 256), beyond the caches as a step's are; the direct decode kernels against
  // Gemm::tile's packed panels (set_decode_direct_kernels), alternating, and a plain read of the caches' bytes.
  if (table("decode")) {
    const int64_t L = 30, H = 9, Hkv = 3, D = 64, T = quick ? 256 : 1024;
    std::printf("\n## Decode attention: one position over %lld layers' caches of %lld positions, %lld/%lld heads, "
                "D %lld (median of %d alternating runs)\n\n",
                (long long)L, (long long)T, (long long)H, (long long)Hkv, (long long)D, reps);
    std::printf("| K/V | MiB | direct ms | Gemm::tile ms | direct / tile | direct GB/s | plain read GB/s |\n"
                "|---|---|---|---|---|---|---|\n");
    const bool saved = decode_direct_kernels();
    for (DType kvt : {DType::f32, DType::bf16}) {
      const int64_t side = dtype_bytes(kvt, Hkv * T * D);
      Buffer caches = mem.device.alloc(static_cast<size_t>(2 * L * side), Category::kv, "bench decode caches");
      fill(caches.data(), kvt, 2 * L * Hkv * T * D, 41);
      Buffer q = mem.device.alloc(sizeof(float) * H * D, Category::activations, "q");
      Buffer o = mem.device.alloc(sizeof(float) * H * D, Category::activations, "o");
      Buffer lse = mem.device.alloc(sizeof(float) * H, Category::activations, "lse");
      Buffer pos = mem.device.alloc(sizeof(int32_t), Category::activations, "pos");
      fill(q.data(), DType::f32, H * D, 42);
      pos.as<int32_t>()[0] = static_cast<int32_t>(T - 1);
      std::vector<KvBlock> blk(static_cast<size_t>(L));
      for (int64_t l = 0; l < L; ++l)
        blk[static_cast<size_t>(l)] = KvBlock{caches.as<char>() + 2 * l * side, caches.as<char>() + (2 * l + 1) * side, 0,
                                              static_cast<int32_t>(T)};
      const double scale = 1.0 / std::sqrt(static_cast<double>(D));
      auto step = [&] {
        for (int64_t l = 0; l < L; ++l) {
          KvBlocks kvs{&blk[static_cast<size_t>(l)], 1, Hkv, T, D, kvt};
          ops.attention_forward(o.view(DType::f32, {1, H, D}), lse.view(DType::f32, {H, 1}), q.view(DType::f32, {1, H, D}),
                                kvs, pos.view(DType::i32, {1}), scale);
        }
      };
      typedef uint64_t v4u __attribute__((vector_size(32)));
      uint64_t sink = 0;
      const int64_t total = 2 * L * side;
      auto read = [&] {
        uint64_t x = 0;
#pragma omp parallel reduction(^ : x)
        {
          v4u acc = {};
#pragma omp for schedule(static)
          for (int64_t j = 0; j < total / 32; ++j) {
            v4u v;
            std::memcpy(&v, caches.as<char>() + 32 * j, 32);
            acc ^= v;
          }
          x ^= acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
        }
        sink ^= x;
      };
      std::vector<double> td, tt, tr;
      set_decode_direct_kernels(true), step(), set_decode_direct_kernels(false), step(), read();
      for (int r = 0; r < reps; ++r) {
        set_decode_direct_kernels(true);
        double t0 = now();
        step();
        double t1 = now();
        set_decode_direct_kernels(false);
        step();
        double t2 = now();
        read();
        double t3 = now();
        td.push_back(t1 - t0), tt.push_back(t2 - t1), tr.push_back(t3 - t2);
      }
      const double b = static_cast<double>(total);
      std::printf("| %s | %.1f | %.2f | %.2f | %.2f | %.1f | %.1f |%s\n", dtype_name(kvt), b / 1048576.0, median(td) * 1e3,
                  median(tt) * 1e3, median(td) / median(tt), b / median(td) * 1e-9, b / median(tr) * 1e-9,
                  sink == 1 ? " " : "");
      std::fflush(stdout);
    }
    set_decode_direct_kernels(saved);
  }
  // Optimizer steps over one tensor: fp32 AdamW (28 bytes of memory traffic a parameter: p, m, v read and
  // written, g read) against AdamW8bit (about 16: p read and written, g read, two codes read and written).
  if (table("optim")) {
    const int64_t n = quick ? (int64_t{1} << 22) : (int64_t{1} << 24), blocks = (n + kAdam8Block - 1) / kAdam8Block;
    std::printf("\n## Optimizer step over %lld parameters (median of %d alternating runs)\n\n", (long long)n, reps);
    std::printf("| optimizer | ms | parameters/s (M) | GB/s of state traffic |\n|---|---|---|---|\n");
    auto f32buf = [&](int64_t k, const char* w) { return mem.host.alloc(sizeof(float) * k, Category::optimizer, w); };
    Buffer p = f32buf(n, "p"), g = f32buf(n, "g"), m = f32buf(n, "m"), v = f32buf(n, "v");
    Buffer ma = f32buf(blocks, "m absmax"), va = f32buf(blocks, "v absmax");
    Buffer mc = mem.host.alloc(n, Category::optimizer, "m codes"), vc = mem.host.alloc(n, Category::optimizer, "v codes");
    fill(p.data(), DType::f32, n, 11);
    fill(g.data(), DType::f32, n, 12);
    std::memset(m.data(), 0, sizeof(float) * n);
    std::memset(v.data(), 0, sizeof(float) * n);
    std::memset(mc.data(), 0, n);
    std::memset(vc.data(), 0, n);
    std::memset(ma.data(), 0, sizeof(float) * blocks);
    std::memset(va.data(), 0, sizeof(float) * blocks);
    Tensor tp = p.view(DType::f32, {n}), tg = g.view(DType::f32, {n}), tm = m.view(DType::f32, {n}), tv = v.view(DType::f32, {n});
    Tensor tmc = mc.view(DType::u8, {n}), tvc = vc.view(DType::u8, {n});
    Tensor tma = ma.view(DType::f32, {blocks}), tva = va.view(DType::f32, {blocks});
    AdamWConfig c;
    c.lr = 1e-6;  // small, so repeated steps keep the parameters where they are
    c.weight_decay = 0.01;
    std::vector<double> t32, t8;
    for (int r = 0; r <= reps; ++r) {
      c.step = r + 1;
      double t0 = now();
      ops.adamw_step(tp, tg, tm, tv, c);
      double t1 = now();
      ops.adamw8bit_step(tp, tg, tmc, tma, tvc, tva, c);
      double t2 = now();
      if (r > 0) t32.push_back(t1 - t0), t8.push_back(t2 - t1);  // the first pair warms the pages
    }
    for (auto [name, t, bytes] : {std::tuple{"adamw", median(t32), 28.0}, std::tuple{"adamw8bit", median(t8), 16.0}})
      std::printf("| %s | %.1f | %.0f | %.1f |\n", name, t * 1e3, n / t * 1e-6, bytes * n / t * 1e-9);
  }
  // One-row products over GGUF blocks (a decode step's projections and LM head): the f32 kernel (elements made
  // from the blocks in registers, the bits of the dequantised product) against the integer one with the row
  // quantised to 8 bits (generate --decode-dot int8), over a matrix larger than the caches (four of
  // SmolLM2's LM heads: 196608 x 576; --quick: 8192 rows, in cache), the threads streaming their shares of
  // its rows, and a plain read of the same bytes (32-byte words) as the ceiling.
  if (table("rows")) {
    const int64_t K = 576, rows = quick ? 8192 : 4 * 49152;
    std::printf("\n## One-row products over GGUF blocks, %lld x %lld (median of %d alternating runs; int8: %s)\n\n",
                (long long)rows, (long long)K, reps, ggml_row_dot_q8_form());
    std::printf("| type | MiB | f32 kernel GB/s | int8 kernel GB/s | int8 / f32 | plain read GB/s |\n|---|---|---|---|---|---|\n");
    std::vector<float> x(static_cast<size_t>(K));
    fill(x.data(), DType::f32, K, 21);
    std::vector<char> xq_mem(q8_act_bytes(K));
    const Q8Act xq = q8_act_at(xq_mem.data(), K);
    for (GgmlType t : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0}) {
      const GgmlRowDot f32k = ggml_row_dot(t);
      const GgmlRowDotQ8 i8k = ggml_row_dot_q8(t);
      if (!f32k || !i8k) {
        std::printf("| %s | - | (no vector kernel on this path) | | | |\n", ggml_type_name(t).c_str());
        continue;
      }
      const int64_t bytes = ggml_type_info(static_cast<uint32_t>(t))->type_size, rb = K / 32 * bytes;
      Buffer w = mem.device.alloc(static_cast<size_t>(rows * rb), Category::workspace, "bench blocks");
      std::mt19937_64 rng(31);
      for (int64_t i = 0; i < rows * rb; ++i) w.as<uint8_t>()[i] = static_cast<uint8_t>(rng());
      for (int64_t i = 0; i < rows * K / 32; ++i) {  // finite scales (and Q4_1 mins): 2^-7
        const uint16_t h = 0x2000;
        std::memcpy(w.as<uint8_t>() + i * bytes, &h, 2);
        if (t == GgmlType::Q4_1) std::memcpy(w.as<uint8_t>() + i * bytes + 2, &h, 2);
      }
      std::vector<float> out(static_cast<size_t>(rows));
      const uint8_t* base = w.as<uint8_t>();
      auto run_f32 = [&] {
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < rows; j += 8) {
          const uint8_t* p[8];
          for (int i = 0; i < 8; ++i) p[i] = base + (j + i) * rb;
          float acc[64] = {};
          f32k(p, 8, K / 32, x.data(), acc, 8 * rb);
          out[static_cast<size_t>(j)] = acc[0];
        }
      };
      auto run_i8 = [&] {
        quantise_q8_act(x.data(), xq);
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < rows; j += 8) {
          const uint8_t* p[8];
          for (int i = 0; i < 8; ++i) p[i] = base + (j + i) * rb;
          i8k(p, 8, K / 32, xq, out.data() + j, 8 * rb);
        }
      };
      typedef uint64_t v4u __attribute__((vector_size(32)));
      uint64_t sink = 0;
      auto run_read = [&] {
        uint64_t total = 0;
#pragma omp parallel reduction(^ : total)
        {
          v4u acc[4] = {};
#pragma omp for schedule(static)
          for (int64_t j = 0; j < rows * rb / 128; ++j)
            for (int u = 0; u < 4; ++u) {
              v4u v;
              std::memcpy(&v, base + 128 * j + 32 * u, 32);
              acc[u] ^= v;
            }
          for (int u = 0; u < 4; ++u) total ^= acc[u][0] ^ acc[u][1] ^ acc[u][2] ^ acc[u][3];
        }
        sink ^= total;
      };
      std::vector<double> tf, ti, tr;
      run_f32(), run_i8(), run_read();
      for (int r = 0; r < reps; ++r) {
        double t0 = now();
        run_f32();
        double t1 = now();
        run_i8();
        double t2 = now();
        run_read();
        double t3 = now();
        tf.push_back(t1 - t0), ti.push_back(t2 - t1), tr.push_back(t3 - t2);
      }
      const double b = static_cast<double>(rows * rb);
      std::printf("| %s | %.1f | %.1f | %.1f | %.2f | %.1f |%s\n", ggml_type_name(t).c_str(), b / 1048576.0,
                  b / median(tf) * 1e-9, b / median(ti) * 1e-9, median(tf) / median(ti), b / median(tr) * 1e-9,
                  sink == 1 ? " " : "");
    }
  }
  std::printf("\nledger peak (all bench buffers and scratch): %s\n", format_bytes(mem.ledger.peak_all()).c_str());
  return 0;
}
