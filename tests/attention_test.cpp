// Causal GQA attention over a block table: every built backend against the float64 reference (forward
// o and lse, backward dq and the accumulated dk, dv) over contiguous and paged layouts, a
// finite-difference check of the reference backward, bitwise determinism across thread counts,
// queries that see no key, and bad input. Also the single-threaded tile GEMM the cpu kernel is built
// on, against RefOps::matmul, over shapes the attention cases do not reach (several k and column
// blocks, K = 0, leading dimensions past the packed ones).
//
// Paged problems put the queries after `off` tokens of history, so the first blocks are pure history
// (a later chunk attending to earlier pages), and the last block is partial. Block slots past a
// block's length hold NaN keys and values: a kernel that reads them poisons its output.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm.h"
#include "backend/ref/ref_ops.h"
#include "util/harness.h"

namespace oomless::test {
namespace {

struct Shape {
  int64_t T, H, Hkv, D;
  int64_t P;     // tokens per block; P = T and off = 0 is the contiguous one-block case
  int64_t off;   // position of the first query; keys cover positions [0, off + T)
  bool shuffle;  // block table in a random order and query positions permuted
};

// One random instance. Block i of the table is block i of the storage.
struct Problem {
  Shape s;
  std::vector<int32_t> starts, lens;  // per table entry
  HostTensor q;                       // (T, H, D) f32
  HostTensor pos;                     // (T) i32
  HostTensor k, v;                    // (n_blocks, Hkv, P, D) f32 or bf16, NaN past each block's length
  HostTensor dout;                    // (T, H, D) f32
  HostTensor dk0, dv0;                // (n_blocks, Hkv, P, D) f32, what dk and dv accumulate onto
  int64_t n_blocks() const { return static_cast<int64_t>(starts.size()); }
};

Problem make_problem(const Shape& s, DType kv_dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t keys = s.off + s.T, nb = (keys + s.P - 1) / s.P;
  Problem p{s,
            {},
            {},
            HostTensor(DType::f32, {s.T, s.H, s.D}),
            HostTensor(DType::i32, {s.T}),
            HostTensor(kv_dtype, {nb, s.Hkv, s.P, s.D}),
            HostTensor(kv_dtype, {nb, s.Hkv, s.P, s.D}),
            HostTensor(DType::f32, {s.T, s.H, s.D}),
            HostTensor(DType::f32, {nb, s.Hkv, s.P, s.D}),
            HostTensor(DType::f32, {nb, s.Hkv, s.P, s.D})};
  std::vector<int64_t> order(static_cast<size_t>(nb));
  std::iota(order.begin(), order.end(), 0);
  if (s.shuffle) std::shuffle(order.begin(), order.end(), rng);
  for (int64_t b : order) {
    p.starts.push_back(static_cast<int32_t>(b * s.P));
    p.lens.push_back(static_cast<int32_t>(std::min(s.P, keys - b * s.P)));
  }
  std::vector<int32_t> positions(static_cast<size_t>(s.T));
  std::iota(positions.begin(), positions.end(), static_cast<int32_t>(s.off));
  if (s.shuffle) std::shuffle(positions.begin(), positions.end(), rng);
  for (int64_t t = 0; t < s.T; ++t) p.pos.set(t, positions[t]);
  p.q.randn(rng, 1.5);
  p.k.randn(rng);
  p.v.randn(rng);
  p.dout.randn(rng);
  // O(1) like the gradients: where a gradient is 0 in exact arithmetic (a query that sees one key gets
  // dS = P (dP - D) = 0), the f32 rounding left in it is measured against what it accumulates onto.
  p.dk0.randn(rng);
  p.dv0.randn(rng);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t g = 0; g < s.Hkv; ++g)
      for (int64_t j = p.lens[b]; j < s.P; ++j)
        for (int64_t d = 0; d < s.D; ++d) {
          p.k.set(((b * s.Hkv + g) * s.P + j) * s.D + d, nan);
          p.v.set(((b * s.Hkv + g) * s.P + j) * s.D + d, nan);
        }
  return p;
}

// The block table over storage k, v (n_blocks, Hkv, P, D).
struct Table {
  std::vector<KvBlock> blocks;
  KvBlocks kv;
};

Table make_table(const Problem& p, const HostTensor& k, const HostTensor& v) {
  Table tb;
  const int64_t per = dtype_bytes(k.dtype(), p.s.Hkv * p.s.P * p.s.D);
  for (int64_t b = 0; b < p.n_blocks(); ++b)
    tb.blocks.push_back(KvBlock{static_cast<char*>(k.t().data) + b * per, static_cast<char*>(v.t().data) + b * per,
                                p.starts[b], p.lens[b]});
  tb.kv = KvBlocks{tb.blocks.data(), p.n_blocks(), p.s.Hkv, p.s.P, p.s.D, k.dtype()};
  return tb;
}

struct Outputs {
  HostTensor o, lse, dq, dk, dv;
};

// Forward then backward on `ops`. Floats are converted to the backend's act dtype; K/V stay in their
// dtype on a backend that takes it (bf16 on cpu) and are widened exactly to f64 for ref. Outputs start
// as garbage so that every element must be written; dk and dv start as dk0 and dv0.
Outputs run(Ops& ops, const Problem& p, double scale, bool bf16_products = false) {
  const DType act = ops.act_dtype();
  const Shape& s = p.s;
  HostTensor q = p.q.as(act), dout = p.dout.as(act);
  HostTensor k = act == DType::f64 ? p.k.as(DType::f64) : p.k.clone();
  HostTensor v = act == DType::f64 ? p.v.as(DType::f64) : p.v.clone();
  Outputs out{HostTensor(act, {s.T, s.H, s.D}), HostTensor(act, {s.H, s.T}), HostTensor(act, {s.T, s.H, s.D}),
              p.dk0.as(act), p.dv0.as(act)};
  out.o.fill(777.0);
  out.lse.fill(12345.0);
  out.dq.fill(-3.0);
  Table kv = make_table(p, k, v), dkv = make_table(p, out.dk, out.dv);
  kv.kv.bf16_products = bf16_products;
  ops.attention_forward(out.o, out.lse, q, kv.kv, p.pos, scale);
  ops.attention_backward(out.dq, dkv.kv, dout, q, kv.kv, out.o, out.lse, p.pos, scale);
  EXPECT_TRUE(q.guards_intact() && dout.guards_intact() && k.guards_intact() && v.guards_intact()) << ops.name();
  return out;
}

// got - base, in f64.
HostTensor minus(const HostTensor& got, const HostTensor& base) {
  HostTensor d(DType::f64, {got.numel()});
  for (int64_t i = 0; i < got.numel(); ++i) d.set(i, got.get(i) - base.get(i));
  return d;
}

// dk, dv slots past each block's length are never touched.
void expect_unused_slots_kept(const Problem& p, const Outputs& got, const std::string& what) {
  const Shape& s = p.s;
  int64_t changed = 0;
  for (int64_t b = 0; b < p.n_blocks(); ++b)
    for (int64_t g = 0; g < s.Hkv; ++g)
      for (int64_t j = p.lens[b]; j < s.P; ++j)
        for (int64_t d = 0; d < s.D; ++d) {
          const int64_t i = ((b * s.Hkv + g) * s.P + j) * s.D + d;
          changed += got.dk.get(i) != p.dk0.get(i) || got.dv.get(i) != p.dv0.get(i);
        }
  EXPECT_EQ(changed, 0) << what << ": dk/dv slots past a block's length were written";
}

void expect_matches(const Outputs& got, const Outputs& ref, const Problem& p, double tol, const std::string& what) {
  expect_close(got.o, ref.o, tol, what + " o");
  expect_close(got.lse, ref.lse, tol, what + " lse");
  expect_close(got.dq, ref.dq, tol, what + " dq");
  expect_close(got.dk, ref.dk, tol, what + " dk (+= onto dk0)");
  expect_close(got.dv, ref.dv, tol, what + " dv (+= onto dv0)");
  expect_close(minus(got.dk, p.dk0), minus(ref.dk, p.dk0), tol, what + " dk - dk0");
  expect_close(minus(got.dv, p.dv0), minus(ref.dv, p.dv0), tol, what + " dv - dv0");
  expect_unused_slots_kept(p, got, what);
}

double scale_for(int64_t D) { return 1.0 / std::sqrt(static_cast<double>(D)); }

enum class Layout { contiguous, paged16, paged64, shuffled16 };

struct Case {
  int64_t T, D, H, Hkv;
  Layout layout;
  DType kv;
  std::string backend;
};

Shape shape_of(const Case& c) {
  switch (c.layout) {
    case Layout::contiguous: return {c.T, c.H, c.Hkv, c.D, c.T, 0, false};
    case Layout::paged16: return {c.T, c.H, c.Hkv, c.D, 16, 32, false};
    case Layout::paged64: return {c.T, c.H, c.Hkv, c.D, 64, 128, false};
    case Layout::shuffled16: return {c.T, c.H, c.Hkv, c.D, 16, 48, true};
  }
  return {};
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::contiguous: return "contiguous";
    case Layout::paged16: return "paged16";
    case Layout::paged64: return "paged64";
    case Layout::shuffled16: return "shuffled16";
  }
  return "?";
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return c.backend + "_T" + std::to_string(c.T) + "_D" + std::to_string(c.D) + "_H" + std::to_string(c.H) + "_Hkv" +
         std::to_string(c.Hkv) + "_" + layout_name(c.layout) + "_" + dtype_name(c.kv);
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.backend << " T=" << c.T << " D=" << c.D << " H=" << c.H << " Hkv=" << c.Hkv << " "
      << layout_name(c.layout) << " kv " << dtype_name(c.kv);
}

