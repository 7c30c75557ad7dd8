#include "plan/probe.h"

#include "memory/allocator.h"

#include <cstdio>
#include <random>
#include <sstream>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm.h"
#include "memory/arena.h"
#ifdef OOMLESS_WITH_CUDA
#include "backend/cuda/cuda_info.h"
#endif

namespace oomless {

namespace {

void fill_random(float* p, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  for (int64_t i = 0; i < n; ++i) p[i] = d(rng);
}

double gemm_rate(CpuOps& ops, CpuMemory& mem, int n, DType t, int reps) {
  size_t elem = dtype_bytes(t, 1);
  Buffer a = mem.device.alloc(n * n * elem, Category::workspace, "probe a");
  Buffer b = mem.device.alloc(n * n * elem, Category::workspace, "probe b");
  Buffer c = mem.device.alloc(n * n * sizeof(float), Category::workspace, "probe c");
  std::vector<float> tmp(static_cast<size_t>(n) * n);
  fill_random(tmp.data(), n * n, 1);
  convert(a.data(), t, tmp.data(), DType::f32, n * n);
  convert(b.data(), t, tmp.data(), DType::f32, n * n);
  GemmShape s;
  s.M = s.N = s.K = n;
  s.ab = t;
  double sec = median_seconds(reps, [&] { ops.gemm().run(s, a.data(), b.data(), c.as<float>()); });
  return 2.0 * n * n * n / sec * 1e-9;
}

// bf16: bf16 K/V and bf16 products (as bf16 compute runs attention; on AMX its tiles).
double attention_rate(CpuOps& ops, CpuMemory& mem, int T, int H, int Hkv, int D, int reps, bool bf16) {
  Buffer q = mem.device.alloc(sizeof(float) * T * H * D, Category::activations, "probe q");
  Buffer o = mem.device.alloc(sizeof(float) * T * H * D, Category::activations, "probe o");
  Buffer dq = mem.device.alloc(sizeof(float) * T * H * D, Category::activations, "probe dq");
  Buffer dout = mem.device.alloc(sizeof(float) * T * H * D, Category::activations, "probe dout");
  Buffer lse = mem.device.alloc(sizeof(float) * T * H, Category::activations, "probe lse");
  Buffer kv = mem.device.alloc(sizeof(float) * 2 * T * Hkv * D, Category::kv, "probe kv");
  Buffer dkv = mem.device.alloc(sizeof(float) * 2 * T * Hkv * D, Category::kv_grad, "probe dkv");
  Buffer pos = mem.device.alloc(sizeof(int32_t) * T, Category::activations, "probe pos");
  fill_random(q.as<float>(), int64_t(T) * H * D, 2);
  fill_random(dout.as<float>(), int64_t(T) * H * D, 3);
  fill_random(kv.as<float>(), int64_t(2) * T * Hkv * D, 4);
  for (int t = 0; t < T; ++t) pos.as<int32_t>()[t] = t;
  KvBlock blk{kv.as<float>(), kv.as<float>() + int64_t(T) * Hkv * D, 0, T};
  KvBlock dblk{dkv.as<float>(), dkv.as<float>() + int64_t(T) * Hkv * D, 0, T};
  if (bf16) {  // the same values rounded, K then V, at the front of the buffer
    const std::vector<float> f(kv.as<float>(), kv.as<float>() + int64_t(2) * T * Hkv * D);
    oomless::convert(kv.data(), DType::bf16, f.data(), DType::f32, static_cast<int64_t>(f.size()));
    blk = KvBlock{kv.data(), kv.as<uint16_t>() + int64_t(T) * Hkv * D, 0, T};
  }
  KvBlocks kvs{&blk, 1, Hkv, T, D, bf16 ? DType::bf16 : DType::f32, bf16};
  KvBlocks dkvs{&dblk, 1, Hkv, T, D, DType::f32};
  Tensor tq = q.view(DType::f32, {T, H, D}), to = o.view(DType::f32, {T, H, D});
  Tensor tdq = dq.view(DType::f32, {T, H, D}), tdo = dout.view(DType::f32, {T, H, D});
  Tensor tl = lse.view(DType::f32, {H, T}), tp = pos.view(DType::i32, {T});
  double scale = 1.0 / std::sqrt(static_cast<double>(D));
  double sec = median_seconds(reps, [&] {
    ops.attention_forward(to, tl, tq, kvs, tp, scale);
    ops.attention_backward(tdq, dkvs, tdo, tq, kvs, to, tl, tp, scale);
  });
  double fwd = 4.0 * T * T * D * H / 2;
  return 3.5 * fwd / sec * 1e-9;
}

double bandwidth(CpuMemory& mem, size_t bytes_per_array, int reps) {
  int64_t n = static_cast<int64_t>(bytes_per_array / sizeof(float));
  Buffer a = mem.device.alloc(n * sizeof(float), Category::workspace, "probe stream a");
  Buffer b = mem.device.alloc(n * sizeof(float), Category::workspace, "probe stream b");
  Buffer c = mem.device.alloc(n * sizeof(float), Category::workspace, "probe stream c");
  float *pa = a.as<float>(), *pb = b.as<float>(), *pc = c.as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    pa[i] = 0.f;
    pb[i] = 1.f;
    pc[i] = 2.f;
  }
  double sec = median_seconds(reps, [&] {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) pa[i] = pb[i] + 3.f * pc[i];
  });
  return 3.0 * n * sizeof(float) / sec * 1e-9;
}

}  // namespace

