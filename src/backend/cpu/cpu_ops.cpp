// CPU kernels for the element-wise and row-wise ops, and matmul through Gemm. Attention and the fused
// cross-entropy are in their own files. Reductions across rows (parameter gradients) are parallel over
// columns, each column summed over rows in order; global sums use a fixed partition of the data into
// chunks whose partial sums are added sequentially: results never depend on the thread count.
#include "backend/cpu/cpu_ops.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/checks.h"
#include "backend/lapack.h"
#include "backend/cpu/adam8.h"
#include "backend/cpu/adamw.h"
#include "backend/cpu/gemm.h"
#include "backend/rope.h"
#include "core/clones.h"

namespace oomless {

namespace {
constexpr DType kAct = DType::f32;
constexpr int64_t kColBlock = 64;        // columns per task in column-parallel reductions
constexpr int64_t kAdamBlock = 1 << 14;  // elements per AdamW task (elementwise: any split gives the same bits)
constexpr int64_t kSumChunk = 1 << 14;   // elements per partial sum in sum_squares

float* f32p(const Tensor& t) { return static_cast<float*>(t.data); }
const int32_t* i32p(const Tensor& t) { return static_cast<const int32_t*>(t.data); }
}  // namespace

CpuOps::CpuOps(Arena* workspace) {
  if (!workspace) {
    own_ledger_ = std::make_unique<Ledger>();
    own_arena_ = std::make_unique<Arena>(Tier::Host, std::numeric_limits<size_t>::max(), *own_ledger_);
    workspace = own_arena_.get();
  }
  ws_ = workspace;
  gemm_ = std::make_unique<Gemm>(*ws_);
}

CpuOps::~CpuOps() = default;

Buffer CpuOps::scratch(size_t bytes, const char* what) { return ws_->alloc(bytes, Category::workspace, what); }

std::array<size_t, 2> CpuOps::matmul_workspace(int64_t M, int64_t N, int64_t K, bool bf16) const {
  if (M <= 0 || N <= 0 || K <= 0) return {0, 0};
  return Gemm::pack_bytes(GemmShape{.M = M, .N = N, .K = K, .ab = bf16 ? DType::bf16 : DType::f32},
                          omp_get_max_threads());
}

void CpuOps::matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool accumulate) {
  auto [M_, N_, K_] = check_matmul(c, a, b, ta, tb, kAct);
  // Copies: clang before 16 cannot capture structured bindings in lambdas / OpenMP regions.
  const int64_t M = M_, N = N_, K = K_;
  gemm_->run(GemmShape{.M = M, .N = N, .K = K, .ta = ta, .tb = tb, .ab = a.dtype, .b_as_bf16 = b.as_bf16,
                       .accumulate = accumulate, .b_quant = b.quant, .b_qrow0 = b.qrow0},
             a.data, b.data, f32p(c));
}

void CpuOps::embedding_forward(Tensor out, Tensor ids, Tensor table) {
  auto [T_, E_] = check_embedding_host("[embedding]", out, ids, table, kAct, true);
  // Copies: clang before 16 cannot capture structured bindings in lambdas / OpenMP regions.
  const int64_t T = T_, E = E_;
  const int32_t* id = i32p(ids);
  float* o = f32p(out);
  if (table.quant) {  // each row dequantised as the GEMM reads it
    const QuantMatrix* q = table.quant;
    const int64_t q0 = table.qrow0;
#pragma omp parallel for schedule(static) if (T * E >= kParallelMin)
    for (int64_t t = 0; t < T; ++t) q->dequant_row(*q, q0 + id[t], 0, E, o + t * E);
  } else if (table.dtype == DType::bf16) {
    const uint16_t* w = static_cast<const uint16_t*>(table.data);
#pragma omp parallel for schedule(static) if (T * E >= kParallelMin)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) o[t * E + e] = bf16_to_f32(w[id[t] * E + e]);
  } else {
    const float* w = f32p(table);
#pragma omp parallel for schedule(static) if (T * E >= kParallelMin)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) o[t * E + e] = w[id[t] * E + e];
  }
}