class AttentionMatrix : public testing::TestWithParam<Case> {};

// bf16 K/V are compared against ref on the same bf16 values, so the tolerance stays f32's.
TEST_P(AttentionMatrix, MatchesReference) {
  const Case& c = GetParam();
  const Problem p = make_problem(shape_of(c), c.kv, 1000 * c.T + 100 * c.D + 10 * c.H + c.Hkv);
  auto ops = make_ops(c.backend);
  RefOps ref;
  const double scale = scale_for(c.D);
  const Outputs got = run(*ops, p, scale), want = run(ref, p, scale);
  expect_matches(got, want, p, tol_for(DType::f32), c.backend);
}

std::vector<Case> all_cases() {
  const std::pair<int64_t, int64_t> heads[] = {{4, 4}, {4, 2}, {6, 2}, {8, 1}};
  std::vector<Case> cs;
  for (const std::string& be : backends_under_test()) {
    for (int64_t T : {1, 7, 33, 128, 257})
      for (int64_t D : {16, 64})
        for (auto [H, Hkv] : heads)
          for (Layout l : {Layout::contiguous, Layout::paged16, Layout::paged64}) {
            if (T == 257 && D == 64 && Hkv != 1) continue;  // the ref side dominates; one GQA row is enough
            cs.push_back({T, D, H, Hkv, l, DType::f32, be});
          }
    cs.push_back({128, 128, 4, 2, Layout::paged64, DType::f32, be});
    cs.push_back({257, 128, 4, 1, Layout::contiguous, DType::f32, be});
    for (int64_t T : {7, 100}) cs.push_back({T, 16, 6, 2, Layout::shuffled16, DType::f32, be});
    for (Layout l : {Layout::contiguous, Layout::paged64}) cs.push_back({33, 64, 4, 2, l, DType::bf16, be});
  }
  return cs;
}

