// Fused LM head + cross-entropy on the CPU, never holding a (T, V) logits buffer.
//
// The vocabulary is cut into chunks of Vc columns and the tokens into chunks of Tc rows. For each
// (vocab chunk, token chunk) one GEMM gives the logits tile (Tc, Vc) = h_chunk . w_chunk^T; the rest is
// row-wise work on that tile, rows spread over OpenMP threads with a static schedule.
//
// Forward keeps, per row, a running maximum m and a running sum s = sum exp(logit - m) (online
// log-sum-exp): a tile with maximum c updates m' = max(m, c), s' = s exp(m - m') + sum exp(x - m').
// The target's logit is picked up from the tile that holds it. lse = m + log s, loss_t = lse - logit_target.
//
// Backward recomputes each tile (same GEMM shapes as the forward, so the same logits), turns it in place
// into dlogits = grad_scale (exp(logit - lse) - onehot(target)) (0 on ignored rows), then
//   dh_chunk (Tc, E) = / += dlogits . w_chunk     (the first vocab chunk overwrites)
//   dw_chunk (Vc, E) += dlogits^T . h_chunk
// The second product reads dlogits as a transposed operand; the GEMM transposes while packing.
//
// Fused (training with a frozen head, grad_scale known before the forward): the logits are computed once.
// Beside the forward's running max m and sum l, each row keeps l_x, the sum without the target's term, and
// its dh row accumulates, flash-attention style, acc = sum over chunks of P . w_chunk with P = exp(logit - m)
// (the target's entry zeroed), rescaled by exp(m_old - m_new) whenever the running max grows. At the end
//   dh = grad_scale (acc / l - (l_x / l) w_target),
// since sum_v p_v w_v - w_t = sum_{v != t} p_v w_v - (1 - p_t) w_t and 1 - p_t = l_x / l. Taking 1 - p_t
// from l_x rather than as 1 - exp(logit_t - lse) keeps its relative precision when p_t is close to 1. Two
// GEMMs per (vocabulary chunk, token chunk) instead of the forward's one and the backward's two; lse and
// the loss are the forward's bits.
//
// Trained (training with a trainable head, grad_scale known before the forward): the logits of a block of Tb
// tokens over the whole vocabulary are kept (the store, Tb x V floats), so that each is computed once. For each
// block: pass A computes the logits tiles (Tb, Vc) into the store, vocabulary chunk by chunk, and updates each
// row's running max and sum as the forward does (on a copy of the row's chunk: exp_shift_sum works in place);
// the rows' lse and losses follow. Pass B turns the store into dlogits as the backward does and takes
//   dh_block (Tb, E) = / += dlogits_chunk . w_chunk,   dw_chunk (Vc, E) += dlogits_chunk^T . h_block
// per chunk. Three GEMMs per (vocabulary chunk, token block) instead of the forward's one and the backward's
// three. Tb is the forward's Tc when Tc rows of the store fit kStoreBytes: every product then has the
// forward's and backward's shapes and every output is theirs bit for bit (the products' sums run over E or
// over the vocabulary chunk in the same order; dw's terms come in the same token-chunk order). Otherwise Tb
// is as many rows as fit (a multiple of 16): lse, the loss and dh are still theirs bit for bit, dw sums over
// other token chunks (within fp32 rounding); with fewer than kMinStoreRows rows the call is the forward then
// the backward.
//
// Scratch, one workspace allocation per call; it does not grow with V, and with T only through the
// forward's 16 bytes of row state. The sizes are measured choices (a 2-core AVX2 machine, E = 576,
// V = 49152: tiles from 4 to 32 MiB and Vc from 1024 to 8192 were within noise of each other, the
// smallest ones a little slower):
//   logits tile       Tc * Vc * 4 bytes   <= kTileBytes (8 MiB)
//   w chunk in f32    Vc * E * 4 bytes    <= kWChunkBytes (16 MiB) unless E > 16384, only when w is bf16
//                                            or quantised under fp32 compute (widened or dequantised once
//                                            per vocab chunk: the GEMMs stay f32)
//   bf16 operands     T * E * 2 + Tc * Vc * 2 bytes, only under bf16 compute (w read as bf16): h and the
//                                            (d)logits tile rounded, so every GEMM takes bf16 operands
//   row state         T * 16 bytes        forward only (running max, running sum, target logit)
// so at most 28 MiB + 18 T + 2 T E bytes, plus the GEMM scratchpads that Gemm charges to the same arena.
// The trained form holds instead its store (Tb * V * 4 bytes <= kStoreBytes, 64 MiB), a chunk of a row per
// thread, Tb rows of state, and under bf16 compute h and one dlogits chunk in bf16.
//
// Determinism: chunk sizes depend on (T, E, V) only; each row is handled by one thread; per-row sums use
// a fixed lane pattern; partial results across tiles combine in loop order; the loss is summed over
// rows sequentially in double. Results are bitwise identical for any thread count provided the GEMMs are.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "backend/checks.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/exp_f32.h"
#include "backend/cpu/gemm.h"
#include "core/clones.h"

