// Float64 reference kernels: obvious loops, no tiling, no threads. Attention and cross-entropy live in
// their own files of this folder.
#include "backend/ref/ref_ops.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "backend/checks.h"
#include "backend/rope.h"
#include "backend/lapack.h"
#include "core/dynamic8.h"
#include "backend/ref/ref_load.h"

namespace oomless {

namespace {
constexpr DType kAct = DType::f64;
using ref_detail::load;

double* f64(const Tensor& t) { return static_cast<double*>(t.data); }
const int32_t* i32(const Tensor& t) { return static_cast<const int32_t*>(t.data); }

}  // namespace

void RefOps::matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool accumulate) {
  auto [M, N, K] = check_matmul(c, a, b, ta, tb, kAct);
  // A quantised b: its rows dequantised to f32 (bf16-rounded when read as bf16), as the CPU GEMM packs them.
  std::vector<double> bq;
  if (b.quant) {
    const int64_t rows = b.dims[0], cols = b.dims[1];
    std::vector<float> row(static_cast<size_t>(cols));
    bq.resize(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      b.quant->dequant_row(*b.quant, b.qrow0 + r, 0, cols, row.data());
      for (int64_t j = 0; j < cols; ++j)
        bq[static_cast<size_t>(r * cols + j)] = b.as_bf16 ? round_to_bf16(row[static_cast<size_t>(j)]) : row[static_cast<size_t>(j)];
    }
  }
  auto lb = [&](int64_t i) { return b.quant ? bq[static_cast<size_t>(i)] : load(b, i); };
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += load(a, ta ? k * M + i : i * K + k) * lb(tb ? j * K + k : k * N + j);
      f64(c)[i * N + j] = accumulate ? f64(c)[i * N + j] + s : s;
    }
}

void RefOps::matmul_magnitude(Tensor bound, Tensor a, Tensor b, bool ta, bool tb) {
  auto [M, N, K] = check_matmul(bound, a, b, ta, tb, kAct);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += std::fabs(load(a, ta ? k * M + i : i * K + k)) * std::fabs(load(b, tb ? j * K + k : k * N + j));
      f64(bound)[i * N + j] = s;
    }
}

void RefOps::embedding_forward(Tensor out, Tensor ids, Tensor table) {
  auto [T, E] = check_embedding_host("[embedding]", out, ids, table, kAct, true);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) f64(out)[t * E + e] = load(table, i32(ids)[t] * E + e);
}

void RefOps::embedding_backward(Tensor dtable, Tensor dout, Tensor ids) {
  auto [T, E] = check_embedding_host("[embedding_backward]", dout, ids, dtable, kAct, false);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) f64(dtable)[i32(ids)[t] * E + e] += f64(dout)[t * E + e];
}

void RefOps::rmsnorm_forward(Tensor out, Tensor rstd, Tensor in, Tensor weight, double eps) {
  auto [R, E] = check_rmsnorm("[rmsnorm]", out, rstd, in, weight, kAct);
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t e = 0; e < E; ++e) ss += f64(in)[r * E + e] * f64(in)[r * E + e];
    double rs = 1.0 / std::sqrt(ss / static_cast<double>(E) + eps);
    f64(rstd)[r] = rs;
    for (int64_t e = 0; e < E; ++e) f64(out)[r * E + e] = f64(in)[r * E + e] * rs * f64(weight)[e];
  }
}

// y = x * r * w with r = (mean(x^2) + eps)^-1/2:
// dx = r * (w*dy) - x * r^3 / E * sum(w*dy*x);  dw += dy * x * r.
void RefOps::rmsnorm_backward(Tensor din, Tensor dweight, Tensor dout, Tensor in, Tensor weight, Tensor rstd) {
  auto [R, E] = check_rmsnorm("[rmsnorm_backward]", dout, rstd, in, weight, kAct);
  check_elementwise("[rmsnorm_backward]", {&din, &in}, kAct);
  if (dweight.data) check_same_shape("[rmsnorm_backward]", "dweight", dweight, "weight", weight);
  for (int64_t r = 0; r < R; ++r) {
    const double* x = f64(in) + r * E;
    const double* dy = f64(dout) + r * E;
    double rs = f64(rstd)[r], dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += dy[e] * f64(weight)[e] * x[e];
    for (int64_t e = 0; e < E; ++e) {
      double dx = rs * dy[e] * f64(weight)[e] - x[e] * rs * rs * rs * dot / static_cast<double>(E);
      if (dweight.data) f64(dweight)[e] += dy[e] * x[e] * rs;
      f64(din)[r * E + e] = dx;
    }
  }
}

