// Gemm::run through oneDNN's matmul primitive, deterministically for any thread count.
//
// oneDNN's own threading changes how it splits the K reduction with the thread count (3 threads give
// other bits than 1 or 2), which would break bit-exact resume. So the output is cut into tiles whose
// size depends only on the shape, each tile is one single-threaded oneDNN matmul over the whole K, and
// the tiles are spread over the OpenMP threads. Primitives are cached per tile shape; their
// scratchpads are user-managed, one per thread, from the workspace arena, so the ledger sees them.
// Where the CPU has no bf16 matmul (oneDNN needs AVX-512 for it) bf16 operands are widened to f32 in
// workspace first.
#include "backend/cpu/gemm.h"

#include <dnnl.hpp>
#include <omp.h>

#include <algorithm>
#include <vector>

#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "core/error.h"
#include "memory/arena.h"

namespace oomless {

namespace {

using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t, int, bool>;

struct Cached {
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c;
  size_t scratch_bytes = 0;
};

void fill_defaults(GemmShape& s) {
  if (s.lda == 0) s.lda = s.ta ? s.M : s.K;
  if (s.ldb == 0) s.ldb = s.tb ? s.K : s.N;
  if (s.ldc == 0) s.ldc = s.N;
}


// Tile sizes from the shape alone (never from the thread count). Tall products use 256-row tiles
// and wide column panels; skinny ones (few rows) split the columns into at least 8 panels.
void tile_sizes(const GemmShape& s, int64_t* mb, int64_t* nb) {
  *mb = s.M >= 512 ? 256 : s.M;
  if (s.M >= 512) {
    *nb = std::min<int64_t>(s.N, 2048);
  } else {
    int64_t panels = std::max<int64_t>(1, std::min<int64_t>(16, (s.M * s.N) / (64 * 256)));
    *nb = std::max<int64_t>(64, ((s.N + panels - 1) / panels + 63) / 64 * 64);
    *nb = std::min(*nb, s.N);
  }
}

}  // namespace

struct Gemm::Impl {
  explicit Impl(Arena& ws) : arena(ws), eng(dnnl::engine::kind::cpu, 0) {}
  Arena& arena;
  dnnl::engine eng;
  std::vector<dnnl::stream> streams;  // one per thread
  std::mutex mu;
  std::map<Key, Cached> cache;
  Buffer scratch;      // one scratchpad slot per thread
  size_t slot = 0;     // bytes per slot
  Buffer widened;      // bf16 -> f32 copies when no bf16 primitive exists

  // The primitive for one tile (rows x cols of the output, whole K). Null when oneDNN has no
  // implementation for these types on this CPU.
  Cached* get(const GemmShape& s, int64_t rows, int64_t cols, DType ab) {
    Key k{rows, cols, s.K, s.ta, s.tb, s.lda, s.ldb, s.ldc, static_cast<int>(ab), s.accumulate};
    auto it = cache.find(k);
    if (it != cache.end()) return &it->second;
    using dt = dnnl::memory::data_type;
    dt t = ab == DType::bf16 ? dt::bf16 : dt::f32;
    dnnl::memory::dims a_strides = s.ta ? dnnl::memory::dims{1, s.lda} : dnnl::memory::dims{s.lda, 1};
    dnnl::memory::dims b_strides = s.tb ? dnnl::memory::dims{1, s.ldb} : dnnl::memory::dims{s.ldb, 1};
    Cached c;
    c.a = dnnl::memory::desc({rows, s.K}, t, a_strides);
    c.b = dnnl::memory::desc({s.K, cols}, t, b_strides);
    c.c = dnnl::memory::desc({rows, cols}, dt::f32, dnnl::memory::dims{s.ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (s.accumulate) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    try {
      dnnl::matmul::desc d(c.a, c.b, c.c);
      dnnl::matmul::primitive_desc pd(d, attr, eng);
      c.prim = dnnl::matmul(pd);
      c.scratch_bytes = pd.scratchpad_desc().get_size();
    } catch (const dnnl::error& e) {
      if (e.status == dnnl_unimplemented) return nullptr;
      fail("[gemm] oneDNN could not create a matmul for a ", rows, "x", cols, " tile with K=", s.K, ": ", e.what());
    }
    return &cache.emplace(k, std::move(c)).first->second;
  }

  // f32 or native-bf16 product: tiles over the threads. Returns false when a tile has no primitive.
  bool tiled(const GemmShape& s, const void* a, const void* b, float* c) {
    int64_t mb, nb;
    tile_sizes(s, &mb, &nb);
    int64_t mt = (s.M + mb - 1) / mb, nt = (s.N + nb - 1) / nb;
    int64_t last_m = s.M - (mt - 1) * mb, last_n = s.N - (nt - 1) * nb;
    Cached* prim[2][2] = {};
    size_t need = 0;
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        prim[i][j] = get(s, i ? last_m : mb, j ? last_n : nb, s.ab);
        if (!prim[i][j]) return false;
        need = std::max(need, prim[i][j]->scratch_bytes);
      }
    int threads = omp_get_max_threads();
    need = (need + 63) / 64 * 64;
    if (need * threads > scratch.size() || static_cast<int>(streams.size()) < threads) {
      scratch.reset();
      slot = need;
      if (need) scratch = arena.alloc(need * threads, Category::workspace, "gemm scratchpads");
      while (static_cast<int>(streams.size()) < threads) streams.emplace_back(eng);
    }
    size_t esz = static_cast<size_t>(dtype_bytes(s.ab, 1));
    const char* ab = static_cast<const char*>(a);
    const char* bb = static_cast<const char*>(b);
    int64_t tiles = mt * nt;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      int64_t i = t / nt, j = t % nt;
      Cached& p = *prim[i == mt - 1][j == nt - 1];
      int64_t i0 = i * mb, j0 = j * nb;
      const void* at = ab + esz * (s.ta ? i0 : i0 * s.lda);
      const void* bt = bb + esz * (s.tb ? j0 * s.ldb : j0);
      float* ct = c + i0 * s.ldc + j0;
      int tid = omp_get_thread_num();
      dnnl::memory am(p.a, eng, const_cast<void*>(at));
      dnnl::memory bm(p.b, eng, const_cast<void*>(bt));
      dnnl::memory cm(p.c, eng, ct);
      std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
      if (p.scratch_bytes) {
        dnnl::memory::desc sd({static_cast<int64_t>(p.scratch_bytes)}, dnnl::memory::data_type::u8,
                              dnnl::memory::dims{1});
        args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(sd, eng, scratch.as<char>() + tid * slot));
      }
      p.prim.execute(streams[tid], args);
      streams[tid].wait();
    }
    return true;
  }
};