namespace oomless {

namespace {
constexpr DType kAct = DType::f32;
constexpr const char* kOp = "[cross_entropy]";
constexpr int64_t kMaxVocabChunk = 4096;
constexpr int64_t kMinVocabChunk = 256;
constexpr int64_t kWChunkBytes = int64_t{16} << 20;
constexpr int64_t kTileBytes = int64_t{8} << 20;
constexpr int kLanes = 8;        // fixed summation lanes of the per-row exp sums
constexpr int64_t kStoreBytes = int64_t{64} << 20;  // the trained form's logits rows
constexpr int64_t kMinStoreRows = 64;

struct Plan {
  int64_t Vc, Tc;
};

// Vc: as wide as kMaxVocabChunk while an f32 copy of the w chunk stays within kWChunkBytes (a multiple
// of 64 columns); Tc: as many rows as keep the logits tile within kTileBytes.
Plan plan_for(int64_t T, int64_t E, int64_t V) {
  int64_t vc = std::clamp(kWChunkBytes / (4 * std::max<int64_t>(E, 1)), kMinVocabChunk, kMaxVocabChunk);
  vc = std::min(vc / 64 * 64, V);
  int64_t tc = std::clamp(kTileBytes / (4 * std::max<int64_t>(vc, 1)), int64_t{1}, std::max<int64_t>(T, 1));
  return {vc, tc};
}

// The trained form's token block: Tc when Tc rows of V logits fit kStoreBytes, else the multiple of 16 rows that
// fit; 0 (the forward then the backward) when fewer than kMinStoreRows do.
int64_t store_rows(const Plan& pl, int64_t T, int64_t V) {
  const int64_t fit = kStoreBytes / (4 * std::max<int64_t>(V, 1));
  if (pl.Tc <= fit) return pl.Tc;
  const int64_t r = fit / 16 * 16;
  return r >= kMinStoreRows ? std::min(r, T) : 0;
}

// n rounded up to a multiple of 16 elements, so that every scratch region starts 64-byte aligned.
size_t padded(int64_t n) { return static_cast<size_t>((n + 15) / 16 * 16); }

using CeCall = Ops::CeCall;

// Bytes of the one scratch allocation of a call (the layouts are carved in the calls below): the logits tile,
// the widened w chunk, h in bf16, the tile in bf16, the fused form's per-thread target rows, and the row state.
size_t scratch_bytes(CeCall call, int64_t T, int64_t E, int64_t V, bool bf16, bool widen) {
  const Plan pl = plan_for(T, E, V);
  if (call == CeCall::trained) {
    const int64_t tb = store_rows(pl, T, V);
    if (tb == 0)  // the forward, then the backward
      return std::max(scratch_bytes(CeCall::forward, T, E, V, bf16, widen),
                      scratch_bytes(CeCall::backward, T, E, V, bf16, widen));
    const size_t store_n = padded(tb * V), wc_n = widen ? padded(pl.Vc * E) : 0, hb_n = bf16 ? padded(T * E) / 2 : 0;
    const size_t tbf_n = bf16 ? padded(tb * pl.Vc) / 2 : 0, rows_n = padded(omp_get_max_threads() * pl.Vc);
    return 4 * (store_n + wc_n + hb_n + tbf_n + rows_n) + 16 * padded(tb);
  }
  const size_t tile_n = padded(pl.Tc * pl.Vc), wc_n = widen ? padded(pl.Vc * E) : 0;
  const size_t hb_n = bf16 ? padded(T * E) / 2 : 0, tb_n = bf16 && call != CeCall::forward ? tile_n / 2 : 0;
  const size_t row_n = call == CeCall::fused ? padded(omp_get_max_threads() * E) : 0;
  const size_t state = call == CeCall::forward ? 16 * padded(T) : call == CeCall::fused ? 24 * padded(T) : 0;
  return 4 * (tile_n + wc_n + hb_n + tb_n + row_n) + state;
}

// The maximum of x[0, n), taken over the order-preserving integer image of the floats: an integer max
// vectorises where a float one does not (see exp_f32). A NaN need not win here; exp_f32 passes it on.
inline int32_t order_key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); }  // an involution

OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
float row_max(const float* x, int64_t n) {
  int32_t m = order_key(std::bit_cast<int32_t>(-std::numeric_limits<float>::infinity()));
  for (int64_t j = 0; j < n; ++j) {
    const int32_t k = order_key(std::bit_cast<int32_t>(x[j]));
    m = k > m ? k : m;
  }
  return std::bit_cast<float>(order_key(m));
}

