#include "backend/checks.h"

#include <cmath>
#include <utility>

namespace oomless {

MatmulDims check_matmul(const Tensor& c, const Tensor& a, const Tensor& b, bool ta, bool tb, DType act) {
  const char* op = "[matmul]";
  OOM_CHECK(a.ndim == 2 && b.ndim == 2 && c.ndim == 2, op, " needs 2-D tensors, got a ", a.str(), ", b ", b.str(),
            ", c ", c.str());
  check_dtype(op, "a", a, {act, DType::bf16});
  if (b.quant) {
    // Block-quantised b: dequantised while packing; read as bf16 (rounded) with a bf16 a.
    check_quant_rows(op, "b", b, act);
    OOM_CHECK(a.dtype == act || b.as_bf16, op, " a bf16 a needs the quantised b ", b.str(), " read as bf16");
  } else if (b.as_bf16) {
    // Mixed: b stays in the backend's float type and is rounded to bf16 as it is read.
    OOM_CHECK(a.dtype == DType::bf16 && b.dtype == act, op, " b ", b.str(), " is read as bf16, which needs a bf16 a and a ",
              dtype_name(act), " b; a is ", a.str());
  } else {
    OOM_CHECK(a.dtype == b.dtype, op, " a ", a.str(), " and b ", b.str(), " must share a dtype");
  }
  check_dtype(op, "c", c, {act});
  int64_t M = ta ? a.dims[1] : a.dims[0], K = ta ? a.dims[0] : a.dims[1];
  int64_t Kb = tb ? b.dims[1] : b.dims[0], N = tb ? b.dims[0] : b.dims[1];
  OOM_CHECK(K == Kb, op, " inner dimensions differ: op(a) is ", M, "x", K, ", op(b) is ", Kb, "x", N);
  check_shape(op, "c", c, {M, N});
  return {M, N, K};
}

RowsCols check_embedding(const char* op, const Tensor& rows_out, const Tensor& ids, const Tensor& table, DType act,
                         bool table_may_be_bf16) {
  OOM_CHECK(ids.ndim == 1, op, " ids must be 1-D (T), got ", ids.str());
  check_dtype(op, "ids", ids, {DType::i32});
  OOM_CHECK(table.ndim == 2, op, " table must be (V, E), got ", table.str());
  if (table_may_be_bf16 && table.quant)  // a frozen table kept block-quantised: rows dequantised as read
    check_quant_rows(op, "table", table, act);
  else if (table_may_be_bf16)
    check_dtype(op, "table", table, {act, DType::bf16});
  else
    check_dtype(op, "table", table, {act});
  check_dtype(op, "rows", rows_out, {act});
  check_shape(op, "rows", rows_out, {ids.dims[0], table.dims[1]});
  return {ids.dims[0], table.dims[1]};
}

void check_ids(const char* op, const int32_t* id, int64_t T, int64_t V) {
  for (int64_t t = 0; t < T; ++t)
    OOM_CHECK(id[t] >= 0 && id[t] < V, op, " id ", id[t], " at position ", t, " is outside the vocabulary [0, ", V, ")");
}

void check_targets(const char* op, const int32_t* tg, int64_t T, int64_t V, int32_t ignore_index) {
  for (int64_t t = 0; t < T; ++t)
    OOM_CHECK(tg[t] == ignore_index || (tg[t] >= 0 && tg[t] < V), op, " target ", tg[t], " of row ", t,
              " is outside the vocabulary [0, ", V, ") and is not the ignore index ", ignore_index);
}

RowsCols check_rmsnorm(const char* op, const Tensor& out, const Tensor& rstd, const Tensor& in, const Tensor& weight,
                       DType act) {
  check_dtype(op, "in", in, {act});
  check_dtype(op, "out", out, {act});
  check_dtype(op, "weight", weight, {act});
  check_dtype(op, "rstd", rstd, {act});
  OOM_CHECK(in.ndim >= 1, op, " in must have at least one dimension");
  int64_t R = in.rows(), E = in.cols();
  OOM_CHECK(out.numel() == in.numel() && out.cols() == E, op, " out ", out.str(), " does not match in ", in.str());
  check_shape(op, "weight", weight, {E});
  OOM_CHECK(rstd.numel() == R, op, " rstd ", rstd.str(), " must hold one value per row (", R, ")");
  return {R, E};
}

RopeDims check_rope(const char* op, const Tensor& out, const Tensor& in, const Tensor& pos, DType act) {
  check_dtype(op, "in", in, {act});
  check_dtype(op, "out", out, {act});
  check_dtype(op, "pos", pos, {DType::i32});
  OOM_CHECK(in.ndim == 3, op, " in must be (T, H, D), got ", in.str());
  check_same_shape(op, "out", out, "in", in);
  OOM_CHECK(in.dims[2] % 2 == 0, op, " head dim D = ", in.dims[2], " must be even");
  check_shape(op, "pos", pos, {in.dims[0]});
  return {in.dims[0], in.dims[1], in.dims[2]};
}

void check_elementwise(const char* op, std::initializer_list<const Tensor*> ts, DType act) {
  const Tensor* first = *ts.begin();
  for (const Tensor* t : ts) {
    check_dtype(op, "operand", *t, {act});
    OOM_CHECK(t->same_shape(*first), op, " operands ", first->str(), " and ", t->str(), " must have the same shape");
    OOM_CHECK(t->data != nullptr || t->numel() == 0, op, " operand has no data");
  }
}

AttentionDims check_attention_merge(const char* op, const Tensor& o, const Tensor& lse, const Tensor& o2,
                                    const Tensor& lse2, int64_t row0, DType act) {
  check_dtype(op, "o", o, {act});
  OOM_CHECK(o.ndim == 3, op, " o must be (T, H, D), got ", o.str());
  const int64_t T = o.dims[0], H = o.dims[1], D = o.dims[2];
  check_dtype(op, "o2", o2, {act});
  OOM_CHECK(o2.ndim == 3, op, " o2 must be (n, H, D), got ", o2.str());
  const int64_t n = o2.dims[0];
  OOM_CHECK(row0 >= 0 && row0 + n <= T, op, " rows [", row0, ", ", row0 + n, ") of o2 are outside o's ", T, " rows");
  check_shape(op, "o2", o2, {n, H, D});
  check_dtype(op, "lse", lse, {act});
  check_shape(op, "lse", lse, {H, T});
  check_dtype(op, "lse2", lse2, {act});
  check_shape(op, "lse2", lse2, {H, n});
  return {T, H, 0, D};
}

AttentionDims check_attention(const char* op, const Tensor& o, const Tensor& lse, const Tensor& q, const KvBlocks& kv,
                              const Tensor& q_pos, DType act, std::initializer_list<DType> kv_dtypes) {
  check_dtype(op, "q", q, {act});
  OOM_CHECK(q.ndim == 3, op, " q must be (T, H, D), got ", q.str());
  int64_t T = q.dims[0], H = q.dims[1], D = q.dims[2];
  check_dtype(op, "o", o, {act});
  check_shape(op, "o", o, {T, H, D});
  check_dtype(op, "lse", lse, {act});
  check_shape(op, "lse", lse, {H, T});
  check_dtype(op, "q_pos", q_pos, {DType::i32});
  check_shape(op, "q_pos", q_pos, {T});
  bool kv_ok = false;
  for (DType t : kv_dtypes) kv_ok = kv_ok || kv.dtype == t;
  OOM_CHECK(kv_ok, op, " kv blocks are ", dtype_name(kv.dtype), ", which this backend does not take");
  OOM_CHECK(kv.D == D, op, " kv head dim ", kv.D, " differs from q's ", D);
  OOM_CHECK(kv.Hkv > 0 && H % kv.Hkv == 0, op, " query heads H = ", H, " must be a multiple of kv heads Hkv = ", kv.Hkv);
  OOM_CHECK(kv.P > 0 || kv.n_blocks == 0, op, " block size P must be positive, got ", kv.P);
  OOM_CHECK(kv.n_blocks >= 0 && (kv.blocks != nullptr || kv.n_blocks == 0), op, " block table is missing");
  for (int64_t b = 0; b < kv.n_blocks; ++b) {
    const KvBlock& blk = kv.blocks[b];
    OOM_CHECK(blk.len >= 0 && blk.len <= kv.P, op, " block ", b, " holds ", blk.len, " keys, outside [0, P = ", kv.P, "]");
    OOM_CHECK(blk.len == 0 || (blk.k != nullptr && blk.v != nullptr), op, " block ", b, " has no key/value data");
    OOM_CHECK(blk.start >= 0, op, " block ", b, " starts at negative position ", blk.start);
    OOM_CHECK((blk.k_rows == nullptr) == (blk.v_rows == nullptr), op, " block ", b, " has row scales for one of K, V only");
    OOM_CHECK(blk.len == 0 || kv.dtype != DType::i8 || blk.k_rows != nullptr, op, " block ", b,
              " is i8 without row scales");
    OOM_CHECK(blk.k_rows == nullptr || kv.dtype == DType::i8 || kv.dtype == DType::f8_e4m3, op, " block ", b,
              " has row scales but is ", dtype_name(kv.dtype), " (row scales are for f8_e4m3 and i8 blocks)");
  }
  return {T, H, kv.Hkv, D};
}

void check_attention_backward(const char* op, const AttentionDims& d, const Tensor& dq, const Tensor& dout,
                              const KvBlocks& dkv, const KvBlocks& kv, DType act) {
  check_dtype(op, "dq", dq, {act});
  check_shape(op, "dq", dq, {d.T, d.H, d.D});
  check_dtype(op, "dout", dout, {act});
  check_shape(op, "dout", dout, {d.T, d.H, d.D});
  OOM_CHECK(dkv.dtype == act, op, " dkv blocks are ", dtype_name(dkv.dtype), ", gradients are ", dtype_name(act));
  OOM_CHECK(dkv.n_blocks == kv.n_blocks && dkv.Hkv == kv.Hkv && dkv.P == kv.P && dkv.D == kv.D, op,
            " dkv table (", dkv.n_blocks, " blocks of Hkv=", dkv.Hkv, ", P=", dkv.P, ", D=", dkv.D,
            ") differs from the kv table (", kv.n_blocks, " blocks of Hkv=", kv.Hkv, ", P=", kv.P, ", D=", kv.D, ")");
  for (int64_t b = 0; b < kv.n_blocks; ++b) {
    const KvBlock &g = dkv.blocks[b], &f = kv.blocks[b];
    OOM_CHECK(g.start == f.start && g.len == f.len, op, " dkv block ", b, " covers [", g.start, ", +", g.len,
              ") but the kv block covers [", f.start, ", +", f.len, ")");
    OOM_CHECK(g.len == 0 || (g.k != nullptr && g.v != nullptr), op, " dkv block ", b, " has no data");
  }
}

CeDims check_cross_entropy(const char* op, const Tensor& lse, const Tensor& h, const Tensor& w, const Tensor& targets,
                           int32_t ignore_index, DType act) {
  const CeDims d = check_head_rows(op, h, w, targets, ignore_index, act);
  check_dtype(op, "lse", lse, {act});
  check_shape(op, "lse", lse, {d.T});
  return d;
}

CeDims check_head_rows(const char* op, const Tensor& h, const Tensor& w, const Tensor& targets, int32_t ignore_index,
                       DType act) {
  check_dtype(op, "h", h, {act});
  OOM_CHECK(h.ndim == 2, op, " h must be (T, E), got ", h.str());
  OOM_CHECK(w.ndim == 2, op, " w must be (V, E), got ", w.str());
  if (w.quant)
    check_quant_rows(op, "w", w, act);
  else if (w.as_bf16)
    OOM_CHECK(w.dtype == act, op, " w ", w.str(), " is read as bf16, which needs it in ", dtype_name(act));
  else
    check_dtype(op, "w", w, {act, DType::bf16});
  int64_t T = h.dims[0], E = h.dims[1], V = w.dims[0];
  OOM_CHECK(w.dims[1] == E, op, " w ", w.str(), " and h ", h.str(), " disagree on the width E");
  check_dtype(op, "targets", targets, {DType::i32});
  check_shape(op, "targets", targets, {T});
  (void)ignore_index;  // the values: check_targets, where the backend reads them
  return {T, E, V};
}

void check_quant_rows(const char* op, const char* name, const Tensor& t, DType act) {
  OOM_CHECK(t.quant && t.ndim == 2 && t.dtype == act && t.quant->dequant_row && t.qrow0 >= 0 &&
                t.qrow0 + t.dims[0] <= t.quant->rows && t.dims[1] == t.quant->cols,
            op, " ", name, " ", t.str(), " does not fit its quantised matrix (", t.quant ? t.quant->rows : 0, " x ",
            t.quant ? t.quant->cols : 0, ")");
}

void check_cross_entropy_backward(const char* op, const CeDims& d, const Tensor& dh, const Tensor& dw, DType act) {
  check_dtype(op, "dh", dh, {act});
  check_shape(op, "dh", dh, {d.T, d.E});
  if (!dw.data) return;  // a frozen head: no weight gradient
  check_dtype(op, "dw", dw, {act});
  check_shape(op, "dw", dw, {d.V, d.E});
}

void check_dropout(const char* op, const Tensor& out, const Tensor& in, double p, DType act) {
  check_elementwise(op, {&out, &in}, act);
  OOM_CHECK(p >= 0 && p < 1, op, " probability must be in [0, 1), got ", p);
}

RowsCols check_row_norms(const char* op, const Tensor& out, const Tensor& w, DType act) {
  OOM_CHECK(w.ndim == 2, op, " w must be (N, K), got ", w.str());
  if (w.quant)
    check_quant_rows(op, "w", w, act);
  else
    check_dtype(op, "w", w, {act});
  check_dtype(op, "out", out, {act});
  check_shape(op, "out", out, {w.dims[0]});
  return {w.dims[0], w.dims[1]};
}

RowsCols check_dora_scale(const char* op, const Tensor& g, const Tensor& n, const Tensor& m, const Tensor& wn,
                          const Tensor& b, const Tensor& p, const Tensor& q, DType act) {
  OOM_CHECK(wn.ndim == 1, op, " wn must be (N), got ", wn.str());
  const int64_t N = wn.dims[0];
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"g", &g}, {"n", &n}, {"m", &m}, {"wn", &wn}}) {
    check_dtype(op, name, *t, {act});
    check_shape(op, name, *t, {N});
  }
  OOM_CHECK(g.data != n.data && g.data != m.data, op, " g may not share memory with n or m");
  if (!b.data) return {N, 0};
  OOM_CHECK(b.ndim == 2, op, " b must be (N, r), got ", b.str());
  const int64_t r = b.dims[1];
  check_dtype(op, "b", b, {act});
  check_dtype(op, "p", p, {act});
  check_dtype(op, "q", q, {act});
  check_shape(op, "b", b, {N, r});
  check_shape(op, "p", p, {r, N});
  check_shape(op, "q", q, {N, r});
  return {N, r};
}

