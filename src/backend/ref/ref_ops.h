// The float64 reference backend: the plainest loops, every float tensor f64 (bf16 accepted for matmul
// and embedding inputs). It is the oracle every other backend and every backward is tested against,
// so it favours obviousness over speed; it is never used to train.
#pragma once
#include "backend/ops.h"

namespace oomless {

class RefOps final : public Ops {
 public:
  const char* name() const override { return "ref"; }
  DType act_dtype() const override { return DType::f64; }

  void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool accumulate) override;
  // The magnitude bound sum_k |a_ik| |b_kj| of matmul (bound is (M, N) f64), used in tolerances.
  void matmul_magnitude(Tensor bound, Tensor a, Tensor b, bool ta, bool tb);

  void embedding_forward(Tensor out, Tensor ids, Tensor table) override;
  void embedding_backward(Tensor dtable, Tensor dout, Tensor ids) override;
  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor in, Tensor weight, double eps) override;
  void rmsnorm_backward(Tensor din, Tensor dweight, Tensor dout, Tensor in, Tensor weight, Tensor rstd) override;
  void rope_forward(Tensor out, Tensor in, Tensor pos, const RopeConfig& cfg) override;
  void rope_backward(Tensor din, Tensor dout, Tensor pos, const RopeConfig& cfg) override;
  void swiglu_forward(Tensor out, Tensor gate, Tensor up) override;
  void swiglu_backward(Tensor dgate, Tensor dup, Tensor dout, Tensor gate, Tensor up) override;
  void add(Tensor out, Tensor a, Tensor b) override;
  void axpy(Tensor y, double alpha, Tensor x) override;
  void scale(Tensor x, double alpha) override;
  void fill(Tensor x, double value) override;
  void dropout(Tensor out, Tensor in, double p, uint64_t seed, int64_t offset, bool accumulate) override;
  void row_norms(Tensor out, Tensor w) override;
  void dora_scale(Tensor g, Tensor n, Tensor m, Tensor wn, Tensor b, Tensor p, Tensor q, double s) override;
  void dora_forward(Tensor y, Tensor z, Tensor g, Tensor bias) override;
  void dora_backward(Tensor dz, Tensor dm, Tensor dy, Tensor z, Tensor g, Tensor n) override;
  void scale_rows(Tensor x, Tensor g) override;
  double sum_squares(Tensor x) override;
  double abs_max(Tensor x) override;
  std::vector<double> target_logits(Tensor h, Tensor w, Tensor targets, int32_t ignore_index) override;
  void convert(Tensor dst, Tensor src) override;
  CastStats cast_scaled(Tensor dst, Tensor src, double scale) override;
  void cast_rows_scaled(Tensor dst, Tensor scales, Tensor src) override;
  void attention_forward(Tensor o, Tensor lse, Tensor q, const KvBlocks& kv, Tensor q_pos, double scale) override;
  void attention_backward(Tensor dq, const KvBlocks& dkv, Tensor dout, Tensor q, const KvBlocks& kv, Tensor o,
                          Tensor lse, Tensor q_pos, double scale) override;
  void attention_merge(Tensor o, Tensor lse, Tensor o2, Tensor lse2, int64_t row0) override;
  CeResult linear_cross_entropy_forward(Tensor lse, Tensor h, Tensor w, Tensor targets, int32_t ignore_index) override;
  void linear_cross_entropy_backward(Tensor dh, Tensor dw, Tensor h, Tensor w, Tensor targets, Tensor lse,
                                     int32_t ignore_index, double grad_scale) override;
  void adamw_step(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamWConfig& cfg) override;
  void adamw8bit_step(Tensor param, Tensor grad, Tensor m_codes, Tensor m_absmax, Tensor v_codes, Tensor v_absmax,
                      const AdamWConfig& cfg) override;
  void svd_basis(Tensor out, Tensor g, bool right) override;
};


}  // namespace oomless