// x[j] = exp(x[j] - shift) in place; returns their sum in double over kLanes fixed lanes.
OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
double exp_shift_sum(float* x, int64_t n, float shift) {
  for (int64_t j = 0; j < n; ++j) x[j] = exp_f32(x[j] - shift);
  double lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k) lane[k] += x[j + k];
  for (int k = 0; j < n; ++j, ++k) lane[k] += x[j];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// x[j] = gs exp(x[j] - l) in place: a row of dlogits before its target's term.
OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
void scaled_exp_row(float* x, int64_t n, float gs, float l) {
  for (int64_t j = 0; j < n; ++j) x[j] = gs * exp_f32(x[j] - l);
}

// The f32 rows [v0, v0 + nv) of w: a pointer into w when it is f32, else widened (bf16), rounded (f32
// read as bf16) or dequantised (block-quantised) into `dst`.
const float* w_chunk(const Tensor& w, int64_t v0, int64_t nv, int64_t E, float* dst) {
  if (w.quant) {  // block-quantised: each row dequantised (then bf16-rounded when read as bf16)
    const QuantMatrix* q = w.quant;
    const int64_t q0 = w.qrow0;
    const bool r = w.as_bf16;
#pragma omp parallel for schedule(static)
    for (int64_t v = 0; v < nv; ++v) {
      q->dequant_row(*q, q0 + v0 + v, 0, E, dst + v * E);
      if (r)
        for (int64_t e = 0; e < E; ++e) dst[v * E + e] = round_to_bf16(dst[v * E + e]);
    }
    return dst;
  }
  if (w.dtype == DType::f32 && !w.as_bf16) return static_cast<const float*>(w.data) + v0 * E;
  if (w.as_bf16) {
    const float* src = static_cast<const float*>(w.data) + v0 * E;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nv * E; ++i) dst[i] = round_to_bf16(src[i]);
    return dst;
  }
  const uint16_t* src = static_cast<const uint16_t*>(w.data) + v0 * E;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < nv * E; ++i) dst[i] = bf16_to_f32(src[i]);
  return dst;
}

// bf16 compute (the head read as bf16, Tensor::as_bf16): every GEMM takes bf16 operands, as the model's other
// products do. h, and each (d)logits or P tile before it is a GEMM operand, are rounded to bf16 once; w is
// read by the GEMM's packing as it is stored (f32 rounded, bf16, or dequantised then rounded), with no f32
// chunk. On the amx path these GEMMs run on tiles.
bool bf16_operands(const Tensor& w) { return w.as_bf16; }

void round_rows(uint16_t* dst, const float* src, int64_t n) {
  constexpr int64_t kChunk = 1 << 14;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < (n + kChunk - 1) / kChunk; ++c)
    convert(dst + c * kChunk, DType::bf16, src + c * kChunk, DType::f32, std::min(kChunk, n - c * kChunk));
}

// c (M, N) (+)= a (M, K) . op(rows [v0, ..) of w): the logits (tb: a = h, N = nv, K = E) or dh (a = the
// dlogits or P tile, N = E, K = nv). f32: wv holds the chunk's rows (w_chunk); bf16: a is bf16 and w is read
// in place.
void gemm_w(Gemm& g, const Tensor& w, bool bf16, int64_t v0, const float* wv, const void* a, float* c, int64_t M,
            int64_t N, int64_t K, bool tb, bool acc, int64_t E, int64_t lda = 0, int64_t ldc = 0) {
  GemmShape s;
  s.M = M, s.N = N, s.K = K, s.tb = tb, s.accumulate = acc, s.lda = lda, s.ldc = ldc;
  if (!bf16) return g.run(s, a, wv, c);
  s.ab = DType::bf16;
  if (w.quant) {
    s.b_quant = w.quant, s.b_qrow0 = w.qrow0 + v0, s.b_as_bf16 = true, s.ldb = E;
    return g.run(s, a, nullptr, c);
  }
  if (w.dtype == DType::bf16) return g.run(s, a, static_cast<const uint16_t*>(w.data) + v0 * E, c);
  s.b_as_bf16 = true;
  g.run(s, a, static_cast<const float*>(w.data) + v0 * E, c);
}

int64_t supervised_rows(const int32_t* tg, int64_t T, int32_t ignore_index) {
  int64_t n = 0;
  for (int64_t t = 0; t < T; ++t) n += tg[t] != ignore_index;
  return n;
}
// One row's step of the online log-sum-exp over a logits chunk x (nv; the target at column jt, or -1): picks
// up the target's logit, turns x into exp(x - m') in place with m' the new running max, and updates the
// running max and sum. Returns the chunk's sum and the factor exp(m - m') that rescaled the old sum.
struct RowStep {
  double cs, alpha;
};
RowStep online_row(float* x, int64_t nv, int64_t jt, float* rmax, double* rsum, float* tlogit) {
  if (jt >= 0) *tlogit = x[jt];
  const float m = std::max(*rmax, row_max(x, nv));
  const double cs = exp_shift_sum(x, nv, m);
  const double alpha = std::exp(static_cast<double>(*rmax) - static_cast<double>(m));
  *rsum = *rsum * alpha + cs;
  *rmax = m;
  return {cs, alpha};
}