void CpuOps::embedding_backward(Tensor dtable, Tensor dout, Tensor ids) {
  auto [T_, E_] = check_embedding_host("[embedding_backward]", dout, ids, dtable, kAct, false);
  // Copies: clang before 16 cannot capture structured bindings in lambdas / OpenMP regions.
  const int64_t T = T_, E = E_;
  const int32_t* id = i32p(ids);
  const float* g = f32p(dout);
  float* w = f32p(dtable);
  // Column blocks in parallel, tokens in order: repeated ids accumulate in a fixed order.
  int64_t nb = (E + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    int64_t e0 = b * kColBlock, e1 = std::min(E, e0 + kColBlock);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = e0; e < e1; ++e) w[id[t] * E + e] += g[t * E + e];
  }
}

void CpuOps::rmsnorm_forward(Tensor out, Tensor rstd, Tensor in, Tensor weight, double eps) {
  auto [R_, E_] = check_rmsnorm("[rmsnorm]", out, rstd, in, weight, kAct);
  // Copies: clang before 16 cannot capture structured bindings in lambdas / OpenMP regions.
  const int64_t R = R_, E = E_;
  const float* x = f32p(in);
  const float* w = f32p(weight);
  float* y = f32p(out);
  float* rs = f32p(rstd);
#pragma omp parallel for schedule(static) if (R * E >= kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t e = 0; e < E; ++e) ss += static_cast<double>(x[r * E + e]) * x[r * E + e];
    float s = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(E) + eps));
    rs[r] = s;
    for (int64_t e = 0; e < E; ++e) y[r * E + e] = x[r * E + e] * s * w[e];
  }
}

void CpuOps::rmsnorm_backward(Tensor din, Tensor dweight, Tensor dout, Tensor in, Tensor weight, Tensor rstd) {
  auto [R_, E_] = check_rmsnorm("[rmsnorm_backward]", dout, rstd, in, weight, kAct);
  // Copies: clang before 16 cannot capture structured bindings in lambdas / OpenMP regions.
  const int64_t R = R_, E = E_;
  check_elementwise("[rmsnorm_backward]", {&din, &in}, kAct);
  if (dweight.data) check_same_shape("[rmsnorm_backward]", "dweight", dweight, "weight", weight);
  const float* x = f32p(in);
  const float* dy = f32p(dout);
  const float* w = f32p(weight);
  const float* rs = f32p(rstd);
  float* dx = f32p(din);
  float* dw = f32p(dweight);
  // dweight first: din may alias dout.
  const int64_t nb = dw ? (E + kColBlock - 1) / kColBlock : 0;  // no dweight: a frozen norm
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    int64_t e0 = b * kColBlock, e1 = std::min(E, e0 + kColBlock);
    double acc[kColBlock] = {};
    for (int64_t r = 0; r < R; ++r)
      for (int64_t e = e0; e < e1; ++e) acc[e - e0] += static_cast<double>(dy[r * E + e]) * x[r * E + e] * rs[r];
    for (int64_t e = e0; e < e1; ++e) dw[e] += static_cast<float>(acc[e - e0]);
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += static_cast<double>(dy[r * E + e]) * w[e] * x[r * E + e];
    float s = rs[r];
    float k = static_cast<float>(dot * s * s * s / static_cast<double>(E));
    for (int64_t e = 0; e < E; ++e) dx[r * E + e] = s * dy[r * E + e] * w[e] - x[r * E + e] * k;
  }
}