RowsCols check_dora_forward(const char* op, const Tensor& y, const Tensor& z, const Tensor& g, const Tensor& bias,
                            DType act) {
  OOM_CHECK(y.ndim == 2, op, " y must be (T, N), got ", y.str());
  const int64_t T = y.dims[0], N = y.dims[1];
  check_dtype(op, "y", y, {act});
  check_dtype(op, "g", g, {act});
  check_shape(op, "g", g, {N});
  if (z.data) {
    check_dtype(op, "z", z, {act});
    check_shape(op, "z", z, {T, N});
  }
  if (bias.data) {
    check_dtype(op, "bias", bias, {act});
    check_shape(op, "bias", bias, {N});
  }
  return {T, N};
}

RowsCols check_dora_backward(const char* op, const Tensor& dz, const Tensor& dm, const Tensor& dy, const Tensor& z,
                             const Tensor& g, const Tensor& n, DType act) {
  OOM_CHECK(dy.ndim == 2, op, " dy must be (T, N), got ", dy.str());
  const int64_t T = dy.dims[0], N = dy.dims[1];
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"dz", &dz}, {"dy", &dy}, {"z", &z}}) {
    check_dtype(op, name, *t, {act});
    check_shape(op, name, *t, {T, N});
  }
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"dm", &dm}, {"g", &g}, {"n", &n}}) {
    check_dtype(op, name, *t, {act});
    check_shape(op, name, *t, {N});
  }
  return {T, N};
}