// lse = m + log l per supervised row (0 elsewhere) and the loss, summed over rows in order in double (rows
// [0, T) of tg, lp and the row state; callers add an offset for a block of rows).
void finish_loss(int64_t T, const int32_t* tg, int32_t ignore_index, const float* rmax, const double* rsum,
                 const float* tlogit, float* lp, CeResult* res) {
  for (int64_t t = 0; t < T; ++t) {
    if (tg[t] == ignore_index) {
      lp[t] = 0.0f;
      continue;
    }
    const double l = static_cast<double>(rmax[t]) + std::log(rsum[t]);
    lp[t] = static_cast<float>(l);
    res->loss_sum += l - static_cast<double>(tlogit[t]);
  }
}
}  // namespace

std::vector<double> CpuOps::target_logits(Tensor h, Tensor w, Tensor targets, int32_t ignore_index) {
  const CeDims d = check_head_rows("[target_logits]", h, w, targets, ignore_index, kAct);
  check_targets("[target_logits]", static_cast<const int32_t*>(targets.data), targets.dims[0], w.dims[0], ignore_index);
  const int64_t T = d.T, E = d.E;
  const float* hp = static_cast<const float*>(h.data);
  const int32_t* tg = static_cast<const int32_t*>(targets.data);
  std::vector<double> out(static_cast<size_t>(T), 0.0);
#pragma omp parallel if (T * E >= kParallelMin)
  {
    std::vector<float> row(static_cast<size_t>(E));  // the target's row of w as the head reads it
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      if (tg[t] == ignore_index) continue;
      if (w.quant)
        w.quant->dequant_row(*w.quant, w.qrow0 + tg[t], 0, E, row.data());
      else
        oomless::convert(row.data(), DType::f32, static_cast<const char*>(w.data) + dtype_bytes(w.dtype, tg[t] * E),
                         w.dtype, E);
      double dot = 0;
      if (bf16_operands(w)) {  // both operands rounded, as the head's bf16 products take them
        for (int64_t e = 0; e < E; ++e)
          dot += static_cast<double>(round_to_bf16(hp[t * E + e])) * round_to_bf16(row[static_cast<size_t>(e)]);
      } else {
        for (int64_t e = 0; e < E; ++e) dot += static_cast<double>(hp[t * E + e]) * row[static_cast<size_t>(e)];
      }
      out[static_cast<size_t>(t)] = dot;
    }
  }
  return out;
}

CeResult CpuOps::linear_cross_entropy_forward(Tensor lse, Tensor h, Tensor w, Tensor targets, int32_t ignore_index) {
  auto [T_, E_, V_] = check_cross_entropy_host(kOp, lse, h, w, targets, ignore_index, kAct);
  // Copies: clang before 16 cannot capture structured bindings in lambdas / OpenMP regions.
  const int64_t T = T_, E = E_, V = V_;
  const float* hp = static_cast<const float*>(h.data);
  const int32_t* tg = static_cast<const int32_t*>(targets.data);
  float* lp = static_cast<float*>(lse.data);
  CeResult res;
  res.count = supervised_rows(tg, T, ignore_index);
  if (res.count == 0) {
    std::fill(lp, lp + T, 0.0f);
    return res;
  }
  const Plan pl = plan_for(T, E, V);
  const bool bf16 = bf16_operands(w);
  const bool widen = !bf16 && (w.dtype == DType::bf16 || w.as_bf16 || w.quant);
  const size_t tile_n = padded(pl.Tc * pl.Vc), wc_n = widen ? padded(pl.Vc * E) : 0, hb_n = bf16 ? padded(T * E) / 2 : 0;
  Buffer buf = scratch(scratch_bytes(CeCall::forward, T, E, V, bf16, widen), "cross_entropy");
  float* tile = buf.as<float>();                                 // (Tc, Vc)
  float* wc = tile + tile_n;                                     // (Vc, E) when w is bf16 or quantised (f32 GEMMs)
  uint16_t* hb = reinterpret_cast<uint16_t*>(wc + wc_n);        // (T, E) h in bf16 (bf16 GEMMs)
  float* rmax = wc + wc_n + hb_n;                                // (T) running max
  double* rsum = reinterpret_cast<double*>(rmax + padded(T));    // (T) running sum of exp(logit - rmax)
  float* tlogit = reinterpret_cast<float*>(rsum + padded(T));    // (T) the target's logit
  for (int64_t t = 0; t < T; ++t) {
    rsum[t] = 0.0;
    rmax[t] = -std::numeric_limits<float>::infinity();
    tlogit[t] = 0.0f;
  }
  if (bf16) round_rows(hb, hp, T * E);

  for (int64_t v0 = 0; v0 < V; v0 += pl.Vc) {
    const int64_t nv = std::min(pl.Vc, V - v0);
    const float* wv = bf16 ? nullptr : w_chunk(w, v0, nv, E, wc);
    for (int64_t t0 = 0; t0 < T; t0 += pl.Tc) {
      const int64_t nt = std::min(pl.Tc, T - t0);
      gemm_w(gemm(), w, bf16, v0, wv, bf16 ? static_cast<const void*>(hb + t0 * E) : hp + t0 * E, tile, nt, nv, E,
             true, false, E);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = t0 + i;
        if (tg[t] == ignore_index) continue;
        float* x = tile + i * nv;
        online_row(x, nv, tg[t] >= v0 && tg[t] < v0 + nv ? tg[t] - v0 : -1, &rmax[t], &rsum[t], &tlogit[t]);
      }
    }
  }

  finish_loss(T, tg, ignore_index, rmax, rsum, tlogit, lp, &res);
  return res;
}