namespace {
// Rotates pairs (x[i], x[i + D/2]) by +angle (forward, sign 1) or -angle (backward, sign -1), scaled by
// attention_factor (yarn; 1 otherwise). The angles and their cos/sin are computed in double, then applied
// in f32. A call whose positions and frequencies are the last table's (q then k of a block, and their
// gradients in backward: four calls a layer over the same positions) reads that table instead of computing
// its T x D/2 sines and cosines again; the values are the ones it would compute.
void cpu_rope(const char* op, Tensor out, Tensor in, Tensor pos, const RopeConfig& cfg, float sign, RopeTable& tab) {
  auto [T_, H_, D_] = check_rope(op, out, in, pos, kAct);
  // Copies: clang before 16 cannot capture structured bindings in lambdas / OpenMP regions.
  const int64_t T = T_, H = H_, D = D_;
  int64_t half = D / 2;
  std::vector<double> inv(half);
  rope_inv_freq(inv.data(), D, cfg);
  const float* x = f32p(in);
  float* y = f32p(out);
  const int32_t* p = i32p(pos);
  const bool table = T * half <= RopeTable::kMaxEntries;
  if (table && !(tab.inv == inv && tab.factor == cfg.attention_factor && tab.pos.size() == static_cast<size_t>(T) &&
                 std::equal(p, p + T, tab.pos.begin()))) {
    tab.inv = inv;
    tab.factor = cfg.attention_factor;
    tab.pos.assign(p, p + T);
    tab.cs.resize(static_cast<size_t>(T * half));
    tab.sn.resize(static_cast<size_t>(T * half));
    float* tc = tab.cs.data();
    float* ts = tab.sn.data();
#pragma omp parallel for schedule(static) if (T * half >= kParallelMin / 8)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < half; ++i) {
        double ang = static_cast<double>(p[t]) * inv[i];
        tc[t * half + i] = static_cast<float>(cfg.attention_factor * std::cos(ang));
        ts[t * half + i] = static_cast<float>(cfg.attention_factor * std::sin(ang));
      }
  }
  const float* tc = table ? tab.cs.data() : nullptr;
  const float* ts = table ? tab.sn.data() : nullptr;
#pragma omp parallel if (T * H * D >= kParallelMin)
  {
    std::vector<float> cs(half), sn(half);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        if (tc) {
          cs[i] = tc[t * half + i];
          sn[i] = sign * ts[t * half + i];
          continue;
        }
        double ang = static_cast<double>(p[t]) * inv[i];
        cs[i] = static_cast<float>(cfg.attention_factor * std::cos(ang));
        sn[i] = sign * static_cast<float>(cfg.attention_factor * std::sin(ang));
      }
      for (int64_t h = 0; h < H; ++h) {
        const float* a = x + (t * H + h) * D;
        float* b = y + (t * H + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          float x1 = a[i], x2 = a[i + half];
          b[i] = x1 * cs[i] - x2 * sn[i];
          b[i + half] = x2 * cs[i] + x1 * sn[i];
        }
      }
    }
  }
}
}  // namespace

void CpuOps::rope_forward(Tensor out, Tensor in, Tensor pos, const RopeConfig& cfg) {
  cpu_rope("[rope]", out, in, pos, cfg, 1.0f, rope_table_);
}
void CpuOps::rope_backward(Tensor din, Tensor dout, Tensor pos, const RopeConfig& cfg) {
  cpu_rope("[rope_backward]", din, dout, pos, cfg, -1.0f, rope_table_);
}

void CpuOps::add(Tensor out, Tensor a, Tensor b) {
  check_elementwise("[add]", {&out, &a, &b}, kAct);
  const float* x = f32p(a);
  const float* y = f32p(b);
  float* o = f32p(out);
  int64_t n = out.numel();
  if (n < kParallelMin) {  // on this thread (see kParallelMin)
    for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
    return;
  }
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

void CpuOps::axpy(Tensor y, double alpha, Tensor x) {
  check_elementwise("[axpy]", {&y, &x}, kAct);
  float a = static_cast<float>(alpha);
  const float* xs = f32p(x);
  float* ys = f32p(y);
  int64_t n = y.numel();
  if (n < kParallelMin) {  // on this thread (see kParallelMin)
    for (int64_t i = 0; i < n; ++i) ys[i] += a * xs[i];
    return;
  }
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) ys[i] += a * xs[i];
}