RowsCols check_scale_rows(const char* op, const Tensor& x, const Tensor& g, DType act) {
  OOM_CHECK(x.ndim == 2, op, " x must be (N, K), got ", x.str());
  check_dtype(op, "x", x, {act});
  check_dtype(op, "g", g, {act});
  check_shape(op, "g", g, {x.dims[0]});
  return {x.dims[0], x.dims[1]};
}

RowsCols check_cast_rows(const char* op, const Tensor& dst, const Tensor& scales, const Tensor& src, DType act) {
  OOM_CHECK(src.ndim == 2, op, " src must be (N, K), got ", src.str());
  check_dtype(op, "src", src, {act});
  check_dtype(op, "dst", dst, {DType::f8_e4m3, DType::i8});
  check_shape(op, "dst", dst, {src.dims[0], src.dims[1]});
  check_dtype(op, "scales", scales, {act});
  check_shape(op, "scales", scales, {src.dims[0]});
  return {src.dims[0], src.dims[1]};
}

void check_adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWConfig& cfg,
                 DType act) {
  check_elementwise("[adamw]", {&param, &grad, &m, &v}, act);
  OOM_CHECK(cfg.step >= 1, "[adamw] step counts from 1, got ", cfg.step);
  OOM_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1 && cfg.beta2 >= 0 && cfg.beta2 < 1, "[adamw] betas must be in [0, 1), got ",
            cfg.beta1, ", ", cfg.beta2);
  OOM_CHECK(cfg.eps > 0 && std::isfinite(cfg.lr), "[adamw] eps must be positive and lr finite");
}