ProbeResult run_probe(bool quick) {
  ProbeResult r;
  r.cpu = detect_cpu();
  CpuMemory mem(size_t(64) << 30);
  CpuOps ops(&mem.device);
  // The rates are the CPU backend's own kernels driven from inside it (its GEMM object, its buffers filled in
  // place), so Device memory is open for the whole measurement (memory/allocator.h, strict mode).
  DeviceAccess inside;
  r.gemm_n = quick ? 256 : 2048;
  int reps = quick ? 3 : 7;
  r.gemm_f32_gflops = gemm_rate(ops, mem, r.gemm_n, DType::f32, reps);
  r.gemm_bf16_gflops = gemm_rate(ops, mem, r.gemm_n, DType::bf16, reps);
  r.attn_T = quick ? 256 : 2048;
  r.attn_H = 8;
  r.attn_D = 64;
  r.attention_gflops = attention_rate(ops, mem, r.attn_T, r.attn_H, 2, r.attn_D, quick ? 2 : 5, false);
  r.attention_bf16_gflops = attention_rate(ops, mem, r.attn_T, r.attn_H, 2, r.attn_D, quick ? 2 : 5, true);
  r.bandwidth_bytes = quick ? (size_t(8) << 20) : (size_t(256) << 20);
  r.bandwidth_gbs = bandwidth(mem, r.bandwidth_bytes, reps);
#ifdef OOMLESS_WITH_CUDA
  CudaInfo ci = query_cuda();
  if (ci.devices == 0) {
    r.cuda = "built, no device (" + ci.error + ")";
  } else {
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s, sm_%d%d, %.1f GiB (%d device%s)", ci.name.c_str(), ci.sm_major, ci.sm_minor,
                  ci.total_bytes / 1073741824.0, ci.devices, ci.devices > 1 ? "s" : "");
    r.cuda = buf;
  }
#else
  r.cuda = "not built";
#endif
  r.gemm_path = oomless::gemm_path();
  return r;
}

std::string ProbeResult::text() const {
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "cpu            %s\n"
                "logical cpus   %d (using %d threads)\n"
                "isa            %s\n"
                "gemm path      %s\n"
                "gemm f32       %.1f GFLOP/s (n=%d)\n"
                "gemm bf16      %.1f GFLOP/s (n=%d)\n"
                "attention      %.1f GFLOP/s fwd+bwd (T=%d H=%d D=%d causal)\n"
                "attention bf16 %.1f GFLOP/s fwd+bwd (bf16 K/V and products)\n"
                "bandwidth      %.1f GB/s (triad over 3 x %.0f MiB)\n"
                "cuda           %s\n",
                cpu.model.c_str(), cpu.logical_cpus, cpu.threads, cpu.isa_summary().c_str(), gemm_path.c_str(),
                gemm_f32_gflops, gemm_n, gemm_bf16_gflops, gemm_n, attention_gflops,
                attn_T, attn_H, attn_D, attention_bf16_gflops, bandwidth_gbs, bandwidth_bytes / 1048576.0, cuda.c_str());
  return buf;
}

std::string ProbeResult::json() const {
  std::ostringstream os;
  os << "{\"cpu\": \"" << cpu.model << "\", \"logical_cpus\": " << cpu.logical_cpus << ", \"threads\": " << cpu.threads
     << ", \"isa\": \"" << cpu.isa_summary() << "\", \"avx512\": " << (cpu.avx512f ? "true" : "false")
     << ", \"amx\": " << (cpu.amx_bf16 ? "true" : "false") << ", \"gemm_path\": \"" << gemm_path
     << "\", \"gemm_f32_gflops\": " << gemm_f32_gflops
     << ", \"gemm_bf16_gflops\": " << gemm_bf16_gflops 
     << ", \"gemm_n\": " << gemm_n << ", \"attention_gflops\": " << attention_gflops
     << ", \"attention_bf16_gflops\": " << attention_bf16_gflops << ", \"attention_shape\": {\"T\": "
     << attn_T << ", \"H\": " << attn_H << ", \"D\": " << attn_D << "}, \"bandwidth_gbs\": " << bandwidth_gbs << ", \"cuda\": \"" << cuda << "\"}";
  return os.str();
}

}  // namespace oomless