Gemm::Gemm(Arena& workspace) : impl_(std::make_unique<Impl>(workspace)) {}
Gemm::~Gemm() = default;

void Gemm::run(const GemmShape& shape, const void* a, const void* b, float* c) {
  GemmShape s = shape;
  fill_defaults(s);
  OOM_CHECK(s.M >= 0 && s.N >= 0 && s.K >= 0, "[gemm] negative dimension");
  OOM_CHECK(s.ab == DType::f32 || s.ab == DType::bf16, "[gemm] operands must be f32 or bf16, got ", dtype_name(s.ab));
  if (s.M == 0 || s.N == 0) return;
  if (s.K == 0) {
    if (!s.accumulate)
      for (int64_t i = 0; i < s.M; ++i)
        for (int64_t j = 0; j < s.N; ++j) c[i * s.ldc + j] = 0.0f;
    return;
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->tiled(s, a, b, c)) return;
  OOM_CHECK(s.ab == DType::bf16, "[gemm] oneDNN has no f32 matmul on this CPU");
  // Widen both operands into packed f32 copies (same transposition, packed leading dims).
  int64_t a_rows = s.ta ? s.K : s.M, a_cols = s.ta ? s.M : s.K;
  int64_t b_rows = s.tb ? s.N : s.K, b_cols = s.tb ? s.K : s.N;
  size_t need = static_cast<size_t>(a_rows * a_cols + b_rows * b_cols) * sizeof(float);
  impl_->widened = impl_->arena.alloc(need, Category::workspace, "gemm bf16 widening");
  float* aw = impl_->widened.as<float>();
  float* bw = aw + a_rows * a_cols;
  const uint16_t* a16 = static_cast<const uint16_t*>(a);
  const uint16_t* b16 = static_cast<const uint16_t*>(b);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < a_rows; ++r)
    for (int64_t k = 0; k < a_cols; ++k) aw[r * a_cols + k] = bf16_to_f32(a16[r * s.lda + k]);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < b_rows; ++r)
    for (int64_t k = 0; k < b_cols; ++k) bw[r * b_cols + k] = bf16_to_f32(b16[r * s.ldb + k]);
  GemmShape f = s;
  f.ab = DType::f32;
  f.lda = a_cols;
  f.ldb = b_cols;
  bool ok = impl_->tiled(f, aw, bw, c);
  impl_->widened.reset();  // weights-sized: not held between calls
  OOM_CHECK(ok, "[gemm] oneDNN has no f32 matmul on this CPU");
}

}  // namespace oomless