void CpuOps::scale(Tensor x, double alpha) {
  check_elementwise("[scale]", {&x}, kAct);
  float a = static_cast<float>(alpha);
  float* xs = f32p(x);
  int64_t n = x.numel();
  if (n < kParallelMin) {  // on this thread (see kParallelMin)
    for (int64_t i = 0; i < n; ++i) xs[i] *= a;
    return;
  }
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) xs[i] *= a;
}

void CpuOps::dropout(Tensor out, Tensor in, double p, uint64_t seed, int64_t offset, bool accumulate) {
  check_dropout("[dropout]", out, in, p, kAct);
  const float s = static_cast<float>(1.0 / (1.0 - p));
  const float* x = f32p(in);
  float* y = f32p(out);
  const int64_t n = out.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float v = dropout_keep(seed, offset + i, p) ? x[i] * s : 0.0f;
    y[i] = accumulate ? y[i] + v : v;
  }
}

void CpuOps::row_norms(Tensor out, Tensor w) {
  auto [N_, K_] = check_row_norms("[row_norms]", out, w, kAct);
  const int64_t N = N_, K = K_;
  const QuantMatrix* q = w.quant;
  const int64_t q0 = w.qrow0;
  const float* x = f32p(w);
  float* o = f32p(out);
#pragma omp parallel
  {
    std::vector<float> row(q ? static_cast<size_t>(K) : 0);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < N; ++j) {
      const float* r = x ? x + j * K : nullptr;
      if (q) q->dequant_row(*q, q0 + j, 0, K, row.data()), r = row.data();
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<double>(r[k]) * r[k];
      o[j] = static_cast<float>(std::sqrt(s));
    }
  }
}

void CpuOps::dora_scale(Tensor g, Tensor n, Tensor m, Tensor wn, Tensor b, Tensor p, Tensor q, double s) {
  auto [N_, r_] = check_dora_scale("[dora_scale]", g, n, m, wn, b, p, q, kAct);
  const int64_t N = N_, r = r_;
  const float *bs = f32p(b), *ps = f32p(p), *qs = f32p(q), *ms = f32p(m), *ws = f32p(wn);
  float *gs = f32p(g), *ns = f32p(n);
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < N; ++j) {
    double sq = static_cast<double>(ws[j]) * ws[j], cross = 0, self = 0;
    for (int64_t i = 0; i < r; ++i) {
      cross += static_cast<double>(bs[j * r + i]) * ps[i * N + j];
      self += static_cast<double>(bs[j * r + i]) * qs[j * r + i];
    }
    const double nj = std::sqrt(std::max(0.0, sq + 2 * s * cross + s * s * self));
    ns[j] = static_cast<float>(nj);
    gs[j] = static_cast<float>(ms[j] / nj);
  }
}

void CpuOps::dora_forward(Tensor y, Tensor z, Tensor g, Tensor bias) {
  auto [T_, N_] = check_dora_forward("[dora_forward]", y, z, g, bias, kAct);
  const int64_t T = T_, N = N_;
  float* ys = f32p(y);
  float* zs = f32p(z);
  const float *gs = f32p(g), *bs = f32p(bias);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < N; ++j) {
      const float v = ys[t * N + j];
      if (zs) zs[t * N + j] = v;
      ys[t * N + j] = bs ? gs[j] * v + bs[j] : gs[j] * v;
    }
}

void CpuOps::dora_backward(Tensor dz, Tensor dm, Tensor dy, Tensor z, Tensor g, Tensor n) {
  auto [T_, N_] = check_dora_backward("[dora_backward]", dz, dm, dy, z, g, n, kAct);
  const int64_t T = T_, N = N_;
  const float *dys = f32p(dy), *zs = f32p(z), *gs = f32p(g), *ns = f32p(n);
  float *dzs = f32p(dz), *dms = f32p(dm);
  // dm: column blocks in parallel, each column summed over rows in order; then the scaling.
  const int64_t blocks = (N + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static)
  for (int64_t bk = 0; bk < blocks; ++bk) {
    const int64_t j0 = bk * kColBlock, j1 = std::min(N, j0 + kColBlock);
    double acc[kColBlock] = {};
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = j0; j < j1; ++j) acc[j - j0] += static_cast<double>(dys[t * N + j]) * zs[t * N + j];
    for (int64_t j = j0; j < j1; ++j) dms[j] += static_cast<float>(acc[j - j0] / ns[j]);
  }
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < N; ++j) dzs[t * N + j] = gs[j] * dys[t * N + j];
}