INSTANTIATE_TEST_SUITE_P(Matrix, AttentionMatrix, testing::ValuesIn(all_cases()), case_name);

// Central differences in float64 of L = sum(o * W) against the reference backward, over every entry of
// q, k and v (GQA, two blocks, the second partial, queries after one token of history).
TEST(AttentionRef, BackwardMatchesFiniteDifferences) {
  const Shape s{6, 4, 2, 5, 4, 1, false};
  Problem p = make_problem(s, DType::f32, 11);
  HostTensor q = p.q.as(DType::f64), k = p.k.as(DType::f64), v = p.v.as(DType::f64);
  HostTensor w = p.dout.as(DType::f64);
  HostTensor o(DType::f64, {s.T, s.H, s.D}), lse(DType::f64, {s.H, s.T});
  const Table kv = make_table(p, k, v);
  ASSERT_EQ(kv.kv.n_blocks, 2);
  const double scale = 0.7;
  RefOps ref;
  auto loss = [&] {
    ref.attention_forward(o, lse, q, kv.kv, p.pos, scale);
    double l = 0;
    for (int64_t i = 0; i < o.numel(); ++i) l += o.get(i) * w.get(i);
    return l;
  };
  loss();
  HostTensor dq(DType::f64, {s.T, s.H, s.D}), dk(DType::f64, {2, s.Hkv, s.P, s.D}), dv(DType::f64, {2, s.Hkv, s.P, s.D});
  dk.fill(0.0);
  dv.fill(0.0);
  const Table dkv = make_table(p, dk, dv);
  ref.attention_backward(dq, dkv.kv, w, q, kv.kv, o, lse, p.pos, scale);
  for (auto [x, g, name] : {std::tuple{&q, &dq, "dq"}, std::tuple{&k, &dk, "dk"}, std::tuple{&v, &dv, "dv"}}) {
    HostTensor numeric(DType::f64, {x->numel()}), analytic(DType::f64, {x->numel()});
    for (int64_t i = 0; i < x->numel(); ++i) {
      const double x0 = x->get(i);
      if (std::isnan(x0)) {  // an unused slot: no gradient
        EXPECT_EQ(g->get(i), 0.0) << name << "[" << i << "] of an unused slot";
        numeric.set(i, 0.0);
        analytic.set(i, 0.0);
        continue;
      }
      const double step = 1e-5 * std::max(1.0, std::fabs(x0));
      x->set(i, x0 + step);
      const double up = loss();
      x->set(i, x0 - step);
      const double down = loss();
      x->set(i, x0);
      numeric.set(i, (up - down) / (2 * step));
      analytic.set(i, g->get(i));
    }
    const double err = rel_l2(analytic, numeric);
    EXPECT_LE(err, 1e-8) << name << ": backward vs central differences, relative L2 " << err;
  }
}

// Same results, bit for bit, for 1, 2 and 3 threads (a fresh backend each time).
TEST(Attention, BitwiseIdenticalAcrossThreadCounts) {
  const int max_threads = omp_get_max_threads();
  for (const std::string& be : backends_under_test())
    for (const Shape& s : {Shape{257, 8, 2, 64, 64, 64, false}, Shape{300, 4, 1, 32, 300, 0, false}}) {
      const Problem p = make_problem(s, DType::f32, 99);
      std::vector<Outputs> outs;
      for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        auto ops = make_ops(be);
        outs.push_back(run(*ops, p, scale_for(s.D)));
      }
      omp_set_num_threads(max_threads);
      for (size_t n = 1; n < outs.size(); ++n) {
        const std::string what = be + " T=" + std::to_string(s.T) + ", threads 1 vs " + std::to_string(n + 1);
        for (auto [m, name] : {std::pair{&Outputs::o, "o"}, std::pair{&Outputs::lse, "lse"},
                               std::pair{&Outputs::dq, "dq"}, std::pair{&Outputs::dk, "dk"},
                               std::pair{&Outputs::dv, "dv"}})
          EXPECT_EQ(std::memcmp((outs[0].*m).t().data, (outs[n].*m).t().data, (outs[0].*m).t().nbytes()), 0)
              << what << ": " << name << " differs";
      }
    }
}