const char* rope_scaling_name(RopeScaling s) {
  switch (s) {
    case RopeScaling::none: return "default";
    case RopeScaling::linear: return "linear";
    case RopeScaling::llama3: return "llama3";
    case RopeScaling::yarn: return "yarn";
  }
  return "?";
}

namespace {
// Rotates pairs (x[i], x[i + D/2]) by +angle (forward) or -angle (backward), scaled by attention_factor
// (the transpose of the forward map is the backward's, the factor included).
void ref_rope(const char* op, Tensor out, Tensor in, Tensor pos, const RopeConfig& cfg, double sign) {
  auto [T, H, D] = check_rope(op, out, in, pos, kAct);
  std::vector<double> inv(D / 2);
  rope_inv_freq(inv.data(), D, cfg);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < D / 2; ++i) {
        double ang = static_cast<double>(i32(pos)[t]) * inv[i];
        double c = cfg.attention_factor * std::cos(ang), s = sign * cfg.attention_factor * std::sin(ang);
        int64_t base = (t * H + h) * D;
        double x1 = f64(in)[base + i], x2 = f64(in)[base + i + D / 2];
        f64(out)[base + i] = x1 * c - x2 * s;
        f64(out)[base + i + D / 2] = x2 * c + x1 * s;
      }
}
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
}  // namespace

void RefOps::rope_forward(Tensor out, Tensor in, Tensor pos, const RopeConfig& cfg) {
  ref_rope("[rope]", out, in, pos, cfg, 1.0);
}
void RefOps::rope_backward(Tensor din, Tensor dout, Tensor pos, const RopeConfig& cfg) {
  ref_rope("[rope_backward]", din, dout, pos, cfg, -1.0);
}

void RefOps::swiglu_forward(Tensor out, Tensor gate, Tensor up) {
  check_elementwise("[swiglu]", {&out, &gate, &up}, kAct);
  for (int64_t i = 0; i < out.numel(); ++i) {
    double g = f64(gate)[i];
    f64(out)[i] = g * sigmoid(g) * f64(up)[i];
  }
}

void RefOps::swiglu_backward(Tensor dgate, Tensor dup, Tensor dout, Tensor gate, Tensor up) {
  check_elementwise("[swiglu_backward]", {&dgate, &dup, &dout, &gate, &up}, kAct);
  for (int64_t i = 0; i < dout.numel(); ++i) {
    double g = f64(gate)[i], s = sigmoid(g), dy = f64(dout)[i];
    f64(dup)[i] = dy * g * s;
    f64(dgate)[i] = dy * f64(up)[i] * s * (1.0 + g * (1.0 - s));
  }
}

void RefOps::add(Tensor out, Tensor a, Tensor b) {
  check_elementwise("[add]", {&out, &a, &b}, kAct);
  for (int64_t i = 0; i < out.numel(); ++i) f64(out)[i] = f64(a)[i] + f64(b)[i];
}

void RefOps::axpy(Tensor y, double alpha, Tensor x) {
  check_elementwise("[axpy]", {&y, &x}, kAct);
  for (int64_t i = 0; i < y.numel(); ++i) f64(y)[i] += alpha * f64(x)[i];
}

void RefOps::scale(Tensor x, double alpha) {
  check_elementwise("[scale]", {&x}, kAct);
  for (int64_t i = 0; i < x.numel(); ++i) f64(x)[i] *= alpha;
}

void RefOps::row_norms(Tensor out, Tensor w) {
  auto [N, K] = check_row_norms("[row_norms]", out, w, kAct);
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t j = 0; j < N; ++j) {
    if (w.quant) w.quant->dequant_row(*w.quant, w.qrow0 + j, 0, K, row.data());
    double s = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = w.quant ? row[static_cast<size_t>(k)] : f64(w)[j * K + k];
      s += v * v;
    }
    f64(out)[j] = std::sqrt(s);
  }
}

void RefOps::dora_scale(Tensor g, Tensor n, Tensor m, Tensor wn, Tensor b, Tensor p, Tensor q, double s) {
  auto [N, r] = check_dora_scale("[dora_scale]", g, n, m, wn, b, p, q, kAct);
  for (int64_t j = 0; j < N; ++j) {
    double sq = f64(wn)[j] * f64(wn)[j];
    for (int64_t i = 0; i < r; ++i)
      sq += 2 * s * f64(b)[j * r + i] * f64(p)[i * N + j] + s * s * f64(b)[j * r + i] * f64(q)[j * r + i];
    f64(n)[j] = std::sqrt(std::max(0.0, sq));
    f64(g)[j] = f64(m)[j] / f64(n)[j];
  }
}