void CpuOps::scale_rows(Tensor x, Tensor g) {
  auto [N_, K_] = check_scale_rows("[scale_rows]", x, g, kAct);
  const int64_t N = N_, K = K_;
  float* xs = f32p(x);
  const float* gs = f32p(g);
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < N; ++j)
    for (int64_t k = 0; k < K; ++k) xs[j * K + k] *= gs[j];
}

void CpuOps::fill(Tensor x, double value) {
  check_elementwise("[fill]", {&x}, kAct);
  float v = static_cast<float>(value);
  float* xs = f32p(x);
  int64_t n = x.numel();
  if (n < kParallelMin) {  // on this thread (see kParallelMin)
    for (int64_t i = 0; i < n; ++i) xs[i] = v;
    return;
  }
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) xs[i] = v;
}

namespace {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
typedef double v8d __attribute__((vector_size(64)));

// The sum of squares of x[0, n) in double: eight lanes (lane l sums the elements i = l mod 8 in order), then
// the lanes pairwise and the tail in order. A square of a float is exact in double, so a fused multiply-add
// rounds as the product and the sum do: every clone gives the same bits.
OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
double sum_squares_chunk(const float* x, int64_t n) {
  v8d acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8d v;
    for (int l = 0; l < 8; ++l) v[l] = static_cast<double>(x[i + l]);
    acc += v * v;
  }
  double s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}
#pragma GCC diagnostic pop

}  // namespace

double CpuOps::sum_squares(Tensor x) {
  check_elementwise("[sum_squares]", {&x}, kAct);
  const float* xs = f32p(x);
  int64_t n = x.numel();
  int64_t chunks = (n + kSumChunk - 1) / kSumChunk;
  std::vector<double> part(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t i0 = c * kSumChunk, i1 = std::min(n, i0 + kSumChunk);
    part[c] = sum_squares_chunk(xs + i0, i1 - i0);
  }
  double total = 0;
  for (double p : part) total += p;
  return total;
}

double CpuOps::abs_max(Tensor x) {
  check_elementwise("[abs_max]", {&x}, kAct);
  const float* xs = f32p(x);
  const int64_t n = x.numel(), chunks = (n + kSumChunk - 1) / kSumChunk;
  std::vector<float> part(static_cast<size_t>(chunks));
  std::vector<char> finite(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i0 = c * kSumChunk, i1 = std::min(n, i0 + kSumChunk);
    float m = 0;
    bool f = true;
    for (int64_t i = i0; i < i1; ++i) {
      const float a = std::fabs(xs[i]);
      f &= std::isfinite(a);
      m = std::max(m, a);
    }
    part[static_cast<size_t>(c)] = m;
    finite[static_cast<size_t>(c)] = f;
  }
  double m = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (!finite[static_cast<size_t>(c)]) return NAN;
    m = std::max(m, static_cast<double>(part[static_cast<size_t>(c)]));
  }
  return m;
}

void CpuOps::convert(Tensor dst, Tensor src) {
  OOM_CHECK(dst.numel() == src.numel(), "[convert] dst ", dst.str(), " and src ", src.str(), " differ in size");
  int64_t n = src.numel();
  constexpr int64_t kChunk = 1 << 16;
  int64_t chunks = (n + kChunk - 1) / kChunk;
  // Validate the pair once (throws for unsupported pairs) before the parallel loop.
  oomless::convert(dst.data, dst.dtype, src.data, src.dtype, 0);
#pragma omp parallel for schedule(static) if (chunks > 1)  // one chunk (a K/V page): no team to wake
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t i0 = c * kChunk, len = std::min(n, i0 + kChunk) - i0;
    oomless::convert(static_cast<uint8_t*>(dst.data) + dtype_bytes(dst.dtype, i0), dst.dtype,
                     static_cast<const uint8_t*>(src.data) + dtype_bytes(src.dtype, i0), src.dtype, len);
  }
}