// bf16 products (KvBlocks::bf16_products, bf16 compute): on every GEMM path the result is within bf16
// rounding of the reference (which takes the operands as they are); the avx2 and avx512 paths give the same
// bits (f32 tile kernels over the rounded values), amx runs the products on tiles; without the flag (f32
// products) every path gives the same bits; the flag changes the result; 1, 2 and 3 threads give the same bits.
// f32 and bf16 K/V, GQA, paged, shuffled and contiguous.
TEST(Attention, Bf16ProductsOnEveryPath) {
  const GemmIsa saved = gemm_isa();
  const int max_threads = omp_get_max_threads();
  RefOps ref;
  for (const auto& [s, kvt] : {std::pair{Shape{257, 8, 2, 64, 64, 64, false}, DType::f32},
                               std::pair{Shape{200, 4, 2, 128, 200, 0, false}, DType::bf16},
                               std::pair{Shape{100, 6, 2, 16, 16, 48, true}, DType::f32}}) {
    const Problem p = make_problem(s, kvt, 7);
    const std::string what = std::string(dtype_name(kvt)) + " T=" + std::to_string(s.T) + " D=" + std::to_string(s.D);
    const Outputs want = run(ref, p, scale_for(s.D));
    std::vector<std::pair<GemmIsa, Outputs>> outs, plains;
    for (GemmIsa isa : supported_gemm_isas()) {
      if (isa == GemmIsa::generic) continue;
      set_gemm_isa(isa);
      auto ops = make_ops("cpu");
      outs.emplace_back(isa, run(*ops, p, scale_for(s.D), true));
      expect_matches(outs.back().second, want, p, 2e-2, what + " " + gemm_isa_name(isa));
      plains.emplace_back(isa, run(*ops, p, scale_for(s.D), false));
      EXPECT_NE(std::memcmp(plains.back().second.o.t().data, outs.back().second.o.t().data,
                            plains.back().second.o.t().nbytes()),
                0)
          << what << " " << gemm_isa_name(isa) << ": bf16 products changed nothing";
    }
    // bf16 products off amx, and f32 products on every path (the softmax rows eight lanes a vector on avx2,
    // sixteen on avx512 and amx): the same bits.
    for (size_t i = 1; i < outs.size(); ++i)
      for (auto m : {&Outputs::o, &Outputs::lse, &Outputs::dq, &Outputs::dk, &Outputs::dv}) {
        if (outs[i].first != GemmIsa::amx) {
          EXPECT_EQ(std::memcmp((outs[0].second.*m).t().data, (outs[i].second.*m).t().data,
                                (outs[0].second.*m).t().nbytes()), 0)
              << what << ": " << gemm_isa_name(outs[i].first) << " differs from " << gemm_isa_name(outs[0].first);
        }
        EXPECT_EQ(std::memcmp((plains[0].second.*m).t().data, (plains[i].second.*m).t().data,
                              (plains[0].second.*m).t().nbytes()), 0)
            << what << ", f32 products: " << gemm_isa_name(plains[i].first) << " differs from "
            << gemm_isa_name(plains[0].first);
      }
    set_gemm_isa(saved);
    std::vector<Outputs> threads;
    for (int n : {1, 2, 3}) {
      omp_set_num_threads(n);
      auto ops = make_ops("cpu");
      threads.push_back(run(*ops, p, scale_for(s.D), true));
    }
    omp_set_num_threads(max_threads);
    for (size_t n = 1; n < threads.size(); ++n)
      for (auto m : {&Outputs::o, &Outputs::lse, &Outputs::dq, &Outputs::dk, &Outputs::dv})
        EXPECT_EQ(std::memcmp((threads[0].*m).t().data, (threads[n].*m).t().data, (threads[0].*m).t().nbytes()), 0)
            << what << " on " << gemm_isa_name(saved) << ": threads 1 vs " << n + 1;
  }
}

// Scores that rise from one key tile to the next by more than the online softmax lets a row's running max
// lag (on amx, bf16 products keep a row's max until a lane of its sum over a tile passes 2^12, then take the
// row again with the tile's max): every
// path within bf16 rounding of the reference, forward and backward; the rows also start at several
// positions (a history of 100 keys) and some see no key of a tile.
TEST(Attention, Bf16ProductsFollowARisingMax) {
  const GemmIsa saved = gemm_isa();
  RefOps ref;
  for (const Shape& s : {Shape{300, 4, 2, 64, 400, 100, false}, Shape{200, 2, 1, 128, 64, 100, true}}) {
    Problem p = make_problem(s, DType::f32, 5);
    // q all along one direction, keys along it by their position: score_j = a j + noise, a tile's max
    // 0.15 x 128 log2 units past the one before it.
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t h = 0; h < s.H; ++h)
        for (int64_t d = 0; d < s.D; ++d) p.q.set((t * s.H + h) * s.D + d, d % 2 ? 4.0 : -4.0);
    for (int64_t b = 0; b < p.n_blocks(); ++b)
      for (int64_t g = 0; g < s.Hkv; ++g)
        for (int64_t j = 0; j < p.lens[b]; ++j)
          for (int64_t d = 0; d < s.D; ++d) {
            const int64_t i = ((b * s.Hkv + g) * s.P + j) * s.D + d;
            const double along = (d % 2 ? 1.0 : -1.0) * 0.15 * (p.starts[b] + j) * std::sqrt(double(s.D)) /
                                 (4.0 * s.D * 1.4426950408889634);
            p.k.set(i, along + 0.3 * p.k.get(i));
          }
    const std::string what = "T=" + std::to_string(s.T) + " D=" + std::to_string(s.D);
    const Outputs want = run(ref, p, scale_for(s.D));
    for (GemmIsa isa : supported_gemm_isas()) {
      set_gemm_isa(isa);
      auto ops = make_ops("cpu");
      expect_matches(run(*ops, p, scale_for(s.D), true), want, p, 2e-2, what + " " + gemm_isa_name(isa));
    }
    set_gemm_isa(saved);
  }
}

