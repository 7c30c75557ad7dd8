// Ops: every kernel the model needs, one pure-virtual entry each, so a backend that lacks a kernel
// does not compile. Backends: ref (float64 loops, the oracle used by tests), cpu (OpenMP + a blocked GEMM),
// cuda (later). The float dtype of activations is the backend's: f64 for ref, f32 for cpu; matmul and
// embedding inputs (weights) may also be bf16 on cpu. Integer inputs (ids, targets, positions) are i32.
//
// Gradient rule, said once: parameter gradients ACCUMULATE (+=) so micro-batches and chunks add up;
// activation gradients OVERWRITE (=), except where a signature says "+=" (residual stream, KV blocks).
//
// Shapes use the project names: T tokens, E width, F MLP width, H heads, Hkv kv heads, D head dim,
// V vocab, P tokens per KV block (page).
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "core/kv_block.h"
#include "core/tensor.h"

namespace oomless {

class Arena;

// Rotary embedding angles, as transformers computes them but in double precision:
// inv_freq[i] = theta^(-2i/D), then per RopeScaling (transformers' rope_type of the same name):
//   linear  every frequency divided by `factor` (position interpolation);
//   llama3  the low frequencies divided by `factor`, the band between low_freq_factor and high_freq_factor
//           interpolated smoothly;
//   yarn    a linear ramp between interpolated (/ factor) and original frequencies over the dimensions
//           whose rotations within original_max_position fall between beta_slow and beta_fast, and cos and
//           sin multiplied by attention_factor.
// Pairs are (x[i], x[i + D/2]) ("rotate_half" layout), angle = position * inv_freq[i].
enum class RopeScaling { none, linear, llama3, yarn };
const char* rope_scaling_name(RopeScaling s);  // "default", "linear", "llama3", "yarn" (rope_type)

struct RopeConfig {
  double theta = 10000.0;
  RopeScaling scaling = RopeScaling::none;
  double factor = 1.0;
  double low_freq_factor = 1.0;         // llama3
  double high_freq_factor = 4.0;        // llama3
  double original_max_position = 8192;  // llama3, yarn: the context the model was trained with
  double beta_fast = 32.0;              // yarn
  double beta_slow = 1.0;               // yarn
  bool truncate = true;                 // yarn: correction range rounded outwards to whole dimensions
  double attention_factor = 1.0;        // yarn: scales cos and sin (1 otherwise)
};

// What a scaled narrowing (Ops::cast_scaled) saw: the largest |src| (NaN when an element is not finite),
// elements saturated (|src * scale| past the format's largest finite value: clamped for f8_e4m3, inf for
// bf16 and f8_e5m2) and flushed (src != 0 stored as zero).
struct CastStats {
  double amax = 0.0;
  int64_t saturated = 0, flushed = 0;
};
// Delayed fp8 scaling (K/V pages, saved activations): how many earlier amax values a scale looks back on.
inline constexpr int kAmaxHistory = 16;

struct CeResult {
  double loss_sum = 0.0;   // sum of -log softmax(logits)[target] over supervised rows
  int64_t count = 0;       // supervised rows (target != ignore_index)
};

struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // decoupled: param -= lr * wd * param
  int64_t step = 1;           // 1-based, for bias correction
  // false: torch.optim.AdamW's order, p -= lr * (update + wd * p) with the decay on the old p; true:
  // bitsandbytes' CUDA kernels' order, p = (p - lr * update) * (1 - lr * wd) (AdamW8bit).
  bool decay_after_update = false;
};

// The block of bitsandbytes' blockwise 8-bit optimizer state: one scale per 256 consecutive elements.
inline constexpr int64_t kAdam8Block = 256;

// Whether element j survives a dropout of probability p under `seed`: a counter-based draw (splitmix64
// of seed and j, 53 bits) compared with p.
inline bool dropout_keep(uint64_t seed, int64_t j, double p) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(j) + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53 >= p;
}

class Ops {
 public:
  virtual ~Ops() = default;
  virtual const char* name() const = 0;
  // The float dtype this backend computes activations in (f64 for ref, f32 for cpu).
  virtual DType act_dtype() const = 0;