namespace {

// f8_e4m3 codes of x[i] * s for i < n8 (a multiple of 8), eight at a time: the bits of f32_to_f8e4m3(y, true)
// (round to nearest even; subnormals as a * 2^9 rounded to an integer by the default rounding mode; past 448
// and inf saturate to 0x7e, NaN gives 0x7f), with the counts of the scalar loop: amax and finiteness of |x|,
// |y| > 464 saturated, x != 0 stored as zero.
__attribute__((target("avx2"))) void e4m3_avx2(const float* x, float s, int64_t n8, uint8_t* d, float& amax,
                                                bool& finite, int64_t& sat, int64_t& flush) {
  const __m256 vs = _mm256_set1_ps(s), absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 min_normal = _mm256_set1_ps(0x1p-6f), two9 = _mm256_set1_ps(512.0f), sat_at = _mm256_set1_ps(464.0f);
  const __m256 inf = _mm256_set1_ps(INFINITY);
  const __m256i one = _mm256_set1_epi32(1), round = _mm256_set1_epi32(0x7ffff), rebias = _mm256_set1_epi32(120 << 3);
  const __m256i kmax = _mm256_set1_epi32(0x7e), knan = _mm256_set1_epi32(0x7f), m7f = _mm256_set1_epi32(0x7f);
  const __m256i zero = _mm256_setzero_si256();
  __m256 vmax = _mm256_setzero_ps();
  __m256 nonfinite = _mm256_setzero_ps();
  int64_t nsat = 0, nflush = 0;
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i), y = _mm256_mul_ps(xv, vs);
    const __m256 ax = _mm256_and_ps(xv, absmask), ay = _mm256_and_ps(y, absmask);
    vmax = _mm256_max_ps(vmax, ax);  // NaN lanes leave vmax unchanged; counted as non-finite below
    nonfinite = _mm256_or_ps(nonfinite, _mm256_cmp_ps(ax, inf, _CMP_NLT_UQ));
    const __m256i bits = _mm256_castps_si256(ay);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(y), 24), _mm256_set1_epi32(0x80));
    __m256i normal = _mm256_add_epi32(_mm256_add_epi32(bits, round), _mm256_and_si256(_mm256_srli_epi32(bits, 20), one));
    normal = _mm256_sub_epi32(_mm256_srli_epi32(normal, 20), rebias);
    normal = _mm256_min_epi32(normal, kmax);  // past 448 and inf: saturate
    const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(ay, two9));
    __m256i code = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub),
                                                         _mm256_cmp_ps(ay, min_normal, _CMP_LT_OQ)));
    code = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(code), _mm256_castsi256_ps(knan),
                                                _mm256_cmp_ps(ay, ay, _CMP_UNORD_Q)));
    const __m256i zero_code = _mm256_cmpeq_epi32(_mm256_and_si256(code, m7f), zero);
    code = _mm256_or_si256(code, sign);
    const __m128i p16 = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(d + i), _mm_packus_epi16(p16, p16));
    nsat += std::popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(ay, sat_at, _CMP_GT_OQ))));
    const __m256 nz = _mm256_cmp_ps(xv, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    nflush += std::popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_and_ps(nz, _mm256_castsi256_ps(zero_code)))));
  }
  alignas(32) float m[8];
  _mm256_store_ps(m, vmax);
  for (float v : m) amax = std::max(amax, v);
  finite &= _mm256_movemask_ps(nonfinite) == 0;
  sat += nsat;
  flush += nflush;
}

}  // namespace

