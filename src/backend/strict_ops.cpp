#include "backend/strict_ops.h"

#include "memory/allocator.h"

namespace oomless {

namespace {

// Forwards every entry of Ops (each pure virtual must be, or this does not compile) inside a DeviceAccess.
class StrictOps final : public Ops {
 public:
  explicit StrictOps(std::unique_ptr<Ops> inner) : in_(std::move(inner)) {}

  const char* name() const override { return in_->name(); }
  DType act_dtype() const override { return in_->act_dtype(); }
  std::array<size_t, 2> matmul_workspace(int64_t M, int64_t N, int64_t K, bool bf16) const override {
    return in_->matmul_workspace(M, N, K, bf16);
  }
  size_t attention_workspace(bool backward, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t key_blocks,
                             int64_t block_len, DType kv_dtype, bool bf16_products) const override {
    return in_->attention_workspace(backward, T, H, Hkv, D, key_blocks, block_len, kv_dtype, bf16_products);
  }
  size_t cross_entropy_workspace(CeCall call, int64_t T, int64_t E, int64_t V, bool w_read_as_bf16, bool w_widened,
                                 std::vector<std::array<int64_t, 3>>* products) const override {
    return in_->cross_entropy_workspace(call, T, E, V, w_read_as_bf16, w_widened, products);
  }