void check_adamw8bit(const Tensor& param, const Tensor& grad, const Tensor& m_codes, const Tensor& m_absmax,
                     const Tensor& v_codes, const Tensor& v_absmax, const AdamWConfig& cfg, DType act) {
  const char* op = "[adamw8bit]";
  check_elementwise(op, {&param, &grad}, act);
  for (const Tensor* c : {&m_codes, &v_codes}) {
    check_dtype(op, "state codes", *c, {DType::u8});
    OOM_CHECK(c->numel() == param.numel() && (c->data != nullptr || c->numel() == 0), op, " state codes ", c->str(),
              " must hold one byte per element of ", param.str());
  }
  const int64_t blocks = (param.numel() + kAdam8Block - 1) / kAdam8Block;
  for (const Tensor* a : {&m_absmax, &v_absmax}) {
    check_dtype(op, "state scales", *a, {act});
    OOM_CHECK(a->numel() == blocks && (a->data != nullptr || blocks == 0), op, " state scales ", a->str(),
              " must hold one value per ", kAdam8Block, " elements (", blocks, ")");
  }
  OOM_CHECK(cfg.step >= 1, op, " step counts from 1, got ", cfg.step);
  OOM_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1 && cfg.beta2 >= 0 && cfg.beta2 < 1, op, " betas must be in [0, 1), got ",
            cfg.beta1, ", ", cfg.beta2);
  OOM_CHECK(cfg.eps > 0 && std::isfinite(cfg.lr), op, " eps must be positive and lr finite");
}

