// A block-quantised B operand (Tensor::quant): the CPU GEMM dequantises its rows while packing, so a
// product with the quantised matrix is bitwise the product with its dequantised f32 copy, for both
// orientations (x W^T and dy W), row slices (qrow0, as the per-kv-head projections take), shapes that
// cross the k slices and column panels, f32 and bf16 compute (the dequantised values rounded to bf16
// as any bf16-read weight), and 1 or 2 threads; the ref backend reads the same values.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>

#include "memory/allocator.h"
#include "backend/ops.h"
#include "core/cpu_info.h"
#include "core/q8_act.h"
#include "io/gguf.h"
#include "io/gguf_model.h"
#include "memory/arena.h"
#include "model/quant_base.h"
#include "util/gguf_blocks.h"
#include "util/harness.h"

namespace oomless::test {
namespace {

// A test encoding: int8 codes with one f32 scale per row (data: codes, aux: scales).
void dequant_q8_row(const QuantMatrix& q, int64_t r, int64_t col, int64_t n, float* out) {
  const int8_t* codes = static_cast<const int8_t*>(q.data) + r * q.cols + col;
  const float s = static_cast<const float*>(q.aux)[r];
  for (int64_t i = 0; i < n; ++i) out[i] = s * static_cast<float>(codes[i]);
}

struct Q8 {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  QuantMatrix q;
  Q8(int64_t rows, int64_t cols, uint64_t seed) : codes(static_cast<size_t>(rows * cols)), scales(static_cast<size_t>(rows)) {
    std::mt19937_64 rng(seed);
    for (auto& c : codes) c = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
    for (auto& s : scales) s = 0.001f + 0.01f * static_cast<float>(rng() % 1000) / 1000.0f;
    q.format = "q8-test";
    q.rows = rows, q.cols = cols;
    q.dequant_row = &dequant_q8_row;
    q.data = codes.data();
    q.aux = scales.data();
  }
  std::vector<float> dense() const {
    std::vector<float> d(codes.size());
    for (int64_t r = 0; r < q.rows; ++r) dequant_q8_row(q, r, 0, q.cols, d.data() + r * q.cols);
    return d;
  }
};

std::vector<float> randn(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(QuantGemm, BitwiseTheProductWithTheDequantisedMatrix) {
  auto ops = make_ops("cpu");
  // (T, N, K) with W (N, K): small, odd, and past a k slice (384; 1024 on amx) and a column panel.
  const int64_t shapes[][3] = {{5, 7, 9}, {33, 48, 70}, {13, 130, 400}, {64, 520, 777}, {1, 7, 9}, {1, 1030, 777}, {40, 70, 1300}};
  for (const auto& sh : shapes) {
    const int64_t T = sh[0], N = sh[1], K = sh[2];
    Q8 w(N + 5, K, static_cast<uint64_t>(N));  // 5 extra rows: the view starts at row 3
    const int64_t r0 = 3;
    std::vector<float> dense = w.dense();
    Tensor wq(nullptr, DType::f32, {N, K});
    wq.quant = &w.q, wq.qrow0 = r0;
    Tensor wd(dense.data() + r0 * K, DType::f32, {N, K});
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(std::to_string(T) + "x" + std::to_string(N) + "x" + std::to_string(K) + (bf16 ? " bf16" : " f32"));
      std::vector<float> x = randn(T * K, 1), dy = randn(T * N, 2);
      std::vector<uint16_t> xb(x.size()), dyb(dy.size());
      convert(xb.data(), DType::bf16, x.data(), DType::f32, T * K);
      convert(dyb.data(), DType::bf16, dy.data(), DType::f32, T * N);
      Tensor xt = bf16 ? Tensor(xb.data(), DType::bf16, {T, K}) : Tensor(x.data(), DType::f32, {T, K});
      Tensor dyt = bf16 ? Tensor(dyb.data(), DType::bf16, {T, N}) : Tensor(dy.data(), DType::f32, {T, N});
      Tensor bq = bf16 ? wq.read_as_bf16() : wq, bd = bf16 ? wd.read_as_bf16() : wd;
      for (int threads : {1, 2}) {
        omp_set_num_threads(threads);
        // y = x W^T
        std::vector<float> y1(static_cast<size_t>(T * N)), y2(y1.size());
        ops->matmul(Tensor::of(y1.data(), {T, N}), xt, bq, false, true, false);
        ops->matmul(Tensor::of(y2.data(), {T, N}), xt, bd, false, true, false);
        EXPECT_TRUE(test::same_product(y1.data(), y2.data(), y1.size())) << "x W^T, threads " << threads;
        // dx = dy W
        std::vector<float> d1(static_cast<size_t>(T * K)), d2(d1.size());
        ops->matmul(Tensor::of(d1.data(), {T, K}), dyt, bq, false, false, false);
        ops->matmul(Tensor::of(d2.data(), {T, K}), dyt, bd, false, false, false);
        EXPECT_TRUE(test::same_product(d1.data(), d2.data(), d1.size())) << "dy W, threads " << threads;
      }
    }
  }
  omp_set_num_threads(omp_get_num_procs());
}

// A view of rows of a matrix stored in bf16 (QuantBase's "bf16" format: --base-dtype / --embed-dtype bf16), one row
// times it (x W^T, a decode step's product, which reads the bf16 rows where they are): the product with a copy of
// those rows, in bf16 and in f32 compute.
TEST(QuantGemm, OneRowOverBf16RowsIsTheProductWithTheirCopy) {
  auto ops = make_ops("cpu");
  const int64_t N = 37, K = 605, r0 = 3;
  const std::vector<float> w = randn((N + 5) * K, 9);
  std::vector<uint16_t> stored(w.size());
  convert(stored.data(), DType::bf16, w.data(), DType::f32, (N + 5) * K);
  QuantMatrix q;  // as QuantBase::add_bf16_matrix makes it
  q.format = "bf16";
  q.rows = N + 5, q.cols = K;
  q.dequant_row = [](const QuantMatrix& m, int64_t r, int64_t col, int64_t n, float* out) {
    const uint16_t* row = static_cast<const uint16_t*>(m.data) + r * m.cols + col;
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(row[i]);
  };
  q.data = stored.data();
  Tensor view(nullptr, DType::f32, {N, K});
  view.quant = &q, view.qrow0 = r0;
  std::vector<uint16_t> copy(static_cast<size_t>(N * K));
  convert(copy.data(), DType::bf16, w.data() + r0 * K, DType::f32, N * K);
  std::vector<float> x = randn(K, 10), wc(copy.size());
  convert(wc.data(), DType::f32, copy.data(), DType::bf16, N * K);
  std::vector<uint16_t> xb(static_cast<size_t>(K));
  convert(xb.data(), DType::bf16, x.data(), DType::f32, K);
  for (bool bf16 : {false, true}) {
    const Tensor xt = bf16 ? Tensor(xb.data(), DType::bf16, {1, K}) : Tensor(x.data(), DType::f32, {1, K});
    std::vector<float> y1(static_cast<size_t>(N)), y2(y1.size());
    ops->matmul(Tensor::of(y1.data(), {1, N}), xt, bf16 ? view.read_as_bf16() : view, false, true, false);
    ops->matmul(Tensor::of(y2.data(), {1, N}), xt,
                bf16 ? Tensor(copy.data(), DType::bf16, {N, K}) : Tensor::of(wc.data(), {N, K}), false, true, false);
    EXPECT_TRUE(test::same_product(y1.data(), y2.data(), y1.size())) << (bf16 ? "bf16" : "fp32");
  }
}

TEST(QuantGemm, RefReadsTheSameValues) {
  auto ref = make_ops("ref");
  const int64_t T = 4, N = 6, K = 10;
  Q8 w(N, K, 9);
  const std::vector<float> dense = w.dense();
  std::vector<double> x(static_cast<size_t>(T * K)), y(static_cast<size_t>(T * N));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<double>(i));
  Tensor wq(nullptr, DType::f64, {N, K});
  wq.quant = &w.q;
  ref->matmul(Tensor::of(y.data(), {T, N}), Tensor::of(x.data(), {T, K}), wq, false, true, false);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += x[static_cast<size_t>(t * K + k)] * dense[static_cast<size_t>(n * K + k)];
      EXPECT_NEAR(y[static_cast<size_t>(t * N + n)], s, 1e-12 * (1 + std::abs(s)));
    }
}