// One position under GQA (a decode step) runs one task a kv head with the group's query heads as its rows
// (bf16 products), or its f32 products split over every thread with keys and values read in place (the
// direct decode kernels where D is a multiple of 8): each head's o and lse are the bits of the same row in a
// call of several positions (one task a head), on every GEMM path, for f32 and bf16 K/V, with and without
// bf16 products, over paged history. The shapes reach every piece of the direct kernels: key tiles of 16s,
// an 8 and a tail (blocks of 29 and 15 keys), groups of 3, 5 (4 + 1 and 3 + 2 rows) and 4, D = 32, 40
// (32 + 8 columns), 104 (64 + 32 + 8: the sixteen-lane P V on AVX-512) and 12 (not a multiple of 8:
// Gemm::tile); with the direct kernels switched off too.
TEST(Attention, OnePositionUnderGqaIsItsRowOfAWiderCall) {
  const GemmIsa saved = gemm_isa();
  const bool saved_direct = decode_direct_kernels();
  for (const Shape& s : {Shape{3, 6, 2, 32, 16, 45, false}, Shape{3, 10, 2, 40, 29, 70, false},
                         Shape{2, 8, 2, 12, 7, 9, true}, Shape{2, 6, 2, 104, 16, 20, false}})
    for (GemmIsa isa : supported_gemm_isas())
      for (DType kvt : {DType::f32, DType::bf16})
        for (bool bf : {false, true})
          for (bool direct : {true, false}) {
            set_gemm_isa(isa);
            set_decode_direct_kernels(direct);
            auto ops = make_ops("cpu");
            const std::string what = std::string(dtype_name(kvt)) + (bf ? ", bf16 products" : "") + ", " +
                                     gemm_isa_name(isa) + ", D=" + std::to_string(s.D) + ", group " +
                                     std::to_string(s.H / s.Hkv) + (direct ? "" : ", direct kernels off");
            const Problem p = make_problem(s, kvt, 11);
            int64_t last = 0;  // the row at the highest position: it sees every key
            for (int64_t t = 1; t < s.T; ++t)
              if (p.pos.get(t) > p.pos.get(last)) last = t;
            Problem one = p;  // that row alone: the same keys
            one.s.T = 1;
            const int64_t row = s.H * s.D;
            one.q = HostTensor(DType::f32, {1, s.H, s.D});
            one.dout = HostTensor(DType::f32, {1, s.H, s.D});
            for (int64_t i = 0; i < row; ++i) {
              one.q.set(i, p.q.get(last * row + i));
              one.dout.set(i, p.dout.get(last * row + i));
            }
            one.pos = HostTensor(DType::i32, {1});
            one.pos.set(0, p.pos.get(last));
            const Outputs wide = run(*ops, p, scale_for(s.D), bf), narrow = run(*ops, one, scale_for(s.D), bf);
            EXPECT_EQ(std::memcmp(static_cast<const float*>(wide.o.t().data) + last * row, narrow.o.t().data, 4 * row), 0)
                << what << ": o";
            for (int64_t h = 0; h < s.H; ++h)
              EXPECT_EQ(wide.lse.get(h * s.T + last), narrow.lse.get(h)) << what << ": lse of head " << h;
          }
  set_decode_direct_kernels(saved_direct);
  set_gemm_isa(saved);
}

// Queries before every key (keys start at position 10, queries at 4..) and an empty block table:
// o = 0, lse = -inf and dq = 0 for them, and no gradient reaches K/V from them.
TEST(Attention, QueryThatSeesNoKey) {
  std::vector<std::string> bes = backends_under_test();
  bes.push_back("ref");
  for (const std::string& be : bes) {
    for (bool empty_table : {false, true}) {
      const Shape s{12, 4, 2, 16, 8, 4, false};
      Problem p = make_problem(s, DType::f32, 3);
      // Shift every block 10 positions later: keys start at 10, so the queries at 4..9 see nothing.
      for (auto& st : p.starts) st += 10;
      if (empty_table) {
        p.starts.clear();
        p.lens.clear();
      }
      auto ops = make_ops(be);
      RefOps ref;
      const Outputs got = run(*ops, p, 0.25), want = run(ref, p, 0.25);
      const std::string what = be + (empty_table ? " (no blocks)" : "");
      int64_t blind = 0;
      for (int64_t t = 0; t < s.T; ++t) {
        const int32_t pos = static_cast<int32_t>(p.pos.get(t));
        if (!empty_table && pos >= 10) continue;
        ++blind;
        for (int64_t h = 0; h < s.H; ++h) {
          EXPECT_EQ(got.lse.get(h * s.T + t), -std::numeric_limits<double>::infinity()) << what << " t=" << t;
          for (int64_t d = 0; d < s.D; ++d) {
            EXPECT_EQ(got.o.get((t * s.H + h) * s.D + d), 0.0) << what << " o t=" << t;
            EXPECT_EQ(got.dq.get((t * s.H + h) * s.D + d), 0.0) << what << " dq t=" << t;
          }
        }
      }
      EXPECT_EQ(blind, empty_table ? s.T : 6) << what;
      if (be == "ref") continue;
      // Everything else as ref (lse compared only where finite).
      expect_close(got.o, want.o, tol_for(DType::f32), what + " o");
      expect_close(got.dq, want.dq, tol_for(DType::f32), what + " dq");
      expect_close(got.dk, want.dk, tol_for(DType::f32), what + " dk");
      expect_close(got.dv, want.dv, tol_for(DType::f32), what + " dv");
      for (int64_t i = 0; i < got.lse.numel(); ++i)
        if (std::isfinite(want.lse.get(i))) {
          EXPECT_NEAR(got.lse.get(i), want.lse.get(i), 1e-5) << what << " lse " << i;
        }
    }
  }
}

