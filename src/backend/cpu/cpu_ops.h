// The CPU backend: OpenMP loops with static schedules and a blocked GEMM (Gemm, runtime ISA dispatch).
// Activations are f32; matmul and embedding weights may be bf16. Every kernel is deterministic for
// any thread count: no floating-point reductions across threads except over a partition that does not
// depend on the thread count, combined in a fixed order.
#pragma once
#include <memory>
#include <vector>

#include "backend/ops.h"
#include "memory/arena.h"

namespace oomless {

class Gemm;

// Elementwise and row-wise kernels below this many elements run on the calling thread: waking the team and
// waiting at its barrier costs more than the work (a decode step's rows of a few hundred floats, some twenty
// of them a layer). Every element's operations are the same either way.
inline constexpr int64_t kParallelMin = 1 << 14;

// The cos and sin of the last rope call's positions (cpu_rope reuses them while its positions and frequencies
// repeat); at most kMaxEntries of each (512 KiB together), larger calls compute theirs as they go.
struct RopeTable {
  static constexpr int64_t kMaxEntries = 1 << 16;
  std::vector<double> inv;
  double factor = 0;
  std::vector<int32_t> pos;
  std::vector<float> cs, sn;
};

// A decode step's attention with f32 products (one position under GQA) reads keys and values in place through
// kernels of its own where the GEMM path has AVX2 + FMA, instead of Gemm::tile's packed panels: the same bits.
// On unless OOMLESS_DECODE_DIRECT=0; benchmarks switch it to compare the two. Not while attention runs.
bool decode_direct_kernels();
void set_decode_direct_kernels(bool on);

class CpuOps final : public Ops {
 public:
  // Scratch memory (GEMM packing buffers, attention tiles, CE chunks) is charged to `workspace`
  // under Category::workspace; null gives a private unlimited arena.
  explicit CpuOps(Arena* workspace);
  ~CpuOps() override;
  const char* name() const override { return "cpu"; }
  DType act_dtype() const override { return DType::f32; }

  void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool accumulate) override;
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
  CeResult linear_cross_entropy_fused(Tensor lse, Tensor dh, Tensor h, Tensor w, Tensor targets, int32_t ignore_index,
                                      double grad_scale) override;
  CeResult linear_cross_entropy_trained(Tensor lse, Tensor dh, Tensor dw, Tensor h, Tensor w, Tensor targets,
                                        int32_t ignore_index, double grad_scale) override;
  void adamw_step(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamWConfig& cfg) override;
  void adamw8bit_step(Tensor param, Tensor grad, Tensor m_codes, Tensor m_absmax, Tensor v_codes, Tensor v_absmax,
                      const AdamWConfig& cfg) override;
  void svd_basis(Tensor out, Tensor g, bool right) override;
  std::array<size_t, 2> matmul_workspace(int64_t M, int64_t N, int64_t K, bool bf16) const override;
  size_t attention_workspace(bool backward, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t key_blocks,
                             int64_t block_len, DType kv_dtype, bool bf16_products) const override;
  size_t cross_entropy_workspace(CeCall call, int64_t T, int64_t E, int64_t V, bool w_read_as_bf16, bool w_widened,
                                 std::vector<std::array<int64_t, 3>>* products = nullptr) const override;

  // Scratch from the workspace arena (Category::workspace).
  Buffer scratch(size_t bytes, const char* what);
  Arena& workspace() { return *ws_; }
  Gemm& gemm() { return *gemm_; }

 private:
  std::unique_ptr<Ledger> own_ledger_;
  std::unique_ptr<Arena> own_arena_;
  Arena* ws_;
  std::unique_ptr<Gemm> gemm_;
  RopeTable rope_table_;
};

}  // namespace oomless