  void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool accumulate) override {
    DeviceAccess open;
    in_->matmul(c, a, b, ta, tb, accumulate);
  }
  void embedding_forward(Tensor out, Tensor ids, Tensor table) override {
    DeviceAccess open;
    in_->embedding_forward(out, ids, table);
  }
  void embedding_backward(Tensor dtable, Tensor dout, Tensor ids) override {
    DeviceAccess open;
    in_->embedding_backward(dtable, dout, ids);
  }
  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor in, Tensor weight, double eps) override {
    DeviceAccess open;
    in_->rmsnorm_forward(out, rstd, in, weight, eps);
  }
  void rmsnorm_backward(Tensor din, Tensor dweight, Tensor dout, Tensor in, Tensor weight, Tensor rstd) override {
    DeviceAccess open;
    in_->rmsnorm_backward(din, dweight, dout, in, weight, rstd);
  }
  void rope_forward(Tensor out, Tensor in, Tensor pos, const RopeConfig& cfg) override {
    DeviceAccess open;
    in_->rope_forward(out, in, pos, cfg);
  }
  void rope_backward(Tensor din, Tensor dout, Tensor pos, const RopeConfig& cfg) override {
    DeviceAccess open;
    in_->rope_backward(din, dout, pos, cfg);
  }
  void swiglu_forward(Tensor out, Tensor gate, Tensor up) override {
    DeviceAccess open;
    in_->swiglu_forward(out, gate, up);
  }
  void swiglu_backward(Tensor dgate, Tensor dup, Tensor dout, Tensor gate, Tensor up) override {
    DeviceAccess open;
    in_->swiglu_backward(dgate, dup, dout, gate, up);
  }
  void add(Tensor out, Tensor a, Tensor b) override {
    DeviceAccess open;
    in_->add(out, a, b);
  }
  void axpy(Tensor y, double alpha, Tensor x) override {
    DeviceAccess open;
    in_->axpy(y, alpha, x);
  }
  void scale(Tensor x, double alpha) override {
    DeviceAccess open;
    in_->scale(x, alpha);
  }
  void fill(Tensor x, double value) override {
    DeviceAccess open;
    in_->fill(x, value);
  }
  void upload(Tensor dst, const void* src) override {
    DeviceAccess open;
    in_->upload(dst, src);
  }
  void download(void* dst, Tensor src) override {
    DeviceAccess open;
    in_->download(dst, src);
  }
  void copy(Tensor dst, Tensor src) override {
    DeviceAccess open;
    in_->copy(dst, src);
  }
  void zero(Tensor x) override {
    DeviceAccess open;
    in_->zero(x);
  }
  void iota(Tensor x, int32_t first) override {
    DeviceAccess open;
    in_->iota(x, first);
  }
  void write_host(Tensor dst, const std::function<void(void*)>& write) override {
    DeviceAccess open;
    in_->write_host(dst, write);
  }
  void read_host(Tensor src, const std::function<void(const void*)>& read) override {
    DeviceAccess open;
    in_->read_host(src, read);
  }
  void page_summary(Tensor out, Tensor k, int64_t row0, int64_t P) override {
    DeviceAccess open;
    in_->page_summary(out, k, row0, P);
  }
  void page_select(Tensor sel, Tensor counts, Tensor q, Tensor summaries, int64_t P, int64_t sinks) override {
    DeviceAccess open;
    in_->page_select(sel, counts, q, summaries, P, sinks);
  }
  void dropout(Tensor out, Tensor in, double p, uint64_t seed, int64_t offset, bool accumulate) override {
    DeviceAccess open;
    in_->dropout(out, in, p, seed, offset, accumulate);
  }
  double sum_squares(Tensor x) override {
    DeviceAccess open;
    return in_->sum_squares(x);
  }
  double abs_max(Tensor x) override {
    DeviceAccess open;
    return in_->abs_max(x);
  }
  void convert(Tensor dst, Tensor src) override {
    DeviceAccess open;
    in_->convert(dst, src);
  }
  CastStats cast_scaled(Tensor dst, Tensor src, double scale) override {
    DeviceAccess open;
    return in_->cast_scaled(dst, src, scale);
  }
  void cast_rows_scaled(Tensor dst, Tensor scales, Tensor src) override {
    DeviceAccess open;
    in_->cast_rows_scaled(dst, scales, src);
  }
  void row_norms(Tensor out, Tensor w) override {
    DeviceAccess open;
    in_->row_norms(out, w);
  }
  void dora_scale(Tensor g, Tensor n, Tensor m, Tensor wn, Tensor b, Tensor p, Tensor q, double s) override {
    DeviceAccess open;
    in_->dora_scale(g, n, m, wn, b, p, q, s);
  }
  void dora_forward(Tensor y, Tensor z, Tensor g, Tensor bias) override {
    DeviceAccess open;
    in_->dora_forward(y, z, g, bias);
  }
  void dora_backward(Tensor dz, Tensor dm, Tensor dy, Tensor z, Tensor g, Tensor n) override {
    DeviceAccess open;
    in_->dora_backward(dz, dm, dy, z, g, n);
  }
  void scale_rows(Tensor x, Tensor g) override {
    DeviceAccess open;
    in_->scale_rows(x, g);
  }
  void attention_forward(Tensor o, Tensor lse, Tensor q, const KvBlocks& kv, Tensor q_pos, double scale) override {
    DeviceAccess open;
    in_->attention_forward(o, lse, q, kv, q_pos, scale);
  }
  void attention_backward(Tensor dq, const KvBlocks& dkv, Tensor dout, Tensor q, const KvBlocks& kv, Tensor o,
                          Tensor lse, Tensor q_pos, double scale) override {
    DeviceAccess open;
    in_->attention_backward(dq, dkv, dout, q, kv, o, lse, q_pos, scale);
  }
  void attention_merge(Tensor o, Tensor lse, Tensor o2, Tensor lse2, int64_t row0) override {
    DeviceAccess open;
    in_->attention_merge(o, lse, o2, lse2, row0);
  }
  CeResult linear_cross_entropy_forward(Tensor lse, Tensor h, Tensor w, Tensor targets, int32_t ignore_index) override {
    DeviceAccess open;
    return in_->linear_cross_entropy_forward(lse, h, w, targets, ignore_index);
  }
  std::vector<double> target_logits(Tensor h, Tensor w, Tensor targets, int32_t ignore_index) override {
    DeviceAccess open;
    return in_->target_logits(h, w, targets, ignore_index);
  }
  void linear_cross_entropy_backward(Tensor dh, Tensor dw, Tensor h, Tensor w, Tensor targets, Tensor lse,
                                     int32_t ignore_index, double grad_scale) override {
    DeviceAccess open;
    in_->linear_cross_entropy_backward(dh, dw, h, w, targets, lse, ignore_index, grad_scale);
  }
  CeResult linear_cross_entropy_fused(Tensor lse, Tensor dh, Tensor h, Tensor w, Tensor targets, int32_t ignore_index,
                                      double grad_scale) override {
    DeviceAccess open;
    return in_->linear_cross_entropy_fused(lse, dh, h, w, targets, ignore_index, grad_scale);
  }
  CeResult linear_cross_entropy_trained(Tensor lse, Tensor dh, Tensor dw, Tensor h, Tensor w, Tensor targets,
                                        int32_t ignore_index, double grad_scale) override {
    DeviceAccess open;
    return in_->linear_cross_entropy_trained(lse, dh, dw, h, w, targets, ignore_index, grad_scale);
  }
  void adamw_step(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamWConfig& cfg) override {
    DeviceAccess open;
    in_->adamw_step(param, grad, m, v, cfg);
  }
  void adamw8bit_step(Tensor param, Tensor grad, Tensor m_codes, Tensor m_absmax, Tensor v_codes, Tensor v_absmax,
                      const AdamWConfig& cfg) override {
    DeviceAccess open;
    in_->adamw8bit_step(param, grad, m_codes, m_absmax, v_codes, v_absmax, cfg);
  }
  void svd_basis(Tensor out, Tensor g, bool right) override {
    DeviceAccess open;
    in_->svd_basis(out, g, right);
  }

 private:
  std::unique_ptr<Ops> in_;
};

}  // namespace

std::unique_ptr<Ops> make_strict_ops(std::unique_ptr<Ops> inner) { return std::make_unique<StrictOps>(std::move(inner)); }

}  // namespace oomless