// Streaming: the block table split into windows, attention_forward per window combined with
// attention_merge, then attention_backward per window with the merged o and lse (dq summed over
// windows, dk/dv accumulating in place) equals one call over the whole table — on every backend, against
// ref's single call. Windows in the order a chunk-recurrent step uses: its own (causal) blocks first, then
// history windows of two blocks.
TEST(Attention, WindowedWithMergeEqualsOneCall) {
  std::vector<std::string> bes = backends_under_test();
  bes.push_back("ref");
  const Shape s{24, 4, 2, 16, 8, 40, false};  // 40 tokens of history = 5 blocks, then 3 own blocks
  const Problem p = make_problem(s, DType::f32, 17);
  RefOps ref;
  const double scale = 0.25;
  const Outputs want = run(ref, p, scale);
  for (const std::string& be : bes) {
    auto ops = make_ops(be);
    const DType act = ops->act_dtype();
    HostTensor q = p.q.as(act), dout = p.dout.as(act), k = p.k.as(act), v = p.v.as(act);
    Outputs got{HostTensor(act, {s.T, s.H, s.D}), HostTensor(act, {s.H, s.T}), HostTensor(act, {s.T, s.H, s.D}),
                p.dk0.as(act), p.dv0.as(act)};
    Table all = make_table(p, k, v), dall = make_table(p, got.dk, got.dv);
    const int64_t nb = p.n_blocks();
    std::vector<std::pair<int64_t, int64_t>> windows = {{5, nb}};  // own blocks, then history by twos
    for (int64_t b = 0; b < 5; b += 2) windows.push_back({b, std::min<int64_t>(b + 2, 5)});
    auto sub = [&](const Table& t, std::pair<int64_t, int64_t> w) {
      KvBlocks r = t.kv;
      r.blocks = t.blocks.data() + w.first;
      r.n_blocks = w.second - w.first;
      return r;
    };
    HostTensor o2(act, {s.T, s.H, s.D}), lse2(act, {s.H, s.T}), dq2(act, {s.T, s.H, s.D});
    for (size_t i = 0; i < windows.size(); ++i) {
      const KvBlocks kv = sub(all, windows[i]);
      if (i == 0) {
        ops->attention_forward(got.o, got.lse, q, kv, p.pos, scale);
      } else {
        ops->attention_forward(o2, lse2, q, kv, p.pos, scale);
        ops->attention_merge(got.o, got.lse, o2, lse2, 0);
      }
    }
    for (size_t i = 0; i < windows.size(); ++i) {
      ops->attention_backward(i == 0 ? got.dq.t() : dq2.t(), sub(dall, windows[i]), dout, q, sub(all, windows[i]),
                              got.o, got.lse, p.pos, scale);
      if (i > 0) ops->add(got.dq, got.dq, dq2);
    }
    expect_matches(got, want, p, tol_for(DType::f32), be + " windowed");
  }
}

// attention_merge where a part saw no key (lse -inf): it weighs nothing; both -inf stays o = 0, -inf.
TEST(Attention, MergeWithEmptyParts) {
  std::vector<std::string> bes = backends_under_test();
  bes.push_back("ref");
  const double ninf = -std::numeric_limits<double>::infinity();
  for (const std::string& be : bes) {
    auto ops = make_ops(be);
    const DType act = ops->act_dtype();
    // Rows (t, h) for T = 3, H = 1, D = 2: row 0 both finite, row 1 second empty, row 2 first empty; row 3 both.
    HostTensor o(act, {4, 1, 2}), lse(act, {1, 4}), o2(act, {4, 1, 2}), lse2(act, {1, 4});
    const double ov[] = {1, 2, 3, 4, 5, 6, 0, 0}, o2v[] = {7, 8, 9, 10, 11, 12, 0, 0};
    const double lv[] = {0.5, 1.0, ninf, ninf}, l2v[] = {std::log(3.0) + 0.5, ninf, 2.0, ninf};
    for (int i = 0; i < 8; ++i) o.set(i, ov[i]), o2.set(i, o2v[i]);
    for (int i = 0; i < 4; ++i) lse.set(i, lv[i]), lse2.set(i, l2v[i]);
    ops->attention_merge(o, lse, o2, lse2, 0);
    const double tol = act == DType::f64 ? 1e-15 : 1e-6;
    EXPECT_NEAR(o.get(0), 0.25 * 1 + 0.75 * 7, tol) << be;  // weights 1 : 3
    EXPECT_NEAR(o.get(1), 0.25 * 2 + 0.75 * 8, tol) << be;
    EXPECT_NEAR(lse.get(0), 0.5 + std::log(4.0), tol) << be;
    EXPECT_EQ(o.get(2), 3.0) << be;
    EXPECT_EQ(lse.get(1), 1.0) << be;
    EXPECT_EQ(o.get(4), 11.0) << be;
    EXPECT_EQ(lse.get(2), 2.0) << be;
    EXPECT_EQ(o.get(6), 0.0) << be;
    EXPECT_EQ(lse.get(3), ninf) << be;
  }
}