void RefOps::dora_forward(Tensor y, Tensor z, Tensor g, Tensor bias) {
  auto [T, N] = check_dora_forward("[dora_forward]", y, z, g, bias, kAct);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < N; ++j) {
      const double v = f64(y)[t * N + j];
      if (z.data) f64(z)[t * N + j] = v;
      f64(y)[t * N + j] = f64(g)[j] * v + (bias.data ? f64(bias)[j] : 0.0);
    }
}

void RefOps::dora_backward(Tensor dz, Tensor dm, Tensor dy, Tensor z, Tensor g, Tensor n) {
  auto [T, N] = check_dora_backward("[dora_backward]", dz, dm, dy, z, g, n, kAct);
  for (int64_t j = 0; j < N; ++j) {
    double s = 0;
    for (int64_t t = 0; t < T; ++t) s += f64(dy)[t * N + j] * f64(z)[t * N + j];
    f64(dm)[j] += s / f64(n)[j];
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < N; ++j) f64(dz)[t * N + j] = f64(g)[j] * f64(dy)[t * N + j];
}

void RefOps::scale_rows(Tensor x, Tensor g) {
  auto [N, K] = check_scale_rows("[scale_rows]", x, g, kAct);
  for (int64_t j = 0; j < N; ++j)
    for (int64_t k = 0; k < K; ++k) f64(x)[j * K + k] *= f64(g)[j];
}

void RefOps::dropout(Tensor out, Tensor in, double p, uint64_t seed, int64_t offset, bool accumulate) {
  check_dropout("[dropout]", out, in, p, kAct);
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double v = dropout_keep(seed, offset + i, p) ? f64(in)[i] / (1.0 - p) : 0.0;
    f64(out)[i] = accumulate ? f64(out)[i] + v : v;
  }
}

void RefOps::fill(Tensor x, double value) {
  check_elementwise("[fill]", {&x}, kAct);
  for (int64_t i = 0; i < x.numel(); ++i) f64(x)[i] = value;
}

double RefOps::sum_squares(Tensor x) {
  check_elementwise("[sum_squares]", {&x}, kAct);
  double s = 0;
  for (int64_t i = 0; i < x.numel(); ++i) s += f64(x)[i] * f64(x)[i];
  return s;
}

double RefOps::abs_max(Tensor x) {
  check_elementwise("[abs_max]", {&x}, kAct);
  double m = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double a = std::fabs(f64(x)[i]);
    if (!std::isfinite(a)) return NAN;
    m = std::max(m, a);
  }
  return m;
}

void RefOps::convert(Tensor dst, Tensor src) {
  OOM_CHECK(dst.numel() == src.numel(), "[convert] dst ", dst.str(), " and src ", src.str(), " differ in size");
  oomless::convert(dst.data, dst.dtype, src.data, src.dtype, src.numel());
}

CastStats RefOps::cast_scaled(Tensor dst, Tensor src, double scale) {
  OOM_CHECK(dst.numel() == src.numel(), "[cast_scaled] dst ", dst.str(), " and src ", src.str(), " differ in size");
  OOM_CHECK(src.dtype == kAct, "[cast_scaled] src must be f64, got ", src.str());
  const DType dt = dst.dtype;
  OOM_CHECK(dt == DType::bf16 || dt == DType::f8_e4m3 || dt == DType::f8_e5m2,
            "[cast_scaled] dst must be bf16, f8_e4m3 or f8_e5m2, got ", dst.str());
  CastStats r;
  bool finite = true;
  const size_t w = static_cast<size_t>(dtype_bytes(dt, 1));
  for (int64_t i = 0; i < src.numel(); ++i) {
    const double x = f64(src)[i], y = x * scale;
    void* d = static_cast<char*>(dst.data) + static_cast<size_t>(i) * w;
    oomless::convert(d, dt, &y, DType::f64, 1);
    double v = 0;
    oomless::convert(&v, DType::f64, d, dt, 1);
    finite &= std::isfinite(x);
    r.amax = std::max(r.amax, std::fabs(x));
    r.saturated += dt == DType::f8_e4m3 ? std::fabs(y) > 464.0 : std::isinf(v) && std::isfinite(y);
    r.flushed += x != 0.0 && v == 0.0;
  }
  if (!finite) r.amax = NAN;
  return r;
}

