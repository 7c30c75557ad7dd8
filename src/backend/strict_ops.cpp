#include "backend/strict_ops.h"

#include <cstdlib>
#include <initializer_list>
#include <string_view>

#include "memory/allocator.h"

namespace oomless {

namespace {

// A tensor's tier must say where its memory is (guarded Device memory, or not), and no kernel takes the Disk
// tier: every tensor argument of every call is checked in this mode.
void true_tier(const char* op, const Tensor& t, int arg) {
  if (!t.data || t.numel() == 0) return;
  OOM_CHECK(t.tier != Tier::Disk, "[", op, "] ", t.str(), " says it is on disk: kernels take memory only");
  const bool device = in_guarded_range(t.data);
  OOM_CHECK(device == (t.tier == Tier::Device), "[strict-device] ", op, ": argument ", arg + 1, ", ", t.str(), ", is a view of ",
            device ? "Device" : "host", " memory but its tier says ", tier_name(t.tier),
            "; make views with the tier of the buffer they come from (Buffer::view, or Tensor's tier argument)");
}
// A kernel runs where its operands are: the tensors of one call are all Device memory or all host memory. Only
// the memory operations that exist to cross (copy, copy_rows, upload, download, map_to_host) take both.
void one_side(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  int first_arg = 0, arg = 0;
  for (const Tensor* t : ts) {
    ++arg;
    if (!t->data || t->numel() == 0) continue;
    if (!first) {
      first = t;
      first_arg = arg;
      continue;
    }
    OOM_CHECK((t->tier == Tier::Device) == (first->tier == Tier::Device), "[strict-device] ", op, ": argument ",
              first_arg, ", ", first->str(), ", is ", tier_name(first->tier), " memory and argument ", arg, ", ",
              t->str(), ", is ", tier_name(t->tier),
              " memory: a kernel takes its operands on one side; bring them over first (upload, download, copy)");
  }
}
template <class... T>
void true_tiers(const char* op, const T&... ts) {
  int i = 0;
  ((true_tier(op, ts, i++)), ...);
  if (std::string_view(op) != "copy" && std::string_view(op) != "copy_rows") one_side(op, {&ts...});
}
// The K/V blocks an attention call reads lie on the side of its queries.
void kv_side(const char* op, const Tensor& q, const KvBlocks& kv) {
  if (!q.data || q.numel() == 0) return;
  const bool device = q.tier == Tier::Device;
  for (int64_t b = 0; b < kv.n_blocks; ++b) {
    const KvBlock& blk = kv.blocks[b];
    if (blk.len == 0) continue;
    for (const void* p : {blk.k, blk.v})
      OOM_CHECK(!p || in_guarded_range(p) == device, "[strict-device] ", op, ": K/V block ", b, " (keys ", blk.start,
                "..", blk.start + blk.len - 1, ") is in ", in_guarded_range(p) ? "Device" : "host",
                " memory and the queries ", q.str(), " in ", tier_name(q.tier),
                " memory: bring the pages to the queries' side first");
  }
}

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
    true_tiers("matmul", c, a, b);
    in_->matmul(c, a, b, ta, tb, accumulate);
  }
  void embedding_forward(Tensor out, Tensor ids, Tensor table) override {
    DeviceAccess open;
    true_tiers("embedding_forward", out, ids, table);
    in_->embedding_forward(out, ids, table);
  }
  void embedding_backward(Tensor dtable, Tensor dout, Tensor ids) override {
    DeviceAccess open;
    true_tiers("embedding_backward", dtable, dout, ids);
    in_->embedding_backward(dtable, dout, ids);
  }
  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor in, Tensor weight, double eps) override {
    DeviceAccess open;
    true_tiers("rmsnorm_forward", out, rstd, in, weight);
    in_->rmsnorm_forward(out, rstd, in, weight, eps);
  }
  void rmsnorm_backward(Tensor din, Tensor dweight, Tensor dout, Tensor in, Tensor weight, Tensor rstd) override {
    DeviceAccess open;
    true_tiers("rmsnorm_backward", din, dweight, dout, in, weight, rstd);
    in_->rmsnorm_backward(din, dweight, dout, in, weight, rstd);
  }
  void rope_forward(Tensor out, Tensor in, Tensor pos, const RopeConfig& cfg) override {
    DeviceAccess open;
    true_tiers("rope_forward", out, in, pos);
    in_->rope_forward(out, in, pos, cfg);
  }
  void rope_backward(Tensor din, Tensor dout, Tensor pos, const RopeConfig& cfg) override {
    DeviceAccess open;
    true_tiers("rope_backward", din, dout, pos);
    in_->rope_backward(din, dout, pos, cfg);
  }
  void swiglu_forward(Tensor out, Tensor gate, Tensor up) override {
    DeviceAccess open;
    true_tiers("swiglu_forward", out, gate, up);
    in_->swiglu_forward(out, gate, up);
  }
  void swiglu_backward(Tensor dgate, Tensor dup, Tensor dout, Tensor gate, Tensor up) override {
    DeviceAccess open;
    true_tiers("swiglu_backward", dgate, dup, dout, gate, up);
    in_->swiglu_backward(dgate, dup, dout, gate, up);
  }
  void add(Tensor out, Tensor a, Tensor b) override {
    DeviceAccess open;
    true_tiers("add", out, a, b);
    in_->add(out, a, b);
  }
  void axpy(Tensor y, double alpha, Tensor x) override {
    DeviceAccess open;
    true_tiers("axpy", y, x);
    in_->axpy(y, alpha, x);
  }
  void scale(Tensor x, double alpha) override {
    DeviceAccess open;
    true_tiers("scale", x);
    in_->scale(x, alpha);
  }
  void fill(Tensor x, double value) override {
    DeviceAccess open;
    true_tiers("fill", x);
    in_->fill(x, value);
  }
  void upload(Tensor dst, const void* src) override {
    DeviceAccess open;
    true_tiers("upload", dst);
    in_->upload(dst, src);
  }
  void download(void* dst, Tensor src) override {
    DeviceAccess open;
    true_tiers("download", src);
    in_->download(dst, src);
  }
  void copy(Tensor dst, Tensor src) override {
    DeviceAccess open;
    true_tiers("copy", dst, src);
    in_->copy(dst, src);
  }
  void copy_rows(Tensor dst, int64_t dst_ld, Tensor src, int64_t src_ld, int64_t rows, int64_t cols) override {
    DeviceAccess open;
    true_tiers("copy_rows", dst, src);
    in_->copy_rows(dst, dst_ld, src, src_ld, rows, cols);
  }
  void zero(Tensor x) override {
    DeviceAccess open;
    true_tiers("zero", x);
    in_->zero(x);
  }
  void iota(Tensor x, int32_t first) override {
    DeviceAccess open;
    true_tiers("iota", x);
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
  // Staged as a device backend stages: the host sees a copy, never the Device memory itself.
  Tensor map_to_host(Tensor t) override {
    true_tiers("map_to_host", t);
    if (t.tier != Tier::Device || !t.data) return in_->map_to_host(t);
    const size_t n = static_cast<size_t>(t.nbytes());
    void* h = std::aligned_alloc(64, (n + 63) / 64 * 64);
    OOM_CHECK(h, "[strict-device] no host memory for a staged copy of ", t.str());
    download(h, t);
    Tensor v = t;
    v.data = h;
    v.tier = Tier::Host;
    return v;
  }
  void unmap_from_host(Tensor t, Tensor host, bool write_back) override {
    if (t.tier != Tier::Device || !t.data) return in_->unmap_from_host(t, host, write_back);
    if (write_back) upload(t, host.data);
    std::free(host.data);
  }
  void page_summary(Tensor out, Tensor k, int64_t row0, int64_t P) override {
    DeviceAccess open;
    true_tiers("page_summary", out, k);
    in_->page_summary(out, k, row0, P);
  }
  void page_select(Tensor sel, Tensor counts, Tensor q, Tensor summaries, int64_t P, int64_t sinks) override {
    DeviceAccess open;
    true_tiers("page_select", sel, counts, q, summaries);
    in_->page_select(sel, counts, q, summaries, P, sinks);
  }
  void dropout(Tensor out, Tensor in, double p, uint64_t seed, int64_t offset, bool accumulate) override {
    DeviceAccess open;
    true_tiers("dropout", out, in);
    in_->dropout(out, in, p, seed, offset, accumulate);
  }
  double sum_squares(Tensor x) override {
    DeviceAccess open;
    true_tiers("sum_squares", x);
    return in_->sum_squares(x);
  }
  double abs_max(Tensor x) override {
    DeviceAccess open;
    true_tiers("abs_max", x);
    return in_->abs_max(x);
  }
  void convert(Tensor dst, Tensor src) override {
    DeviceAccess open;
    true_tiers("convert", dst, src);
    in_->convert(dst, src);
  }
  CastStats cast_scaled(Tensor dst, Tensor src, double scale) override {
    DeviceAccess open;
    true_tiers("cast_scaled", dst, src);
    return in_->cast_scaled(dst, src, scale);
  }
  void cast_rows_scaled(Tensor dst, Tensor scales, Tensor src) override {
    DeviceAccess open;
    true_tiers("cast_rows_scaled", dst, scales, src);
    in_->cast_rows_scaled(dst, scales, src);
  }
  void row_norms(Tensor out, Tensor w) override {
    DeviceAccess open;
    true_tiers("row_norms", out, w);
    in_->row_norms(out, w);
  }
  void dora_scale(Tensor g, Tensor n, Tensor m, Tensor wn, Tensor b, Tensor p, Tensor q, double s) override {
    DeviceAccess open;
    true_tiers("dora_scale", g, n, m, wn, b, p, q);
    in_->dora_scale(g, n, m, wn, b, p, q, s);
  }
  void dora_forward(Tensor y, Tensor z, Tensor g, Tensor bias) override {
    DeviceAccess open;
    true_tiers("dora_forward", y, z, g, bias);
    in_->dora_forward(y, z, g, bias);
  }
  void dora_backward(Tensor dz, Tensor dm, Tensor dy, Tensor z, Tensor g, Tensor n) override {
    DeviceAccess open;
    true_tiers("dora_backward", dz, dm, dy, z, g, n);
    in_->dora_backward(dz, dm, dy, z, g, n);
  }
  void scale_rows(Tensor x, Tensor g) override {
    DeviceAccess open;
    true_tiers("scale_rows", x, g);
    in_->scale_rows(x, g);
  }
  void attention_forward(Tensor o, Tensor lse, Tensor q, const KvBlocks& kv, Tensor q_pos, double scale) override {
    DeviceAccess open;
    true_tiers("attention_forward", o, lse, q, q_pos);
    kv_side("attention_forward", q, kv);
    in_->attention_forward(o, lse, q, kv, q_pos, scale);
  }
  void attention_backward(Tensor dq, const KvBlocks& dkv, Tensor dout, Tensor q, const KvBlocks& kv, Tensor o,
                          Tensor lse, Tensor q_pos, double scale) override {
    DeviceAccess open;
    true_tiers("attention_backward", dq, dout, q, o, lse, q_pos);
    kv_side("attention_backward", q, kv);
    kv_side("attention_backward", q, dkv);
    in_->attention_backward(dq, dkv, dout, q, kv, o, lse, q_pos, scale);
  }
  void attention_merge(Tensor o, Tensor lse, Tensor o2, Tensor lse2, int64_t row0) override {
    DeviceAccess open;
    true_tiers("attention_merge", o, lse, o2, lse2);
    in_->attention_merge(o, lse, o2, lse2, row0);
  }
  CeResult linear_cross_entropy_forward(Tensor lse, Tensor h, Tensor w, Tensor targets, int32_t ignore_index) override {
    DeviceAccess open;
    true_tiers("linear_cross_entropy_forward", lse, h, w, targets);
    return in_->linear_cross_entropy_forward(lse, h, w, targets, ignore_index);
  }
  std::vector<double> target_logits(Tensor h, Tensor w, Tensor targets, int32_t ignore_index) override {
    DeviceAccess open;
    true_tiers("target_logits", h, w, targets);
    return in_->target_logits(h, w, targets, ignore_index);
  }
  void linear_cross_entropy_backward(Tensor dh, Tensor dw, Tensor h, Tensor w, Tensor targets, Tensor lse,
                                     int32_t ignore_index, double grad_scale) override {
    DeviceAccess open;
    true_tiers("linear_cross_entropy_backward", dh, dw, h, w, targets, lse);
    in_->linear_cross_entropy_backward(dh, dw, h, w, targets, lse, ignore_index, grad_scale);
  }
  CeResult linear_cross_entropy_fused(Tensor lse, Tensor dh, Tensor h, Tensor w, Tensor targets, int32_t ignore_index,
                                      double grad_scale) override {
    DeviceAccess open;
    true_tiers("linear_cross_entropy_fused", lse, dh, h, w, targets);
    return in_->linear_cross_entropy_fused(lse, dh, h, w, targets, ignore_index, grad_scale);
  }
  CeResult linear_cross_entropy_trained(Tensor lse, Tensor dh, Tensor dw, Tensor h, Tensor w, Tensor targets,
                                        int32_t ignore_index, double grad_scale) override {
    DeviceAccess open;
    true_tiers("linear_cross_entropy_trained", lse, dh, dw, h, w, targets);
    return in_->linear_cross_entropy_trained(lse, dh, dw, h, w, targets, ignore_index, grad_scale);
  }
  void adamw_step(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamWConfig& cfg) override {
    DeviceAccess open;
    true_tiers("adamw_step", param, grad, m, v);
    in_->adamw_step(param, grad, m, v, cfg);
  }
  void adamw8bit_step(Tensor param, Tensor grad, Tensor m_codes, Tensor m_absmax, Tensor v_codes, Tensor v_absmax,
                      const AdamWConfig& cfg) override {
    DeviceAccess open;
    true_tiers("adamw8bit_step", param, grad, m_codes, m_absmax, v_codes, v_absmax);
    in_->adamw8bit_step(param, grad, m_codes, m_absmax, v_codes, v_absmax, cfg);
  }
  void svd_basis(Tensor out, Tensor g, bool right) override {
    DeviceAccess open;
    true_tiers("svd_basis", out, g);
    in_->svd_basis(out, g, right);
  }

 private:
  std::unique_ptr<Ops> in_;
};

}  // namespace

std::unique_ptr<Ops> make_strict_ops(std::unique_ptr<Ops> inner) { return std::make_unique<StrictOps>(std::move(inner)); }

}  // namespace oomless