TEST(QuantGemm, OnlyMatmulTakesAQuantisedTensor) {
  auto ops = make_ops("cpu");
  Q8 w(4, 8, 1);
  Tensor wq(nullptr, DType::f32, {4, 8});
  wq.quant = &w.q;
  std::vector<float> out(8);
  EXPECT_THROW(ops->scale(wq, 2.0), Error);
  std::vector<float> x(16), y(8);
  Tensor bad = wq;
  bad.qrow0 = 1;  // rows 1..4 of a 4-row matrix
  EXPECT_THROW(ops->matmul(Tensor::of(y.data(), {2, 4}), Tensor::of(x.data(), {2, 8}), bad, false, true, false), Error);
  EXPECT_NE(wq.str().find("q8-test"), std::string::npos);
}

// GGUF Q4_0, Q4_1 and Q8_0 bases: a one-row product (decoding) takes QuantMatrix::dot_rows where the CPU has
// AVX2 + FMA, the dot product made from the blocks in registers; it is bitwise the product with the
// dequantised matrix (the rows the dequantiser gives, then the one-row dot loop), for the un-permuted query
// rows, row views (qrow0) that start and end inside a group of eight outputs, and 1 or 2 threads.
// A one-layer model's q_proj (its heads un-permuted) and down_proj (K = F = 5 blocks) in random GGUF blocks
// of one type, kept in them by a QuantBase (qp's views point at them).
struct GgufProjections {
  static ModelConfig config() {
    ModelConfig cfg;
    cfg.L = 1, cfg.E = 96, cfg.F = 160, cfg.H = 4, cfg.Hkv = 2, cfg.D = 24, cfg.V = 32;
    return cfg;
  }
  static constexpr const char* names[2] = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"};
  ModelConfig cfg = config();
  CpuMemory mem{size_t{1} << 28};
  ParamSet qp{cfg, DType::f32, mem.device, Category::weights, [](const ParamSpec& s) { return !is_projection_weight(s.name); }};
  std::vector<std::vector<uint8_t>> data;
  std::vector<GgufTensor> srcs = std::vector<GgufTensor>(2);
  std::unique_ptr<QuantBase> qb;