// attention_merge of a partial attention of some rows (row0, n) equals merging a full-height one whose
// other rows saw no key (lse -inf): those rows keep their bits; a range past the end is refused.
TEST(Attention, MergeIntoARowRange) {
  std::vector<std::string> bes = backends_under_test();
  bes.push_back("ref");
  const double ninf = -std::numeric_limits<double>::infinity();
  std::mt19937_64 rng(3);
  std::normal_distribution<double> nd;
  const int64_t T = 7, H = 3, D = 5, row0 = 2, n = 4;
  for (const std::string& be : bes) {
    auto ops = make_ops(be);
    const DType act = ops->act_dtype();
    HostTensor o(act, {T, H, D}), lse(act, {H, T}), o2(act, {n, H, D}), lse2(act, {H, n});
    HostTensor wo(act, {T, H, D}), wl(act, {H, T}), fo(act, {T, H, D}), fl(act, {H, T});
    for (int64_t i = 0; i < T * H * D; ++i) o.set(i, nd(rng)), wo.set(i, o.get(i)), fo.set(i, 0.0);
    for (int64_t i = 0; i < H * T; ++i) lse.set(i, nd(rng)), wl.set(i, lse.get(i)), fl.set(i, ninf);
    for (int64_t i = 0; i < n * H * D; ++i) o2.set(i, nd(rng)), fo.set(row0 * H * D + i, o2.get(i));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; ++i) lse2.set(h * n + i, nd(rng)), fl.set(h * T + row0 + i, lse2.get(h * n + i));
    ops->attention_merge(o, lse, o2, lse2, row0);
    ops->attention_merge(wo, wl, fo, fl, 0);
    for (int64_t i = 0; i < T * H * D; ++i) ASSERT_EQ(o.get(i), wo.get(i)) << be << " o " << i;
    for (int64_t i = 0; i < H * T; ++i) ASSERT_EQ(lse.get(i), wl.get(i)) << be << " lse " << i;
    EXPECT_THROW(ops->attention_merge(o, lse, o2, lse2, T - n + 1), Error) << be;
  }
}

// Gemm::tile against RefOps::matmul: every transpose pair, accumulate or not, odd sizes, K past one
// k block (256) and N past one column block (64), one strip of rows (B read in place where a panel is
// full) and many, and leading dimensions with a gap (the gap is NaN: reading it poisons c; c's gap must
// survive).
TEST(GemmTile, MatchesReference) {
  std::mt19937_64 rng(17);
  RefOps ref;
  const int64_t sizes[][3] = {{1, 1, 1}, {7, 33, 5}, {6, 16, 64}, {13, 70, 300}, {96, 128, 64}, {5, 9, 0}, {40, 17, 513},
                              {3, 70, 300}};
  for (auto [M, N, K] : sizes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (int acc = 0; acc < 2; ++acc) {
          const std::string what = "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
                                   " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " acc=" + std::to_string(acc);
          const int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
          const int64_t lda = ac + 3, ldb = bc + 1, ldc = N + 2;
          HostTensor a(DType::f32, {ar, ac}), b(DType::f32, {br, bc}), c0(DType::f32, {M, N});
          a.randn(rng);
          b.randn(rng);
          c0.randn(rng);
          // The same values in strided storage, NaN in the gaps; c's gap holds a marker.
          const double nan = std::numeric_limits<double>::quiet_NaN();
          HostTensor as(DType::f32, {std::max<int64_t>(ar * lda, 1)}), bs(DType::f32, {std::max<int64_t>(br * ldb, 1)});
          HostTensor cs(DType::f32, {M * ldc});
          as.fill(nan);
          bs.fill(nan);
          cs.fill(-5.0);
          for (int64_t i = 0; i < ar * ac; ++i) as.set(i / ac * lda + i % ac, a.get(i));
          for (int64_t i = 0; i < br * bc; ++i) bs.set(i / bc * ldb + i % bc, b.get(i));
          for (int64_t i = 0; i < M * N; ++i) cs.set(i / N * ldc + i % N, c0.get(i));
          const GemmShape s{.M = M, .N = N, .K = K, .ta = ta != 0, .tb = tb != 0, .lda = lda, .ldb = ldb, .ldc = ldc,
                            .accumulate = acc != 0};
          Gemm::tile(s, as.ptr<float>(), bs.ptr<float>(), cs.ptr<float>());
          HostTensor want = c0.as(DType::f64), got(DType::f32, {M, N}), bound(DType::f64, {M, N});
          ref.matmul(want, a.as(DType::f64), b.as(DType::f64), ta, tb, acc);
          ref.matmul_magnitude(bound, a.as(DType::f64), b.as(DType::f64), ta, tb);
          if (acc)  // the old value of c is part of the bound
            for (int64_t i = 0; i < M * N; ++i) bound.set(i, bound.get(i) + std::fabs(c0.get(i)));
          int64_t gap_changed = 0;
          for (int64_t i = 0; i < M * ldc; ++i) {
            if (i % ldc < N) got.set(i / ldc * N + i % ldc, cs.get(i));
            else gap_changed += cs.get(i) != -5.0;
          }
          EXPECT_EQ(gap_changed, 0) << what << ": wrote between rows of c";
          EXPECT_TRUE(as.guards_intact() && bs.guards_intact() && cs.guards_intact()) << what;
          EXPECT_TRUE(all_finite(got)) << what;
          expect_within_bound(got, want, bound, eps_of(DType::f32), K, 2.0, what);
        }
}

// Calls `f` and expects an oomless::Error whose message starts with "[attention]".
void expect_attention_error(const std::function<void()>& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[attention]", 0), 0u) << what << ": " << e.what();
  }
}