void CpuOps::linear_cross_entropy_backward(Tensor dh, Tensor dw, Tensor h, Tensor w, Tensor targets, Tensor lse,
                                           int32_t ignore_index, double grad_scale) {
  const CeDims dims = check_cross_entropy_host(kOp, lse, h, w, targets, ignore_index, kAct);
  check_cross_entropy_backward(kOp, dims, dh, dw, kAct);
  auto [T_, E_, V_] = dims;
  // Copies: clang before 16 cannot capture structured bindings in lambdas / OpenMP regions.
  const int64_t T = T_, E = E_, V = V_;
  const float* hp = static_cast<const float*>(h.data);
  const int32_t* tg = static_cast<const int32_t*>(targets.data);
  const float* lp = static_cast<const float*>(lse.data);
  float* dhp = static_cast<float*>(dh.data);
  float* dwp = static_cast<float*>(dw.data);
  if (supervised_rows(tg, T, ignore_index) == 0) {  // every dlogit is 0: dh = 0, dw unchanged
    std::fill(dhp, dhp + T * E, 0.0f);
    return;
  }
  const Plan pl = plan_for(T, E, V);
  const bool bf16 = bf16_operands(w);
  const bool widen = !bf16 && (w.dtype == DType::bf16 || w.as_bf16 || w.quant);
  const size_t tile_n = padded(pl.Tc * pl.Vc), wc_n = widen ? padded(pl.Vc * E) : 0;
  const size_t hb_n = bf16 ? padded(T * E) / 2 : 0;
  Buffer buf = scratch(scratch_bytes(CeCall::backward, T, E, V, bf16, widen), "cross_entropy");
  float* tile = buf.as<float>();     // (Tc, Vc) logits, then dlogits in place
  float* wc = tile + tile_n;         // (Vc, E) when w is bf16 or quantised (f32 GEMMs)
  uint16_t* hb = reinterpret_cast<uint16_t*>(wc + wc_n);               // (T, E) h in bf16 (bf16 GEMMs)
  uint16_t* tb = reinterpret_cast<uint16_t*>(wc + wc_n + hb_n);        // (Tc, Vc) dlogits in bf16
  const float gs = static_cast<float>(grad_scale);
  if (bf16) round_rows(hb, hp, T * E);

  for (int64_t v0 = 0; v0 < V; v0 += pl.Vc) {
    const int64_t nv = std::min(pl.Vc, V - v0);
    const float* wv = bf16 ? nullptr : w_chunk(w, v0, nv, E, wc);
    for (int64_t t0 = 0; t0 < T; t0 += pl.Tc) {
      const int64_t nt = std::min(pl.Tc, T - t0);
      gemm_w(gemm(), w, bf16, v0, wv, bf16 ? static_cast<const void*>(hb + t0 * E) : hp + t0 * E, tile, nt, nv, E,
             true, false, E);
      // dlogits in place, row by row.
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = t0 + i;
        float* x = tile + i * nv;
        if (tg[t] == ignore_index) {
          std::memset(x, 0, static_cast<size_t>(nv) * sizeof(float));
          continue;
        }
        const float l = lp[t];
        const int64_t jt = tg[t] >= v0 && tg[t] < v0 + nv ? tg[t] - v0 : -1;
        const float pt = jt >= 0 ? exp_f32(x[jt] - l) : 0.0f;
        scaled_exp_row(x, nv, gs, l);
        if (jt >= 0) x[jt] = gs * (pt - 1.0f);
      }
      if (bf16) round_rows(tb, tile, nt * nv);
      // dh (nt, E) = / += dlogits (nt, nv) . wv (nv, E)
      gemm_w(gemm(), w, bf16, v0, wv, bf16 ? static_cast<const void*>(tb) : tile, dhp + t0 * E, nt, E, nv, false,
             v0 > 0, E);
      // dw (nv, E) += dlogits^T (nv, nt) . h (nt, E); the GEMM transposes dlogits while packing.
      if (dwp && bf16)
        gemm().run(GemmShape{.M = nv, .N = E, .K = nt, .ta = true, .ab = DType::bf16, .accumulate = true}, tb,
                   hb + t0 * E, dwp + v0 * E);
      else if (dwp)
        gemm().run(GemmShape{.M = nv, .N = E, .K = nt, .ta = true, .accumulate = true}, tile, hp + t0 * E, dwp + v0 * E);
    }
  }
}

