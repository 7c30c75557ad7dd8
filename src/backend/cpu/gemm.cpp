// Gemm::run: the blocked, multi-threaded GEMM of gemm_blocked.cpp, for f32 and bf16 operands.
//
// Its results are bitwise the same for any number of threads (the partition of the work depends only
// on the shape, and each output's k slices are added in a fixed order), which bit-exact resume needs;
// oneDNN's own threading is not (its K split follows the thread count). The packing buffers (one
// shared B panel, one A block per thread, a few MiB at most) come from the workspace arena, grow when a
// larger shape needs more, and are kept between calls, so nothing is allocated in the step loop once
// the shapes have been seen.
#include "backend/cpu/gemm.h"

#include <omp.h>

#include <algorithm>
#include <mutex>

#include "backend/cpu/gemm_kernel.h"
#include "core/error.h"
#include "memory/arena.h"

namespace oomless {

struct Gemm::Impl {
  explicit Impl(Arena& ws) : arena(ws) {}
  Arena& arena;
  std::mutex mu;  // the packing buffers serve one product at a time
  Buffer bpack;   // (kc x nc) packed B panel, shared by the threads
  Buffer apack;   // threads x (mc x kc) packed A blocks

  static void ensure(Buffer& buf, Arena& arena, size_t bytes, const char* what) {
    if (bytes <= buf.size()) return;
    buf.reset();
    buf = arena.alloc(bytes, Category::workspace, what);
  }
};

std::array<size_t, 2> Gemm::pack_bytes(const GemmShape& s, int64_t threads) {
  const gemm_detail::BlockedSizes z = gemm_detail::blocked_sizes(s);
  return {z.b_floats * sizeof(float), static_cast<size_t>(std::max<int64_t>(threads, 1)) * z.a_floats_per_thread * sizeof(float)};
}

Gemm::Gemm(Arena& workspace) : impl_(std::make_unique<Impl>(workspace)) {}
Gemm::~Gemm() = default;

void Gemm::run(const GemmShape& shape, const void* a, const void* b, float* c) {
  GemmShape s = shape;
  if (s.lda == 0) s.lda = s.ta ? s.M : s.K;
  if (s.ldb == 0) s.ldb = s.tb ? s.K : s.N;
  if (s.ldc == 0) s.ldc = s.N;
  OOM_CHECK(s.M >= 0 && s.N >= 0 && s.K >= 0, "[gemm] negative dimension");
  OOM_CHECK(s.ab == DType::f32 || s.ab == DType::bf16, "[gemm] operands must be f32 or bf16, got ", dtype_name(s.ab));
  OOM_CHECK(!s.b_as_bf16 || s.ab == DType::bf16 || s.b_quant, "[gemm] b read as bf16 needs a bf16 a");
  if (s.b_quant) OOM_CHECK(s.ldb == s.b_quant->cols, "[gemm] a quantised b is read with ldb = its cols");
  if (s.M == 0 || s.N == 0) return;
  if (s.K == 0) {
    if (!s.accumulate)
      for (int64_t i = 0; i < s.M; ++i)
        for (int64_t j = 0; j < s.N; ++j) c[i * s.ldc + j] = 0.0f;
    return;
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  const std::array<size_t, 2> bytes = pack_bytes(s, omp_get_max_threads());
  Impl::ensure(impl_->bpack, impl_->arena, bytes[0], "gemm packed B panel");
  Impl::ensure(impl_->apack, impl_->arena, bytes[1], "gemm packed A blocks");
  gemm_detail::gemm_blocked(s, a, b, c, impl_->bpack.as<float>(), impl_->apack.as<float>());
}

}  // namespace oomless
