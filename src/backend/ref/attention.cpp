// Float64 reference of causal GQA attention over a block table: one query row and head at a time,
// scores over every visible key, softmax, output. The oracle for the fast kernels, so nothing clever.
//
// Query t (position p_t), head h, kv head g = h / (H / Hkv); key j of block b is at position
// start_b + j for slots j < len_b, and is visible when its position <= p_t.
//   s_j = scale q.k_j,  lse = m + log sum_j exp(s_j - m) (m = max s_j),  P_j = exp(s_j - lse)
//   o = sum_j P_j v_j                                          (o = 0, lse = -inf when nothing is visible)
// Backward (dO = dout, Dt = rowsum(dO * O)):
//   dP_j = dO.v_j,  dS_j = P_j (dP_j - Dt),  dq = scale sum_j dS_j k_j,
//   dk_j += scale dS_j q,  dv_j += P_j dO
#include <cmath>
#include <limits>
#include <vector>

#include "backend/attention_merge.h"
#include "backend/checks.h"
#include "backend/ref/ref_ops.h"

namespace oomless {

namespace {
constexpr DType kAct = DType::f64;
constexpr const char* kOp = "[attention]";

// One visible key: the rows of its k and v (D doubles each), and where its gradients go.
struct Key {
  const double* k;
  const double* v;
  double* dk;
  double* dv;
};

// The keys query position `pos` sees through kv head g, in block-table order.
void visible_keys(std::vector<Key>& out, const KvBlocks& kv, const KvBlocks* dkv, int64_t g, int32_t pos) {
  out.clear();
  const int64_t P = kv.P, D = kv.D;
  for (int64_t b = 0; b < kv.n_blocks; ++b) {
    const KvBlock& blk = kv.blocks[b];
    for (int64_t j = 0; j < blk.len; ++j) {
      if (static_cast<int64_t>(blk.start) + j > pos) break;
      const int64_t off = (g * P + j) * D;
      Key key{static_cast<const double*>(blk.k) + off, static_cast<const double*>(blk.v) + off, nullptr, nullptr};
      if (dkv) {
        key.dk = static_cast<double*>(dkv->blocks[b].k) + off;
        key.dv = static_cast<double*>(dkv->blocks[b].v) + off;
      }
      out.push_back(key);
    }
  }
}

double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void RefOps::attention_forward(Tensor o, Tensor lse, Tensor q, const KvBlocks& kv, Tensor q_pos, double scale) {
  auto [T, H, Hkv, D] = check_attention(kOp, o, lse, q, kv, q_pos, kAct, {kAct});
  const double* qp = static_cast<const double*>(q.data);
  const int32_t* pos = static_cast<const int32_t*>(q_pos.data);
  double* op = static_cast<double*>(o.data);
  double* lp = static_cast<double*>(lse.data);
  const int64_t group = H / Hkv;
  std::vector<Key> keys;
  std::vector<double> s;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const double* qrow = qp + (t * H + h) * D;
      double* orow = op + (t * H + h) * D;
      visible_keys(keys, kv, nullptr, h / group, pos[t]);
      for (int64_t d = 0; d < D; ++d) orow[d] = 0;
      if (keys.empty()) {
        lp[h * T + t] = -std::numeric_limits<double>::infinity();
        continue;
      }
      s.resize(keys.size());
      double m = -std::numeric_limits<double>::infinity();
      for (size_t j = 0; j < keys.size(); ++j) {
        s[j] = scale * dot(qrow, keys[j].k, D);
        m = std::max(m, s[j]);
      }
      double sum = 0;
      for (size_t j = 0; j < keys.size(); ++j) sum += std::exp(s[j] - m);
      const double l = m + std::log(sum);
      for (size_t j = 0; j < keys.size(); ++j) {
        const double p = std::exp(s[j] - l);
        for (int64_t d = 0; d < D; ++d) orow[d] += p * keys[j].v[d];
      }
      lp[h * T + t] = l;
    }
  }
}

void RefOps::attention_backward(Tensor dq, const KvBlocks& dkv, Tensor dout, Tensor q, const KvBlocks& kv, Tensor o,
                                Tensor lse, Tensor q_pos, double scale) {
  const AttentionDims dims = check_attention(kOp, o, lse, q, kv, q_pos, kAct, {kAct});
  auto [T, H, Hkv, D] = dims;
  check_attention_backward(kOp, dims, dq, dout, dkv, kv, kAct);
  const double* qp = static_cast<const double*>(q.data);
  const double* op = static_cast<const double*>(o.data);
  const double* dop = static_cast<const double*>(dout.data);
  const double* lp = static_cast<const double*>(lse.data);
  const int32_t* pos = static_cast<const int32_t*>(q_pos.data);
  double* dqp = static_cast<double*>(dq.data);
  const int64_t group = H / Hkv;
  std::vector<Key> keys;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = (t * H + h) * D;
      const double* qrow = qp + row;
      const double* dorow = dop + row;
      double* dqrow = dqp + row;
      for (int64_t d = 0; d < D; ++d) dqrow[d] = 0;
      const double l = lp[h * T + t];
      visible_keys(keys, kv, &dkv, h / group, pos[t]);
      if (keys.empty() || std::isinf(l)) continue;
      const double Dt = dot(dorow, op + row, D);
      for (const Key& key : keys) {
        const double p = std::exp(scale * dot(qrow, key.k, D) - l);
        const double ds = p * (dot(dorow, key.v, D) - Dt);
        for (int64_t d = 0; d < D; ++d) {
          dqrow[d] += scale * ds * key.k[d];
          key.dk[d] += scale * ds * qrow[d];
          key.dv[d] += p * dorow[d];
        }
      }
    }
  }
}

void RefOps::attention_merge(Tensor o, Tensor lse, Tensor o2, Tensor lse2, int64_t row0) {
  const AttentionDims d = check_attention_merge("[attention_merge]", o, lse, o2, lse2, row0, kAct);
  detail::attention_merge_rows(static_cast<double*>(o.data), static_cast<double*>(lse.data),
                               static_cast<const double*>(o2.data), static_cast<const double*>(lse2.data), d.T,
                               o2.dims[0], row0, d.H, d.D);
}

}  // namespace oomless