CastStats CpuOps::cast_scaled(Tensor dst, Tensor src, double scale) {
  OOM_CHECK(dst.numel() == src.numel(), "[cast_scaled] dst ", dst.str(), " and src ", src.str(), " differ in size");
  OOM_CHECK(src.dtype == DType::f32, "[cast_scaled] src must be f32, got ", src.str());
  const DType dt = dst.dtype;
  OOM_CHECK(dt == DType::bf16 || dt == DType::f8_e4m3 || dt == DType::f8_e5m2,
            "[cast_scaled] dst must be bf16, f8_e4m3 or f8_e5m2, got ", dst.str());
  const int64_t n = src.numel();
  constexpr int64_t kChunk = 1 << 15;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const float* x = f32p(src);
  const float s = static_cast<float>(scale);
  static const bool kernels_avx2 = __builtin_cpu_supports("avx2");
  struct Part {
    float amax = 0;
    bool finite = true;
    int64_t sat = 0, flush = 0;
  };
  std::vector<Part> part(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
    Part p;
    if (dt == DType::bf16) {
      uint16_t* d = static_cast<uint16_t*>(dst.data);
      if (s == 1.0f) {
        oomless::convert(d + i0, dt, x + i0, DType::f32, i1 - i0);
      } else {
        for (int64_t i = i0; i < i1; ++i) d[i] = f32_to_bf16(x[i] * s);
      }
      for (int64_t i = i0; i < i1; ++i) {
        const float a = std::fabs(x[i]), v = bf16_to_f32(d[i]);
        p.finite &= std::isfinite(a);
        p.amax = std::max(p.amax, a);
        p.sat += std::isinf(v) && std::isfinite(x[i] * s);
        p.flush += x[i] != 0.0f && v == 0.0f;
      }
    } else {
      uint8_t* d = static_cast<uint8_t*>(dst.data);
      const bool e4m3 = dt == DType::f8_e4m3;
      int64_t i = i0;
      if (e4m3 && kernels_avx2) {
        const int64_t n8 = (i1 - i0) / 8 * 8;
        e4m3_avx2(x + i0, s, n8, d + i0, p.amax, p.finite, p.sat, p.flush);
        i += n8;
      }
      for (; i < i1; ++i) {
        const float y = x[i] * s, a = std::fabs(x[i]);
        const uint8_t code = e4m3 ? f32_to_f8e4m3(y, true) : f32_to_f8e5m2(y, false);
        d[i] = code;
        p.finite &= std::isfinite(a);
        p.amax = std::max(p.amax, a);
        // E4M3 saturates past the midpoint above 448; E5M2 overflows to inf.
        p.sat += e4m3 ? std::fabs(y) > 464.0f : std::isinf(f8e5m2_to_f32(code)) && std::isfinite(y);
        p.flush += x[i] != 0.0f && (code & 0x7f) == 0;
      }
    }
    part[static_cast<size_t>(c)] = p;
  }
  CastStats r;
  bool finite = true;
  for (const Part& p : part) {
    finite &= p.finite;
    r.amax = std::max(r.amax, static_cast<double>(p.amax));
    r.saturated += p.sat;
    r.flushed += p.flush;
  }
  if (!finite) r.amax = NAN;
  return r;
}

void CpuOps::cast_rows_scaled(Tensor dst, Tensor scales, Tensor src) {
  const RowsCols rc = check_cast_rows("[cast_rows_scaled]", dst, scales, src, kAct);
  const int64_t N = rc.rows, K = rc.cols;  // (named, not bound: clang's OpenMP takes no structured bindings)
  const bool e4m3 = dst.dtype == DType::f8_e4m3;
  const float qmax = e4m3 ? 448.0f : 127.0f;
#pragma omp parallel for schedule(static) if (N * K >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = f32p(src) + n * K;
    float amax = 0;
    for (int64_t k = 0; k < K; ++k) amax = std::isnan(x[k]) || std::isnan(amax) ? NAN : std::max(amax, std::fabs(x[k]));
    const float s = amax / qmax, inv = s == 0.0f ? 0.0f : 1.0f / s;
    f32p(scales)[n] = s;
    if (e4m3) {
      uint8_t* d = static_cast<uint8_t*>(dst.data) + n * K;
      for (int64_t k = 0; k < K; ++k) d[k] = f32_to_f8e4m3(x[k] * inv, true);
    } else {
      int8_t* d = static_cast<int8_t*>(dst.data) + n * K;
      for (int64_t k = 0; k < K; ++k) {
        const float y = x[k] * inv;
        d[k] = std::isfinite(y) ? static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.0f, 127.0f)) : int8_t{0};
      }
    }
  }
}