  explicit GgufProjections(GgmlType type) {
    std::vector<GgufHfTensor> ts(2);
    for (int i = 0; i < 2; ++i) {
      const Tensor* slot = qp.find(names[i]);
      OOM_CHECK(slot, "no ", names[i]);
      const int64_t rows = slot->dims[0], cols = slot->dims[1];
      data.push_back(random_blocks(type, rows, cols, 7 + static_cast<uint64_t>(i)));
      GgufTensor& src = srcs[static_cast<size_t>(i)];
      src.type = type;
      src.ne = {cols, rows};
      src.data = data.back().data();
      src.nbytes = data.back().size();
      ts[static_cast<size_t>(i)] = {names[i], {rows, cols}, &src, i == 0 ? static_cast<int>(cfg.H) : 0};
    }
    qb = std::make_unique<QuantBase>(*make_ops("cpu"), ts, qp, mem.device, false);
  }
  // The matrix `name` dequantised, (rows, cols) f32.
  std::vector<float> dense(const Tensor& w) const {
    const int64_t N = w.dims[0], K = w.dims[1];
    std::vector<float> d(static_cast<size_t>(N * K));
    for (int64_t r = 0; r < N; ++r) w.quant->dequant_row(*w.quant, r, 0, K, d.data() + r * K);
    return d;
  }
};

TEST(QuantGemm, GgufOneRowFromTheBlocksIsBitwiseTheDequantisedProduct) {
  DeviceAccess inside;  // the blocks' row readers called directly, as the GEMM calls them
  const CpuInfo cpu = detect_cpu();
  const char* isa = std::getenv("OOMLESS_ISA");
  const bool fused = cpu.avx2 && cpu.fma && cpu.f16c && !(isa && std::string(isa) == "generic");
  auto ops = make_ops("cpu");
  for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0}) {
    SCOPED_TRACE(ggml_type_name(type));
    GgufProjections p(type);
    ParamSet& qp = p.qp;
    const auto& names = GgufProjections::names;
    for (const char* name : names) {
      const Tensor w = *qp.find(name);
      ASSERT_NE(w.quant, nullptr);
      EXPECT_EQ(w.quant->dot_rows != nullptr, fused) << name;
      const int64_t N = w.dims[0], K = w.dims[1];
      std::vector<float> dense = p.dense(w);
      // the whole matrix, and rows [3, 3 + 13) and [20, 20 + 13) as views (q_proj's groups of eight then cross
      // a half head, and a head, of its un-permuted rows)
      for (int64_t r0 : {int64_t{0}, int64_t{3}, int64_t{20}}) {
        const int64_t n = r0 ? 13 : N;
        Tensor wq = w;
        wq.dims[0] = n, wq.qrow0 = r0;
        Tensor wd(dense.data() + r0 * K, DType::f32, {n, K});
        const std::vector<float> x = randn(K, 3);
        for (int threads : {1, 2}) {
          omp_set_num_threads(threads);
          std::vector<float> y1(static_cast<size_t>(n)), y2(y1.size());
          ops->matmul(Tensor::of(y1.data(), {1, n}), Tensor::of(x.data(), {1, K}), wq, false, true, false);
          ops->matmul(Tensor::of(y2.data(), {1, n}), Tensor::of(x.data(), {1, K}), wd, false, true, false);
          EXPECT_TRUE(test::same_product(y1.data(), y2.data(), y1.size())) << name << " rows from " << r0 << ", threads " << threads;
          double err = 0, norm = 0;  // and the value itself, against float64
          for (int64_t j = 0; j < n; ++j) {
            double s = 0;
            for (int64_t k = 0; k < K; ++k) s += static_cast<double>(x[static_cast<size_t>(k)]) * dense[static_cast<size_t>((r0 + j) * K + k)];
            err = std::max(err, std::abs(s - y1[static_cast<size_t>(j)]));
            norm = std::max(norm, std::abs(s));
          }
          EXPECT_LT(err, 1e-5 * (1 + norm)) << name;
        }
      }
    }
  }
  omp_set_num_threads(omp_get_num_procs());
}