void RefOps::cast_rows_scaled(Tensor dst, Tensor scales, Tensor src) {
  const auto [N, K] = check_cast_rows("[cast_rows_scaled]", dst, scales, src, kAct);
  const bool e4m3 = dst.dtype == DType::f8_e4m3;
  const double qmax = e4m3 ? 448.0 : 127.0;
  for (int64_t n = 0; n < N; ++n) {
    const double* x = f64(src) + n * K;
    double amax = 0;
    for (int64_t k = 0; k < K; ++k) amax = std::isnan(x[k]) || std::isnan(amax) ? NAN : std::max(amax, std::fabs(x[k]));
    const double s = amax / qmax, inv = s == 0.0 ? 0.0 : 1.0 / s;
    f64(scales)[n] = s;
    for (int64_t k = 0; k < K; ++k) {
      const double y = x[k] * inv;
      if (e4m3) {
        oomless::convert(static_cast<uint8_t*>(dst.data) + n * K + k, DType::f8_e4m3, &y, DType::f64, 1);
      } else {
        static_cast<int8_t*>(dst.data)[n * K + k] =
            std::isfinite(y) ? static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.0, 127.0)) : int8_t{0};
      }
    }
  }
}

void RefOps::adamw_step(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamWConfig& cfg) {
  check_adamw(param, grad, m, v, cfg, kAct);
  double bc1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(cfg.step));
  double bc2 = 1.0 - std::pow(cfg.beta2, static_cast<double>(cfg.step));
  for (int64_t i = 0; i < param.numel(); ++i) {
    double g = f64(grad)[i];
    f64(m)[i] = cfg.beta1 * f64(m)[i] + (1.0 - cfg.beta1) * g;
    f64(v)[i] = cfg.beta2 * f64(v)[i] + (1.0 - cfg.beta2) * g * g;
    double mh = f64(m)[i] / bc1, vh = f64(v)[i] / bc2;
    const double update = mh / (std::sqrt(vh) + cfg.eps);
    if (cfg.decay_after_update)
      f64(param)[i] = (f64(param)[i] - cfg.lr * update) * (1.0 - cfg.lr * cfg.weight_decay);
    else
      f64(param)[i] -= cfg.lr * (update + cfg.weight_decay * f64(param)[i]);
  }
}

namespace {

// dynamic8.h's quantiser in float64 (the grid index from the scaled value, the code from the map's lookup).
double encode_block_f64(const dyn8::Map& map, const double* x, int64_t n, uint8_t* codes) {
  double b = 0.0;
  for (int64_t i = 0; i < n; ++i)
    if (b < std::fabs(x[i])) b = std::fabs(x[i]);
  for (int64_t i = 0; i < n; ++i) codes[i] = b == 0.0 ? 0 : map.code(static_cast<float>(x[i] / b));
  return b;
}

}  // namespace

void RefOps::adamw8bit_step(Tensor param, Tensor grad, Tensor m_codes, Tensor m_absmax, Tensor v_codes,
                            Tensor v_absmax, const AdamWConfig& cfg) {
  check_adamw8bit(param, grad, m_codes, m_absmax, v_codes, v_absmax, cfg, kAct);
  const double bc1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(cfg.step));
  const double bc2 = 1.0 - std::pow(cfg.beta2, static_cast<double>(cfg.step));
  const dyn8::Map& sm = dyn8::signed_map();
  const dyn8::Map& um = dyn8::unsigned_map();
  uint8_t* mc = static_cast<uint8_t*>(m_codes.data);
  uint8_t* vc = static_cast<uint8_t*>(v_codes.data);
  const int64_t n = param.numel();
  std::vector<double> m(kAdam8Block), v(kAdam8Block);
  for (int64_t i0 = 0, b = 0; i0 < n; i0 += kAdam8Block, ++b) {
    const int64_t len = std::min(n - i0, kAdam8Block);
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = i0 + k;
      const double g = f64(grad)[i];
      if (!std::isfinite(g)) {
        m[k] = v[k] = 0.0;
        continue;
      }
      m[k] = cfg.beta1 * sm.values()[mc[i]] * f64(m_absmax)[b] + (1.0 - cfg.beta1) * g;
      v[k] = cfg.beta2 * um.values()[vc[i]] * f64(v_absmax)[b] + (1.0 - cfg.beta2) * g * g;
      const double update = (m[k] / bc1) / (std::sqrt(v[k] / bc2) + cfg.eps);
      f64(param)[i] = (f64(param)[i] - cfg.lr * update) * (1.0 - cfg.lr * cfg.weight_decay);
    }
    f64(m_absmax)[b] = encode_block_f64(sm, m.data(), len, mc + i0);
    f64(v_absmax)[b] = encode_block_f64(um, v.data(), len, vc + i0);
  }
}

void RefOps::svd_basis(Tensor out, Tensor g, bool right) {
  check_svd_basis(out, g, right, kAct);
  const int64_t m = g.dims[0], n = g.dims[1];
  std::vector<double> work((lapack::svd_workspace(m, n, sizeof(double)) + 7) / 8);
  lapack::svd_basis(f64(g), m, n, right ? out.dims[0] : out.dims[1], right, f64(out), work.data());
}

}  // namespace oomless