void check_svd_basis(const Tensor& out, const Tensor& g, bool right, DType act) {
  const char* op = "[svd_basis]";
  check_dtype(op, "g", g, {act});
  check_dtype(op, "out", out, {act});
  OOM_CHECK(g.ndim == 2 && out.ndim == 2 && g.data && out.data, op, " g and out must be matrices, got ", g.str(), " and ",
            out.str());
  const int64_t m = g.dims[0], n = g.dims[1], r = right ? out.dims[0] : out.dims[1];
  OOM_CHECK(right ? out.dims[1] == n : out.dims[0] == m, op, " out ", out.str(), " does not fit g ", g.str(),
            right ? " (right: (r, n))" : " (left: (m, r))");
  OOM_CHECK(r >= 1 && r <= std::min(m, n), op, " rank ", r, " must be in 1..", std::min(m, n), " for g ", g.str());
}

RowsCols check_embedding_host(const char* op, const Tensor& rows_out, const Tensor& ids, const Tensor& table, DType act,
                              bool table_may_be_bf16) {
  const RowsCols d = check_embedding(op, rows_out, ids, table, act, table_may_be_bf16);
  check_ids(op, static_cast<const int32_t*>(ids.data), d.rows, table.dims[0]);
  return d;
}

CeDims check_cross_entropy_host(const char* op, const Tensor& lse, const Tensor& h, const Tensor& w, const Tensor& targets,
                                int32_t ignore_index, DType act) {
  const CeDims d = check_cross_entropy(op, lse, h, w, targets, ignore_index, act);
  check_targets(op, static_cast<const int32_t*>(targets.data), d.T, d.V, ignore_index);
  return d;
}

}  // namespace oomless