CeResult CpuOps::linear_cross_entropy_fused(Tensor lse, Tensor dh, Tensor h, Tensor w, Tensor targets,
                                            int32_t ignore_index, double grad_scale) {
  const CeDims dims = check_cross_entropy_host(kOp, lse, h, w, targets, ignore_index, kAct);
  check_cross_entropy_backward(kOp, dims, dh, Tensor(), kAct);
  auto [T_, E_, V_] = dims;
  // Copies: clang before 16 cannot capture structured bindings in lambdas / OpenMP regions.
  const int64_t T = T_, E = E_, V = V_;
  const float* hp = static_cast<const float*>(h.data);
  const int32_t* tg = static_cast<const int32_t*>(targets.data);
  float* lp = static_cast<float*>(lse.data);
  float* dhp = static_cast<float*>(dh.data);
  CeResult res;
  res.count = supervised_rows(tg, T, ignore_index);
  if (res.count == 0) {  // every dlogit is 0
    std::fill(lp, lp + T, 0.0f);
    std::fill(dhp, dhp + T * E, 0.0f);
    return res;
  }
  const Plan pl = plan_for(T, E, V);
  const bool bf16 = bf16_operands(w);
  const bool widen = !bf16 && (w.dtype == DType::bf16 || w.as_bf16 || w.quant);
  const size_t tile_n = padded(pl.Tc * pl.Vc), wc_n = widen ? padded(pl.Vc * E) : 0;
  const size_t hb_n = bf16 ? padded(T * E) / 2 : 0, tb_n = bf16 ? tile_n / 2 : 0;
  Buffer buf = scratch(scratch_bytes(CeCall::fused, T, E, V, bf16, widen), "cross_entropy");
  float* tile = buf.as<float>();                                 // (Tc, Vc) logits, then P in place
  float* wc = tile + tile_n;                                     // (Vc, E) when w is bf16 or quantised (f32 GEMMs)
  uint16_t* hb = reinterpret_cast<uint16_t*>(wc + wc_n);        // (T, E) h in bf16 (bf16 GEMMs)
  uint16_t* tb = reinterpret_cast<uint16_t*>(wc + wc_n + hb_n); // (Tc, Vc) P in bf16
  float* wrow = wc + wc_n + hb_n + tb_n;                         // (threads, E) a target row of w
  float* rmax = wrow + padded(omp_get_max_threads() * E);       // (T) running max
  double* rsum = reinterpret_cast<double*>(rmax + padded(T));    // (T) running sum of exp(logit - rmax)
  double* rsum_x = rsum + padded(T);                             // (T) the same without the target's term
  float* tlogit = reinterpret_cast<float*>(rsum_x + padded(T));  // (T) the target's logit
  for (int64_t t = 0; t < T; ++t) {
    rsum[t] = rsum_x[t] = 0.0;
    rmax[t] = -std::numeric_limits<float>::infinity();
    tlogit[t] = 0.0f;
  }
  if (bf16) round_rows(hb, hp, T * E);

  for (int64_t v0 = 0; v0 < V; v0 += pl.Vc) {
    const int64_t nv = std::min(pl.Vc, V - v0);
    const float* wv = bf16 ? nullptr : w_chunk(w, v0, nv, E, wc);
    for (int64_t t0 = 0; t0 < T; t0 += pl.Tc) {
      const int64_t nt = std::min(pl.Tc, T - t0);
      gemm_w(gemm(), w, bf16, v0, wv, bf16 ? static_cast<const void*>(hb + t0 * E) : hp + t0 * E, tile, nt, nv, E,
             true, false, E);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = t0 + i;
        float* x = tile + i * nv;
        if (tg[t] == ignore_index) {  // contributes nothing; its dh row is 0 from the first chunk on
          std::memset(x, 0, static_cast<size_t>(nv) * sizeof(float));
          continue;
        }
        const int64_t jt = tg[t] >= v0 && tg[t] < v0 + nv ? tg[t] - v0 : -1;
        const auto [cs, alpha] = online_row(x, nv, jt, &rmax[t], &rsum[t], &tlogit[t]);
        const double pt = jt >= 0 ? static_cast<double>(x[jt]) : 0.0;
        if (jt >= 0) x[jt] = 0.0f;
        rsum_x[t] = rsum_x[t] * alpha + (cs - pt);
        if (v0 > 0 && alpha != 1.0) {
          float* d = dhp + t * E;
          const float a = static_cast<float>(alpha);
          for (int64_t e = 0; e < E; ++e) d[e] *= a;
        }
      }
      if (bf16) round_rows(tb, tile, nt * nv);
      // acc (nt, E) = / += P (nt, nv) . wv (nv, E)
      gemm_w(gemm(), w, bf16, v0, wv, bf16 ? static_cast<const void*>(tb) : tile, dhp + t0 * E, nt, E, nv, false,
             v0 > 0, E);
    }
  }

  const float* wf = w.quant || w.dtype != DType::f32 ? nullptr : static_cast<const float*>(w.data);
  const uint16_t* wb = w.dtype == DType::bf16 && !w.quant ? static_cast<const uint16_t*>(w.data) : nullptr;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* d = dhp + t * E;
    if (tg[t] == ignore_index) {
      std::memset(d, 0, static_cast<size_t>(E) * sizeof(float));
      continue;
    }
    // The target's row of w as the GEMMs read it (w_chunk's conversions, one row).
    float* r = wrow + static_cast<int64_t>(omp_get_thread_num()) * E;
    const float* wt = r;
    if (w.quant) {
      w.quant->dequant_row(*w.quant, w.qrow0 + tg[t], 0, E, r);
      if (w.as_bf16)
        for (int64_t e = 0; e < E; ++e) r[e] = round_to_bf16(r[e]);
    } else if (wb) {
      for (int64_t e = 0; e < E; ++e) r[e] = bf16_to_f32(wb[tg[t] * E + e]);
    } else if (w.as_bf16) {
      for (int64_t e = 0; e < E; ++e) r[e] = round_to_bf16(wf[tg[t] * E + e]);
    } else {
      wt = wf + tg[t] * E;
    }
    const float a = static_cast<float>(grad_scale / rsum[t]);
    const float b = static_cast<float>(grad_scale * rsum_x[t] / rsum[t]);
    for (int64_t e = 0; e < E; ++e) d[e] = a * d[e] - b * wt[e];
  }

  finish_loss(T, tg, ignore_index, rmax, rsum, tlogit, lp, &res);
  return res;
}