  // Workspace (Category::workspace) the kernels take from the backend's arena, so that a run's memory can be
  // added up before it starts (train/estimate.h). A backend that takes none keeps these defaults.
  // The packing buffers of a product (M, N, K) of f32 or bf16 operands: {the buffer the threads share, the
  // threads' own ones together}. Each is kept between calls and grown to the largest product seen.
  virtual std::array<size_t, 2> matmul_workspace(int64_t M, int64_t N, int64_t K, bool bf16) const {
    (void)M, (void)N, (void)K, (void)bf16;
    return {0, 0};
  }
  // Held while one attention call runs: T queries of H heads (D wide, Hkv key heads) over `key_blocks`
  // blocks of `block_len` keys stored in kv_dtype; bf16_products as KvBlocks::bf16_products.
  virtual size_t attention_workspace(bool backward, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t key_blocks,
                                     int64_t block_len, DType kv_dtype, bool bf16_products) const {
    (void)backward, (void)T, (void)H, (void)Hkv, (void)D, (void)key_blocks, (void)block_len, (void)kv_dtype,
        (void)bf16_products;
    return 0;
  }
  // Held while one fused LM head + cross-entropy call runs (h (T, E), w (V, E)): `w_read_as_bf16` under bf16
  // compute, `w_widened` when w is stored bf16 or quantised and read in f32. `products`, when given, receives
  // the (M, N, K) of the products the call runs through matmul's packing (see matmul_workspace).
  enum class CeCall { forward, backward, fused, trained };
  virtual size_t cross_entropy_workspace(CeCall call, int64_t T, int64_t E, int64_t V, bool w_read_as_bf16,
                                         bool w_widened,
                                         std::vector<std::array<int64_t, 3>>* products = nullptr) const {
    (void)call, (void)T, (void)E, (void)V, (void)w_read_as_bf16, (void)w_widened, (void)products;
    return 0;
  }