TEST(Attention, BadInputThrows) {
  std::vector<std::string> bes = backends_under_test();
  bes.push_back("ref");
  for (const std::string& be : bes) {
    auto ops = make_ops(be);
    const DType act = ops->act_dtype(), other = act == DType::f64 ? DType::f32 : DType::f64;
    const Shape s{9, 4, 2, 8, 4, 3, false};
    const Problem p = make_problem(s, DType::f32, 5);
    HostTensor q = p.q.as(act), dout = p.dout.as(act), k = p.k.as(act), v = p.v.as(act);
    HostTensor o(act, {s.T, s.H, s.D}), lse(act, {s.H, s.T}), dq(act, {s.T, s.H, s.D});
    HostTensor dk = p.dk0.as(act), dv = p.dv0.as(act);
    const Table kv = make_table(p, k, v), dkv = make_table(p, dk, dv);
    const double sc = 0.3;
    auto fwd = [&](Tensor to, Tensor tl, Tensor tq, const KvBlocks& b, Tensor tp) {
      return [&ops, to, tl, tq, &b, tp, sc] { ops->attention_forward(to, tl, tq, b, tp, sc); };
    };
    // Sanity: the good call works.
    ops->attention_forward(o, lse, q, kv.kv, p.pos, sc);
    ops->attention_backward(dq, dkv.kv, dout, q, kv.kv, o, lse, p.pos, sc);

    HostTensor q_other = p.q.as(other), lse_t(act, {s.T, s.H}), o_short(act, {s.T - 1, s.H, s.D});
    HostTensor pos_f(act, {s.T}), pos_short(DType::i32, {s.T - 1});
    const std::string w = be + ": ";
    expect_attention_error(fwd(o, lse, q_other, kv.kv, p.pos), w + "q of the wrong dtype");
    expect_attention_error(fwd(o, lse_t, q, kv.kv, p.pos), w + "lse (T, H) instead of (H, T)");
    expect_attention_error(fwd(o_short, lse, q, kv.kv, p.pos), w + "o with fewer rows");
    expect_attention_error(fwd(o, lse, q, kv.kv, pos_f), w + "float positions");
    expect_attention_error(fwd(o, lse, q, kv.kv, pos_short), w + "positions of the wrong length");
    expect_attention_error(fwd(o, lse, q.t().reshape({s.T, s.H * s.D}), kv.kv, p.pos), w + "2-d q");

    KvBlocks bad = kv.kv;
    bad.Hkv = 3;
    expect_attention_error(fwd(o, lse, q, bad, p.pos), w + "H not a multiple of Hkv");
    bad = kv.kv;
    bad.D = s.D + 1;
    expect_attention_error(fwd(o, lse, q, bad, p.pos), w + "head dims differ");
    bad = kv.kv;
    bad.dtype = DType::i32;
    expect_attention_error(fwd(o, lse, q, bad, p.pos), w + "i32 kv blocks");
    std::vector<KvBlock> long_blocks = kv.blocks;
    long_blocks[0].len = static_cast<int32_t>(s.P + 1);
    bad = kv.kv;
    bad.blocks = long_blocks.data();
    expect_attention_error(fwd(o, lse, q, bad, p.pos), w + "block longer than P");

    auto bwd = [&](Tensor tdq, const KvBlocks& g, Tensor tdo) {
      return [&ops, tdq, &g, tdo, &q, &kv, &o, &lse, &p, sc] {
        ops->attention_backward(tdq, g, tdo, q, kv.kv, o, lse, p.pos, sc);
      };
    };
    HostTensor dq_other(other, {s.T, s.H, s.D}), dout_short(act, {s.T, s.H, s.D - 1});
    expect_attention_error(bwd(dq_other, dkv.kv, dout), w + "dq of the wrong dtype");
    expect_attention_error(bwd(dq, dkv.kv, dout_short), w + "dout of the wrong shape");
    KvBlocks g = dkv.kv;
    g.n_blocks = dkv.kv.n_blocks - 1;
    expect_attention_error(bwd(dq, g, dout), w + "dkv table with fewer blocks");
    g = dkv.kv;
    g.dtype = other;
    expect_attention_error(bwd(dq, g, dout), w + "dkv of the wrong dtype");
    std::vector<KvBlock> moved = dkv.blocks;
    moved[1].start += 1;
    g = dkv.kv;
    g.blocks = moved.data();
    expect_attention_error(bwd(dq, g, dout), w + "dkv block at another position");
    EXPECT_TRUE(o.guards_intact() && lse.guards_intact() && dq.guards_intact() && dk.guards_intact()) << be;
  }
}

}  // namespace
}  // namespace oomless::test