void CpuOps::adamw_step(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamWConfig& cfg) {
  check_adamw(param, grad, m, v, cfg, kAct);
  float b1 = static_cast<float>(cfg.beta1), b2 = static_cast<float>(cfg.beta2);
  // 1 - beta in double, as torch does: (1 - float(beta2)) is off by ~1e-5 relative at beta2 = 0.999.
  float omb1 = static_cast<float>(1.0 - cfg.beta1), omb2 = static_cast<float>(1.0 - cfg.beta2);
  float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(cfg.beta1, static_cast<double>(cfg.step))));
  float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(cfg.beta2, static_cast<double>(cfg.step))));
  float lr = static_cast<float>(cfg.lr), wd = static_cast<float>(cfg.weight_decay), eps = static_cast<float>(cfg.eps);
  const bool after = cfg.decay_after_update;
  const float keep = static_cast<float>(1.0 - cfg.lr * cfg.weight_decay);
  float* p = f32p(param);
  const float* g = f32p(grad);
  float* ms = f32p(m);
  float* vs = f32p(v);
  const int64_t n = param.numel(), blocks = (n + kAdamBlock - 1) / kAdamBlock;
  const cpu::AdamWScalars s{b1, b2, omb1, omb2, inv_bc1, inv_sqrt_bc2, lr, wd, eps, keep, after};
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = b * kAdamBlock;
    cpu::adamw_range(s, p + i0, g + i0, ms + i0, vs + i0, std::min(kAdamBlock, n - i0));
  }
}

void CpuOps::adamw8bit_step(Tensor param, Tensor grad, Tensor m_codes, Tensor m_absmax, Tensor v_codes,
                            Tensor v_absmax, const AdamWConfig& cfg) {
  check_adamw8bit(param, grad, m_codes, m_absmax, v_codes, v_absmax, cfg, kAct);
  // Scalars as bitsandbytes' CPU update makes them: float(beta), float(1 - beta) from double, the bias
  // corrections in double.
  cpu::Adam8Scalars s;
  s.b1 = static_cast<float>(cfg.beta1), s.b2 = static_cast<float>(cfg.beta2);
  s.omb1 = static_cast<float>(1.0 - cfg.beta1), s.omb2 = static_cast<float>(1.0 - cfg.beta2);
  const double c1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(cfg.step));
  s.c2 = static_cast<float>(std::sqrt(1.0 - std::pow(cfg.beta2, static_cast<double>(cfg.step))));
  s.step_size = static_cast<float>(-cfg.lr / c1), s.eps = static_cast<float>(cfg.eps);
  s.decay = cfg.weight_decay > 0;
  s.keep = static_cast<float>(1.0 - cfg.lr * cfg.weight_decay);
  const cpu::Adam8Block block = cpu::adam8_block();
  float* p = f32p(param);
  const float* g = f32p(grad);
  uint8_t* mc = static_cast<uint8_t*>(m_codes.data);
  uint8_t* vc = static_cast<uint8_t*>(v_codes.data);
  float* ma = f32p(m_absmax);
  float* va = f32p(v_absmax);
  const int64_t n = param.numel(), blocks = (n + kAdam8Block - 1) / kAdam8Block;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = b * kAdam8Block, len = std::min(n - i0, kAdam8Block);
    block(s, p + i0, g + i0, mc + i0, ma + b, vc + i0, va + b, len);
  }
}

void CpuOps::svd_basis(Tensor out, Tensor g, bool right) {
  check_svd_basis(out, g, right, kAct);
  const int64_t m = g.dims[0], n = g.dims[1];
  Buffer work = scratch(lapack::svd_workspace(m, n, sizeof(float)), "svd");
  lapack::svd_basis(f32p(g), m, n, right ? out.dims[0] : out.dims[1], right, f32p(out), work.data());
}

}  // namespace oomless