  // c (M, N) = op(a) (M, K) . op(b) (K, N), or += when accumulate. a is stored (M, K), or (K, M) when
  // ta; b is stored (K, N), or (N, K) when tb. a and b share a dtype (act dtype or bf16); c is act dtype.
  virtual void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool accumulate) = 0;

  // out (T, E) = table[ids]; table (V, E) act dtype or bf16; ids (T) i32 in [0, V).
  virtual void embedding_forward(Tensor out, Tensor ids, Tensor table) = 0;
  // dtable (V, E) += scatter of dout (T, E) by ids (T).
  virtual void embedding_backward(Tensor dtable, Tensor dout, Tensor ids) = 0;

  // out (R, E) = in * rstd * weight, rstd (R) = 1/sqrt(mean(in^2) + eps). R rows (tokens, or tokens x
  // heads for per-head q/k norms). out may alias in.
  virtual void rmsnorm_forward(Tensor out, Tensor rstd, Tensor in, Tensor weight, double eps) = 0;
  // din (R, E) = ; dweight (E) +=, or nothing when dweight is empty (a frozen weight).
  virtual void rmsnorm_backward(Tensor din, Tensor dweight, Tensor dout, Tensor in, Tensor weight, Tensor rstd) = 0;

  // out (T, H, D) = rotate(in) by the angles of pos (T); out may alias in. D even.
  virtual void rope_forward(Tensor out, Tensor in, Tensor pos, const RopeConfig& cfg) = 0;
  // din (T, H, D) = inverse rotation of dout; din may alias dout.
  virtual void rope_backward(Tensor din, Tensor dout, Tensor pos, const RopeConfig& cfg) = 0;

  // out (T, F) = silu(gate) * up.
  virtual void swiglu_forward(Tensor out, Tensor gate, Tensor up) = 0;
  // dgate, dup (T, F) = .
  virtual void swiglu_backward(Tensor dgate, Tensor dup, Tensor dout, Tensor gate, Tensor up) = 0;

  // out = a + b (any equal shapes); out may alias a or b (the residual stream).
  virtual void add(Tensor out, Tensor a, Tensor b) = 0;
  // y += alpha * x.
  virtual void axpy(Tensor y, double alpha, Tensor x) = 0;
  // x *= alpha.
  virtual void scale(Tensor x, double alpha) = 0;
  // x = value.
  virtual void fill(Tensor x, double value) = 0;

  // Memory operations: how code above backend/ moves bytes into, out of and between tensors (a device
  // backend copies across its bus here). Any dtype. The default forms are for backends whose tensors live
  // in host memory (cpu, ref).
  // dst = dst.nbytes() bytes at src (host memory).
  virtual void upload(Tensor dst, const void* src);
  // dst (host memory) = src's src.nbytes() bytes.
  virtual void download(void* dst, Tensor src);
  // dst = src: the same dtype and element count.
  virtual void copy(Tensor dst, Tensor src);
  // Strided rows (cudaMemcpy2D's shape): for r < rows, the `cols` elements at src + r * src_ld go to
  // dst + r * dst_ld (elements of their common dtype; the tensors are the memory the rows lie in and must
  // hold the last row). Gathers a kv head's page out of a chunk, a slice of each row of lse, ... in one call.
  virtual void copy_rows(Tensor dst, int64_t dst_ld, Tensor src, int64_t src_ld, int64_t rows, int64_t cols);
  // Every byte of x = 0.
  virtual void zero(Tensor x);
  // x (i32) = first, first + 1, ... (positions).
  virtual void iota(Tensor x, int32_t first);
  // Host code produces or consumes a whole tensor in place, without a second copy where the backend can:
  // write_host calls `write` once with host memory of dst.nbytes() bytes that becomes dst (a host-memory
  // backend hands out dst's own memory; a device backend a staging buffer it then uploads); read_host calls
  // `read` once with host memory holding src's bytes. The callbacks touch only the memory they are given.
  virtual void write_host(Tensor dst, const std::function<void(void* host)>& write);
  virtual void read_host(Tensor src, const std::function<void(const void* host)>& read);
  // A tensor of this backend seen by host computation (the optimizer on the host, ZeRO-Offload's shape):
  // map_to_host returns a Host-tier tensor holding t's values (a host-memory backend: t's own memory, no
  // copy; a device backend: a staging buffer it downloads into); unmap_from_host then writes the host
  // tensor's values back into t when write_back (a device backend uploads) and releases it.
  virtual Tensor map_to_host(Tensor t);
  virtual void unmap_from_host(Tensor t, Tensor host, bool write_back);

  // Page-level top-k sparse attention: the summaries of the paged K/V store's pages and the pages each query
  // page selects (backend/pages.cpp; the default forms are for backends whose tensors live in host memory).
  // out (S, Hkv, D) f32 = the summary of rows [row0, row0 + P) of keys k (Hkv, Tc, D; f32 or f64): S = 1,
  // their mean; S = 2, their per-dimension minimum, then maximum. Sums in double.
  virtual void page_summary(Tensor out, Tensor k, int64_t row0, int64_t P);
  // The history pages each query page of q (Tc, H, D; f32 or f64) reads, query page i holding rows [i P,
  // (i + 1) P). summaries (hist, S, Hkv, D) f32 are the history's pages' (page_summary). Page j >= the sinks
  // scores the sum over heads h and d of qs(h, d) mean(h / group, d) (S = 1) or max(qs min, qs max) (S = 2),
  // qs the query page's rows summed, in double (a NaN score ranks last). sel (nq, W) i32 = the first `sinks`
  // pages and the W - sinks best others (ties to the lower page), in page order; counts (nq) i32 = how many
  // (every page when hist <= W). Query pages are independent: any thread count selects the same.
  virtual void page_select(Tensor sel, Tensor counts, Tensor q, Tensor summaries, int64_t P, int64_t sinks);
  // Inverted dropout: out[i] (=, or += when accumulate) in[i] * keep(i) / (1 - p), keep(i) =
  // dropout_keep(seed, offset + i, p). The mask depends only on (seed, offset + i, p): every backend
  // and thread count draws the same one, and the backward is the same call on the output gradient.
  virtual void dropout(Tensor out, Tensor in, double p, uint64_t seed, int64_t offset, bool accumulate) = 0;
  // sum of x^2 in double, combined in a fixed order (deterministic for any thread count).
  virtual double sum_squares(Tensor x) = 0;
  // The largest |x| over x's elements (act dtype; 0 for none), NaN where any element is not finite: the amax
  // cast_scaled reports, taken before a scale is chosen (fp8 K/V chunks).
  virtual double abs_max(Tensor x) = 0;
  // dst = src converted element-wise (float dtypes; rounding to nearest even).
  virtual void convert(Tensor dst, Tensor src) = 0;
  // dst (bf16, f8_e4m3 or f8_e5m2) = src * scale rounded to nearest even as convert rounds (f8_e4m3
  // saturating at 448), for storage with a per-tensor scale; the reverse is convert then scale by 1 / scale.
  virtual CastStats cast_scaled(Tensor dst, Tensor src, double scale) = 0;
  // Row-scaled narrowing for storage written a row at a time (the decode cache): for each row n of src
  // (N, K) in the act dtype, scales[n] = amax(|row|) / qmax (qmax 448 for f8_e4m3, 127 for i8; 0 for an
  // all-zero row) and dst[n, :] = the row times 1 / scales[n], rounded to nearest even (f8_e4m3
  // saturating, i8 clamped to [-127, 127]; an all-zero row gives zero codes). dst (N, K) f8_e4m3 or i8,
  // scales (N) in the act dtype. The value of a code is its value times its row's scale; a row with a
  // non-finite element gets a non-finite scale (its values are lost, as they would be in any dtype).
  virtual void cast_rows_scaled(Tensor dst, Tensor scales, Tensor src) = 0;

  // DoRA (weight-decomposed LoRA, model/lora.h), whose weight norm is a constant of the step.
  // out (N) = ||w[j, :]||_2 of w (N, K): act dtype or block-quantised (as matmul's b), summed in double.
  virtual void row_norms(Tensor out, Tensor w) = 0;
  // n (N) = ||W_j + s (B A)_j|| = sqrt(wn_j^2 + 2 s sum_i b[j,i] p[i,j] + s^2 sum_i b[j,i] q[j,i]) from
  // wn = row_norms(W), b = B (N, r), p = A W^T (r, N), q = B (A A^T) (N, r); with b empty n = wn. g (N) = m / n.
  virtual void dora_scale(Tensor g, Tensor n, Tensor m, Tensor wn, Tensor b, Tensor p, Tensor q, double s) = 0;
  // y (T, N) = g * y + bias, per column (bias may be empty); z, when given (T, N), receives y before:
  // the unscaled W x + s B A x that the backward needs.
  virtual void dora_forward(Tensor y, Tensor z, Tensor g, Tensor bias) = 0;
  // dm (N) += sum over t of dy[t, j] z[t, j] / n_j (in a fixed order), then dz (T, N) = g * dy; dz may be dy.
  virtual void dora_backward(Tensor dz, Tensor dm, Tensor dy, Tensor z, Tensor g, Tensor n) = 0;
  // x[j, :] *= g_j for x (N, K), g (N).
  virtual void scale_rows(Tensor x, Tensor g) = 0;

  // Causal attention over a block table. q (T, H, D) at absolute positions q_pos (T); a query at
  // position p sees the keys with position <= p. H is a multiple of Hkv (GQA: query head h reads kv
  // head h / (H / Hkv)). o (T, H, D); lse (H, T) = log-sum-exp of the scaled scores (natural log), -inf
  // and o = 0 for a query that sees no key. scores = scale * q.k. Never forms a T x T buffer.
  virtual void attention_forward(Tensor o, Tensor lse, Tensor q, const KvBlocks& kv, Tensor q_pos, double scale) = 0;
  // dq (T, H, D) = ; dkv: blocks of act dtype with the same table as kv, dk and dv ACCUMULATE (+=).
  virtual void attention_backward(Tensor dq, const KvBlocks& dkv, Tensor dout, Tensor q, const KvBlocks& kv,
                                  Tensor o, Tensor lse, Tensor q_pos, double scale) = 0;

  // Combines two partial attentions of the same queries over disjoint key sets into the attention over
  // both, in place: lse' = log(e^lse + e^lse2), o' = e^(lse - lse') o + e^(lse2 - lse') o2. A -inf lse
  // (no visible key) weighs 0; both -inf gives o = 0, lse = -inf. o (T, H, D), lse (H, T); o2 (n, H, D),
  // lse2 (H, n) are the partial attention of the rows [row0, row0 + n) (n = T, row0 = 0: all of them).
  // History streamed window by window through attention_forward, merged this way, is the attention over
  // all of it (the backward needs no merge: attention_backward per window with the merged o and lse
  // gives each window's exact share of dq, dk, dv).
  virtual void attention_merge(Tensor o, Tensor lse, Tensor o2, Tensor lse2, int64_t row0) = 0;

  // Fused LM head + cross-entropy over vocabulary chunks, never a (T, V) buffer.
  // logits = h (T, E) . w (V, E)^T; lse (T) = logsumexp(logits) (0 for ignored rows);
  // targets (T) i32, rows with target == ignore_index are not supervised. The caller divides.
  virtual CeResult linear_cross_entropy_forward(Tensor lse, Tensor h, Tensor w, Tensor targets,
                                                int32_t ignore_index) = 0;
  // The target's logit of each row, on the host: out[t] = h[t] . w[targets[t]] in double, the operands as the
  // head above reads them (w's row dequantised when block-quantised; with w read as bf16, both rounded to
  // bf16 where the backend's head multiplies bf16 operands), 0 for a row whose target is ignore_index. A
  // token's loss is lse[t] minus it (Model::token_losses): the losses of the supervised rows sum to the
  // forward's loss up to its own accumulation.
  virtual std::vector<double> target_logits(Tensor h, Tensor w, Tensor targets, int32_t ignore_index) = 0;
  // With dlogits = grad_scale * (softmax - onehot(target)) on supervised rows and 0 elsewhere:
  // dh (T, E) = dlogits . w; dw (V, E) += dlogits^T . h (act dtype), skipped when dw is empty (a frozen head).
  virtual void linear_cross_entropy_backward(Tensor dh, Tensor dw, Tensor h, Tensor w, Tensor targets, Tensor lse,
                                             int32_t ignore_index, double grad_scale) = 0;
  // The forward and dh of the backward (no dw: a frozen head) in one call, when grad_scale is known before
  // the forward (training): lse and the returned loss as linear_cross_entropy_forward, dh as
  // linear_cross_entropy_backward with an empty dw, equal within fp32 rounding. This version calls the two;
  // the CPU backend computes the logits once (two GEMMs over the vocabulary instead of three).
  virtual CeResult linear_cross_entropy_fused(Tensor lse, Tensor dh, Tensor h, Tensor w, Tensor targets,
                                              int32_t ignore_index, double grad_scale) {
    const CeResult r = linear_cross_entropy_forward(lse, h, w, targets, ignore_index);
    linear_cross_entropy_backward(dh, Tensor(), h, w, targets, lse, ignore_index, grad_scale);
    return r;
  }

  // The forward and the whole backward (dh, and dw += with a trained head) in one call, when grad_scale is known
  // before the forward: lse, the loss, dh and dw as linear_cross_entropy_forward then _backward give them (the
  // CPU backend: bit for bit, or dw within fp32 rounding when it must cut the tokens finer, see
  // cross_entropy.cpp). This version calls the two; the CPU backend keeps a block of tokens' logits over the
  // whole vocabulary, so the logits are computed once (three GEMMs over the vocabulary instead of four).
  virtual CeResult linear_cross_entropy_trained(Tensor lse, Tensor dh, Tensor dw, Tensor h, Tensor w, Tensor targets,
                                                int32_t ignore_index, double grad_scale) {
    const CeResult r = linear_cross_entropy_forward(lse, h, w, targets, ignore_index);
    linear_cross_entropy_backward(dh, dw, h, w, targets, lse, ignore_index, grad_scale);
    return r;
  }

  // AdamW with bias correction and decoupled weight decay, in place on param, m, v (same shape).
  virtual void adamw_step(Tensor param, Tensor grad, Tensor m, Tensor v, const AdamWConfig& cfg) = 0;
  // bitsandbytes' blockwise 8-bit Adam (AdamW8bit) in place: m and v are u8 codes shaped like param, m
  // in the signed dynamic map and v in the unsigned one (quant/dynamic8.h), each with one scale per
  // kAdam8Block elements of the flattened tensor (m_absmax, v_absmax: ceil(n / 256), in the activation
  // dtype). Per element, with float arithmetic on cpu:
  //   g finite:  m = dec(m) * b1 + (1 - b1) g,  v = dec(v) * b2 + (1 - b2) g g,
  //              p = p + (-lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps),  then p *= 1 - lr wd
  //   otherwise: m = v = 0 and p unchanged (bitsandbytes' CUDA kernel)
  // and each block of the new m and v is encoded again with its new absmax (dynamic8.h's quantiser).
  // cfg.decay_after_update is implied.
  virtual void adamw8bit_step(Tensor param, Tensor grad, Tensor m_codes, Tensor m_absmax, Tensor v_codes,
                              Tensor v_absmax, const AdamWConfig& cfg) = 0;
  // The top-r singular vectors of g (m, n), from LAPACK's divide-and-conquer SVD (gesdd): right: out (r, n)
  // holds the first r rows of V^T; otherwise out (m, r) the first r columns of U. Each vector's sign is
  // fixed so that its entry of largest magnitude (the first, on a tie) is positive. 1 <= r <= min(m, n).
  virtual void svd_basis(Tensor out, Tensor g, bool right) = 0;
};

// "ref" or "cpu" (and "cuda" when built). workspace: the arena that scratch memory is charged to;
// null gives the backend a private unlimited one (tests). Throws for an unknown or unbuilt name.
std::unique_ptr<Ops> make_ops(std::string_view name, Arena* workspace = nullptr);

}  // namespace oomless