// With set_int8_activations (generate --decode-dot int8) a one-row product over Q4_0, Q4_1 and Q8_0 blocks
// quantises the row to 8 bits and multiplies integers: the result is the float64 product of the dequantised
// weights with the dequantised activation codes (to f32 rounding), the same bits for 1 and 2 threads and
// for row views; products of more rows, and one-row products once it is off again, keep the f32 bits.
TEST(QuantGemm, GgufOneRowWithInt8ActivationsIsTheIntegerProduct) {
  DeviceAccess inside;  // the blocks' row readers called directly, as the GEMM calls them
  auto ops = make_ops("cpu");
  for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0}) {
    SCOPED_TRACE(ggml_type_name(type));
    GgufProjections p(type);
    const bool kernel = ggml_row_dot_q8(type) != nullptr;
    EXPECT_EQ(p.qb->set_int8_activations(true), kernel ? 2 : 0);
    for (const char* name : GgufProjections::names) {
      const Tensor w = *p.qp.find(name);
      EXPECT_EQ(w.quant->dot_rows_q8 != nullptr, kernel) << name;
      const int64_t N = w.dims[0], K = w.dims[1];
      std::vector<float> dense = p.dense(w);
      const std::vector<float> x = randn(2 * K, 5);
      std::vector<char> mem(q8_act_bytes(K));
      const Q8Act xa = q8_act_at(mem.data(), K);
      quantise_q8_act_scalar(x.data(), xa);
      for (int64_t r0 : {int64_t{0}, int64_t{3}}) {
        const int64_t n = r0 ? 13 : N;
        Tensor wq = w;
        wq.dims[0] = n, wq.qrow0 = r0;
        Tensor wd(dense.data() + r0 * K, DType::f32, {n, K});
        std::vector<float> first;
        for (int threads : {1, 2}) {
          omp_set_num_threads(threads);
          std::vector<float> y(static_cast<size_t>(n)), yd(y.size());
          ops->matmul(Tensor::of(y.data(), {1, n}), Tensor::of(x.data(), {1, K}), wq, false, true, false);
          ops->matmul(Tensor::of(yd.data(), {1, n}), Tensor::of(x.data(), {1, K}), wd, false, true, false);
          if (threads == 1) first = y;
          else EXPECT_EQ(std::memcmp(first.data(), y.data(), y.size() * 4), 0) << name << " rows from " << r0;
          if (!kernel) {
            EXPECT_EQ(std::memcmp(y.data(), yd.data(), y.size() * 4), 0) << name;
            continue;
          }
          for (int64_t j = 0; j < n; ++j) {
            double s = 0, mag = 0;
            for (int64_t k = 0; k < K; ++k) {
              const double a = static_cast<double>(xa.q[k]) * xa.d[k / kQ8Block];
              const double t = a * dense[static_cast<size_t>((r0 + j) * K + k)];
              s += t, mag += std::abs(t);
            }
            EXPECT_NEAR(y[static_cast<size_t>(j)], s, 1e-5 * mag + 1e-30) << name << " row " << r0 + j;
            // and within the activations' quantisation of the f32 product
            EXPECT_NEAR(y[static_cast<size_t>(j)], yd[static_cast<size_t>(j)], 0.02 * mag + 1e-30) << name << " row " << r0 + j;
          }
        }
        // two rows: the blocked product, bitwise the dequantised matrix's
        std::vector<float> y2(static_cast<size_t>(2 * n)), yd2(y2.size());
        ops->matmul(Tensor::of(y2.data(), {2, n}), Tensor::of(x.data(), {2, K}), wq, false, true, false);
        ops->matmul(Tensor::of(yd2.data(), {2, n}), Tensor::of(x.data(), {2, K}), wd, false, true, false);
        EXPECT_EQ(std::memcmp(y2.data(), yd2.data(), y2.size() * 4), 0) << name;
      }
    }
    EXPECT_EQ(p.qb->set_int8_activations(false), 0);
    const Tensor w = *p.qp.find(GgufProjections::names[1]);
    EXPECT_EQ(w.quant->dot_rows_q8, nullptr);
  }
  omp_set_num_threads(omp_get_num_procs());
}

}  // namespace
}  // namespace oomless::test