CeResult CpuOps::linear_cross_entropy_trained(Tensor lse, Tensor dh, Tensor dw, Tensor h, Tensor w, Tensor targets,
                                              int32_t ignore_index, double grad_scale) {
  const CeDims dims = check_cross_entropy_host(kOp, lse, h, w, targets, ignore_index, kAct);
  check_cross_entropy_backward(kOp, dims, dh, dw, kAct);
  auto [T_, E_, V_] = dims;
  // Copies: clang before 16 cannot capture structured bindings in lambdas / OpenMP regions.
  const int64_t T = T_, E = E_, V = V_;
  const Plan pl = plan_for(T, E, V);
  const int64_t Tb = store_rows(pl, T, V);
  if (Tb == 0 || !dw.data) return Ops::linear_cross_entropy_trained(lse, dh, dw, h, w, targets, ignore_index, grad_scale);
  const float* hp = static_cast<const float*>(h.data);
  const int32_t* tg = static_cast<const int32_t*>(targets.data);
  float* lp = static_cast<float*>(lse.data);
  float* dhp = static_cast<float*>(dh.data);
  float* dwp = static_cast<float*>(dw.data);
  CeResult res;
  res.count = supervised_rows(tg, T, ignore_index);
  if (res.count == 0) {  // as the forward and the backward: lse 0, dh 0, dw unchanged
    std::fill(lp, lp + T, 0.0f);
    std::fill(dhp, dhp + T * E, 0.0f);
    return res;
  }
  const bool bf16 = bf16_operands(w);
  const bool widen = !bf16 && (w.dtype == DType::bf16 || w.as_bf16 || w.quant);
  const size_t store_n = padded(Tb * V), wc_n = widen ? padded(pl.Vc * E) : 0, hb_n = bf16 ? padded(T * E) / 2 : 0;
  const size_t tbf_n = bf16 ? padded(Tb * pl.Vc) / 2 : 0;
  Buffer buf = scratch(scratch_bytes(CeCall::trained, T, E, V, bf16, widen), "cross_entropy");
  float* store = buf.as<float>();                                  // (Tb, V) logits, then dlogits in place
  float* wc = store + store_n;                                     // (Vc, E) when w is bf16 or quantised (f32 GEMMs)
  uint16_t* hb = reinterpret_cast<uint16_t*>(wc + wc_n);          // (T, E) h in bf16 (bf16 GEMMs)
  uint16_t* tbf = reinterpret_cast<uint16_t*>(wc + wc_n + hb_n);  // (Tb, Vc) a dlogits chunk in bf16
  float* rows = wc + wc_n + hb_n + tbf_n;                          // (threads, Vc) a row's chunk, exponentiated
  float* rmax = rows + padded(omp_get_max_threads() * pl.Vc);      // (Tb) running max
  double* rsum = reinterpret_cast<double*>(rmax + padded(Tb));     // (Tb) running sum of exp(logit - rmax)
  float* tlogit = reinterpret_cast<float*>(rsum + padded(Tb));     // (Tb) the target's logit
  const float gs = static_cast<float>(grad_scale);
  if (bf16) round_rows(hb, hp, T * E);

  for (int64_t t0 = 0; t0 < T; t0 += Tb) {
    const int64_t nt = std::min(Tb, T - t0);
    for (int64_t i = 0; i < nt; ++i) {
      rsum[i] = 0.0;
      rmax[i] = -std::numeric_limits<float>::infinity();
      tlogit[i] = 0.0f;
    }
    const void* ha = bf16 ? static_cast<const void*>(hb + t0 * E) : hp + t0 * E;
    // Pass A: the logits, and each row's running max and sum as the forward takes them.
    for (int64_t v0 = 0; v0 < V; v0 += pl.Vc) {
      const int64_t nv = std::min(pl.Vc, V - v0);
      const float* wv = bf16 ? nullptr : w_chunk(w, v0, nv, E, wc);
      gemm_w(gemm(), w, bf16, v0, wv, ha, store + v0, nt, nv, E, true, false, E, 0, V);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = t0 + i;
        if (tg[t] == ignore_index) continue;
        float* x = rows + static_cast<int64_t>(omp_get_thread_num()) * pl.Vc;
        std::memcpy(x, store + i * V + v0, sizeof(float) * static_cast<size_t>(nv));
        online_row(x, nv, tg[t] >= v0 && tg[t] < v0 + nv ? tg[t] - v0 : -1, &rmax[i], &rsum[i], &tlogit[i]);
      }
    }
    finish_loss(nt, tg + t0, ignore_index, rmax, rsum, tlogit, lp + t0, &res);
    // Pass B: dlogits in place, then dh and dw, chunk by chunk.
    for (int64_t v0 = 0; v0 < V; v0 += pl.Vc) {
      const int64_t nv = std::min(pl.Vc, V - v0);
      const float* wv = bf16 ? nullptr : w_chunk(w, v0, nv, E, wc);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = t0 + i;
        float* x = store + i * V + v0;
        if (tg[t] == ignore_index) {
          std::memset(x, 0, static_cast<size_t>(nv) * sizeof(float));
        } else {
          const float l = lp[t];
          const int64_t jt = tg[t] >= v0 && tg[t] < v0 + nv ? tg[t] - v0 : -1;
          const float pt = jt >= 0 ? exp_f32(x[jt] - l) : 0.0f;
          scaled_exp_row(x, nv, gs, l);
          if (jt >= 0) x[jt] = gs * (pt - 1.0f);
        }
        if (bf16)
          oomless::convert(tbf + i * nv, DType::bf16, x, DType::f32, nv);
      }
      // dh (nt, E) = / += dlogits (nt, nv) . wv (nv, E)
      if (bf16)
        gemm_w(gemm(), w, bf16, v0, wv, tbf, dhp + t0 * E, nt, E, nv, false, v0 > 0, E);
      else
        gemm_w(gemm(), w, bf16, v0, wv, store + v0, dhp + t0 * E, nt, E, nv, false, v0 > 0, E, V);
      // dw (nv, E) += dlogits^T (nv, nt) . h (nt, E)
      if (bf16)
        gemm().run(GemmShape{.M = nv, .N = E, .K = nt, .ta = true, .ab = DType::bf16, .accumulate = true}, tbf,
                   hb + t0 * E, dwp + v0 * E);
      else
        gemm().run(GemmShape{.M = nv, .N = E, .K = nt, .ta = true, .lda = V, .accumulate = true}, store + v0,
                   hp + t0 * E, dwp + v0 * E);
    }
  }
  return res;
}

size_t CpuOps::cross_entropy_workspace(CeCall call, int64_t T, int64_t E, int64_t V, bool w_read_as_bf16,
                                       bool w_widened, std::vector<std::array<int64_t, 3>>* products) const {
  if (T <= 0 || V <= 0) return 0;
  if (products) {  // per (vocabulary chunk, token chunk): the logits; dh; dw (backward with a trained head)
    const Plan pl = plan_for(T, E, V);
    const int64_t tb = call == CeCall::trained ? store_rows(pl, T, V) : pl.Tc;
    if (call == CeCall::trained && tb > 0) {  // per (vocabulary chunk, token block): the same three
      products->push_back({tb, pl.Vc, E});
      products->push_back({tb, E, pl.Vc});
      products->push_back({pl.Vc, E, tb});
    } else {
      products->push_back({pl.Tc, pl.Vc, E});
      if (call != CeCall::forward) products->push_back({pl.Tc, E, pl.Vc});
      if (call == CeCall::backward || call == CeCall::trained) products->push_back({pl.Vc, E, pl.Tc});
    }
  }
  return scratch_bytes(call, T, E, V, w_read_as_bf16, !w_read_as_bf16 && w_widened);
}

}  // namespace oomless
