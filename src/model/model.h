// The decoder: embedding, L Llama blocks (RMSNorm -> attention with RoPE, GQA, optional q/k/v/o
// biases and Qwen3 q/k norms -> residual; RMSNorm -> SwiGLU MLP -> residual), final RMSNorm, LM head
// through the fused chunked cross-entropy. Every block has an explicit forward and backward through
// Ops; what forward keeps for backward is the SavePolicy:
//   all        keep every intermediate;
//   selective  keep matmul outputs (q, k, v, attention O and LSE, gate, up) and the residual stream,
//              recompute norms and the SwiGLU product;
//   none       keep only each block's input, recompute the block before its backward.
// All three give bitwise the same loss and gradients (kernels are deterministic).
//
// Compute dtype: fp32, or bf16 where every projection multiplies bf16 operands (activations rounded
// into a bf16 scratch; the fp32 master weights read as bf16, rounded while the GEMM packs them, so no
// weight copy exists) with fp32 accumulation and fp32 outputs; norms, RoPE, attention, softmax and the
// loss stay in fp32. Loss sums are double.
//
// One sequence per call (T tokens at positions 0..T-1). Memory for sequences up to T is reserved once
// (reserve); forward/backward allocate nothing.
//
// Chunk-recurrent training (chunked_step): the sequence is cut into chunks of C tokens and the model holds
// activations for one chunk only; keys and values of earlier chunks live in a ChunkKv store. Pass 1 runs
// the chunks in order, keeping nothing but each layer's keys and values (the last chunk, and in the last
// layer everything after the K/V projections, are skipped: no later chunk needs them). Pass 2 runs the
// chunks in reverse: recompute the chunk's forward (its own keys and values are recomputed: the same
// kernels on the same inputs give the same bits as those stored), its loss (the target of its last
// position is the next chunk's first token, as in the full sequence), and its backward, layer by layer;
// the attention backward leaves earlier chunks' key gradients in the store and takes this chunk's from it.
// Each layer keeps attention O and LSE for the chunk whatever the SavePolicy, so recomputing a block never
// sweeps the history again. With C >= T this is the full-sequence computation, bit for bit.
#pragma once
#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "memory/arena.h"
#include "memory/offloader.h"
#include "kv/chunk_kv.h"
#include "model/act_store.h"
#include "model/config.h"
#include "model/linear.h"
#include "model/lora.h"
#include "model/params.h"
#include "model/trainable.h"

namespace oomless {

// What a K/V store (kv/) needs of a model's shape.
inline KvDims kv_dims(const ModelConfig& c) { return KvDims{c.L, c.H, c.Hkv, c.D}; }

enum class SavePolicy { all, selective, none };
SavePolicy parse_save_policy(std::string_view s);
const char* save_policy_name(SavePolicy p);
// A SavePolicy per layer from "all", "selective", "none" or a list of POLICY:A-B / POLICY:A items and at most
// one bare POLICY (the layers no item names), e.g. "all:0-3,none:4-31" or "none,all:0-1": L entries, every
// layer named once. With L < 0 only the syntax is checked and each item's policy is returned.
std::vector<SavePolicy> parse_save_policies(std::string_view spec, int64_t L);
// Where each layer's saved activations wait (--act-offload): none (Device), host or disk, for every layer or as
// a list in parse_save_policies' form ("disk:0-19,none"). With L < 0 only the syntax is checked.
std::vector<Tier> parse_act_tiers(std::string_view spec, int64_t L);

enum class ComputeDType { f32, bf16 };
ComputeDType parse_compute_dtype(std::string_view s);  // "fp32"/"f32", "bf16"

struct ModelOptions {
  ComputeDType dtype = ComputeDType::f32;
  SavePolicy save = SavePolicy::all;
  // LoRA adapters on the projections (in the act dtype; the model keeps a reference). With adapters the
  // base is frozen: no base weight gradient is computed or stored, only the adapters' gradients.
  AdapterSet* adapters = nullptr;
  // Storage of the activations a training forward keeps for backward (model/act_store.h): f32 = as
  // computed (the act dtype), bf16, or f8_e4m3 with delayed scaling.
  DType act_store = DType::f32;
  // Per layer (L entries, parse_save_policies) when not empty; `save` for every layer otherwise.
  std::vector<SavePolicy> save_layers{};
  // Where the activations a layer keeps for backward wait between its forward and its backward
  // (--act-offload; full-sequence training): Device = where they are computed; Host = a copy in
  // `act_host` (the Host arena), Disk = a slot of a spill file under `spill_dir`. Off Device, the layers'
  // saved sets share a ring of kActRing Device sets: each layer's is copied out after its forward (while
  // the next layer computes) and fetched back while the layer above it runs its backward. The same bits.
  Tier act_offload = Tier::Device;
  // Per layer (L entries, parse_act_tiers) when not empty; `act_offload` for every layer otherwise. The layers
  // kept on Device hold their own sets; the others share the ring in their order.
  std::vector<Tier> act_tiers{};
  Arena* act_host = nullptr;
  std::string spill_dir{};
};

// The Device sets offloaded activations rotate through (ModelOptions::act_offload).
constexpr int64_t kActRing = 2;

// Where one block reads and writes its keys and values: (Hkv, P, D) each, the chunk's T tokens going
// to slots t0 .. t0+T-1; attention sees slots 0 .. t0+T-1. Training uses P = T, t0 = 0; generation a
// cache with P = capacity.
struct KvSlots {
  Tensor k, v;      // (Hkv, P, D)
  int64_t t0 = 0;
  // f8_e4m3 / i8 caches (generate --kv-dtype fp8|int8): a scale per (kv head, position), (Hkv, P) f32.
  Tensor k_scale{}, v_scale{};
};

class Model {
 public:
  // params: master weights in ops.act_dtype(); the model keeps a reference. Buffers come from `arena`.
  Model(const ModelConfig& cfg, Ops& ops, ParamSet& params, Arena& arena, ModelOptions opt = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opt_; }
  // --act-offload: bytes moved each way and the time compute waited for them, since reserve (none: zeros).
  OffloadStats act_offload_stats() const;
  SavePolicy save_policy(int64_t layer) const {
    return opt_.save_layers.empty() ? opt_.save : opt_.save_layers[static_cast<size_t>(layer)];
  }
  Tier act_tier(int64_t layer) const {
    return opt_.act_tiers.empty() ? opt_.act_offload : opt_.act_tiers[static_cast<size_t>(layer)];
  }
  ParamSet& params() { return params_; }

  // Gradient storage of every parameter (category grads), allocated on first call, zero-filled. Full
  // training only: with adapters the base is frozen and has no gradients (an error).
  ParamSet& grads();
  // Before grads() is first called: every layer's gradients share layer 0's storage, so the gradients of
  // the whole model never exist at once (one layer's, the embedding's, the norm's and the head's do). Only
  // for a caller that consumes and zeroes each layer's gradients in on_grads_final, one backward per step.
  void share_layer_grads();
  bool layer_grads_shared() const { return share_layer_grads_; }
  // Adapter gradients (category grads), allocated on first call; needs adapters.
  AdapterSet& adapter_grads();
  // What trains, with its gradients (allocated here): every parameter in param_specs order, or the
  // adapter tensors in PEFT order.
  TrainableSet trainable();
  void zero_grads();
  // Reserve activations for sequences of up to T tokens, for training (with backward) or inference.
  // chunked: for chunked_step/chunked_eval with chunks of up to T tokens (SavePolicy none also keeps
  // each layer's attention O and LSE).
  void reserve(int64_t T, bool for_backward, bool chunked = false);

  // Forward of one sequence: ids (T) i32, targets (T) i32 with -100 = not supervised. Returns the
  // summed cross-entropy and the supervised count. With for_backward the activations the SavePolicy
  // names are kept for backward().
  // Given the grad_scale that backward() will get (training: 1 / the step's supervised count), the LM head
  // computes its dh (and a trained head's dw) with the loss: Ops::linear_cross_entropy_fused for a frozen
  // head, _trained for a trained one, the logits once instead of twice; the loss and every gradient agree
  // with the two-pass form within fp32 rounding (on the CPU, bit for bit but a trained head's dw at large
  // vocabularies, see cross_entropy.cpp).
  CeResult forward(Tensor ids, Tensor targets, bool for_backward, std::optional<double> grad_scale = std::nullopt);
  // Backward of the last forward(for_backward = true): parameter gradients += d(grad_scale * loss_sum).
  void backward(double grad_scale);
  // `hook(group)` is called in the next backward() (in chunked_step: its last, chunk 0's) as each group of
  // gradients is final (Trainable::group): kHeadGroup, then layers L-1 .. 0, then kEmbedGroup; the hook may
  // read, step and zero those gradients. It is called once per group, then dropped. A caller that arms it
  // must have the pass it arms be the step's last accumulation into the gradients.
  using GradHook = std::function<void(int64_t group)>;
  void on_grads_final(GradHook hook) { grad_hook_ = std::move(hook); }
  // chunked_step: the hook armed by on_grads_final is called in every chunk's backward, as each group of that
  // chunk's gradients is complete (then dropped after chunk 0's): a caller that moves each layer's gradients
  // elsewhere and zeroes them (ZeRO-2) keeps one layer's at a time over chunks too.
  void hook_every_chunk(bool on) { hook_every_chunk_ = on; }
  // ZeRO-3: `fetch(layer)` is called before every pass reads a layer's weights (its forward; in backward, before
  // its recompute and backward), in the same order on every rank, to fill the tensors other ranks hold (views
  // into the engine's gathered layer, load_base). Kept until replaced; an empty one: weights all here.
  using LayerFetch = std::function<void(int64_t layer)>;
  void on_layer_weights(LayerFetch fetch) { layer_fetch_ = std::move(fetch); }
  // --act-dtype bf16 / fp8: the narrow storage of saved activations (its counts and amax history); null
  // when they are kept as computed.
  ActStorage* act_storage() { return act_storage_.get(); }
  // Logits (T, V) of the last forward into host memory `out` (act dtype), for tests and small T: computed
  // in slices of rows into a device buffer of at most ~16 MiB (workspace, freed on return) and downloaded.
  void logits(Tensor out);
  // Per-token cross-entropy of the last forward (T values; 0 for unsupervised rows), in double.
  std::vector<double> token_losses();

  // DoRA: keep the norms n of the last sequence instead of taking them again from the adapter at the next
  // (g = m / n still follows m): for finite differences of the gradient, which holds n constant as PEFT does.
  void hold_dora_norms(bool hold) { hold_dora_ = hold; }

  // The seed of the next training passes' LoRA dropout masks (one per sequence of a step).
  void set_dropout_seed(uint64_t seed) { dropout_seed_ = seed; }

  // Chunk-recurrent forward and backward of one sequence (see the top of this file): parameter gradients
  // += d(grad_scale * loss_sum). Needs reserve(C, true, true). Returns the summed loss and its count.
  // t0: the position of ids[0] (a context-parallel rank's slice of a longer sequence; 0 otherwise). t1 >= 0: the
  // ids are two pieces of T / 2 (a zigzag slice), the second at position t1 (one chunk: C >= T).
  CeResult chunked_step(Tensor ids, Tensor targets, int64_t C, ChunkKv& kv, double grad_scale, int64_t t0 = 0,
                        int64_t t1 = -1);
  // Forward only, chunk by chunk (evaluation of sequences longer than what fits at once). Needs
  // reserve(C, false, true) or more.
  // token_losses, when given, receives the cross-entropy of every position (0 where unsupervised).
  CeResult chunked_eval(Tensor ids, Tensor targets, int64_t C, ChunkKv& kv, std::vector<double>* token_losses = nullptr,
                        int64_t t0 = 0, int64_t t1 = -1);

  // Gradient-free forward of T new tokens at positions t0.. with a KV cache per layer, for generation:
  // logits_last (V, host memory, act dtype) = logits of the last new token, through a device buffer of V
  // values the model keeps (workspace, "decode logits").
  void decode_forward(Tensor ids, int64_t t0, std::vector<KvSlots>& cache, Tensor logits_last);

 private:
  struct Acts;
  struct Scratch;
  // What block_forward computes: everything; everything but the MLP down projection and the residual (a
  // recompute for backward), the same reusing the kept attention O and LSE (chunk mode); or only the
  // keys and values (the last layer in pass 1).
  enum class Pass { full, recompute, recompute_keep_attention, kv_only };
  void block_forward(int64_t layer, Acts& a, const KvSlots& kv, Tensor pos, Tensor x_out, Pass pass);
  void block_backward(int64_t layer, Acts& a, Tensor pos, Tensor dx);
  void recompute_for_backward(int64_t layer, Acts& a, Tensor pos);
  Acts acts_for_layer(int64_t layer);
  // Narrow saved activations: after a training forward of `layer`, its work tensors into the layer's
  // narrow copies (q, k, v were stored in place before attention: stash_in_place); before its backward,
  // back.
  bool narrow_saved() const;
  void stash_layer(int64_t layer, const Acts& a);
  void stash_in_place(int64_t layer, ActKind kind, Tensor x);
  void unstash_layer(int64_t layer, Acts& a);
  static std::array<Tensor*, kActSlots> slots_of(Acts& a);  // by slot (model/act_store.h)
  // --act-offload: before layer l's training forward, its ring set is free (the copy-out of the layer that
  // used it before has finished); after it, the set is copied out. In backward: before layer l, its set is
  // back; after it, the fetch of the layer kActRing below is issued (into the set l just released).
  bool act_offloading() const;
  void act_offload_before_forward(int64_t layer);
  void act_offload_after_forward(int64_t layer);
  void act_offload_before_backward(int64_t layer);
  void act_offload_after_backward(int64_t layer);
  // Embedding + all blocks for ids (T) at positions pos; K/V into `cache` at t0 when given. Returns the
  // last residual state (T, E).
  Tensor run_blocks(Tensor ids, Tensor pos, std::vector<KvSlots>* cache, int64_t t0);
  // Chunk mode: the forward of one chunk, ids/targets (Tc) at positions t0... with attention through kv.
  // store: hand each layer's K/V to kv.store; loss: the final norm and loss (without, the last layer stops
  // after its K/V projections). backward() then runs the chunk's backward.
  // grad_scale: as forward's.
  CeResult chunk_forward(Tensor ids, Tensor targets, int64_t t0, ChunkKv& kv, bool store, bool loss, bool for_backward,
                         std::optional<double> grad_scale = std::nullopt);
  // The final norm's output hn through the LM head: the loss and lse, and with a scale also dh and a trained
  // head's dw (fused_scale_ set).
  CeResult head_forward(Tensor lse, Tensor hn, Tensor targets, bool for_backward, std::optional<double> grad_scale);

  // Projection p of `layer` as a Linear (model/linear.h): the weight the GEMMs read, the bias, the adapter
  // and the gradients this run keeps; the LM head likewise (no bias, no adapter).
  Linear linear(int64_t layer, Proj p) const;
  Linear head_linear() const;
  // Forward of a projection (or rows of one): y (T, N) = x W^T [+ b], then + s u B^T with u = s x A^T
  // from lora_down, then DoRA's scale and bias (keeping the unscaled sum in z); with DoRA and dropout in
  // training PEFT's form (dora_dropout_forward). x is the input, x_op the same as a matmul operand.
  void project(const Linear& L, Tensor y, Tensor x, Tensor x_op, Tensor u, Tensor z);
  // Its backward for the output gradient dy: db from dy; DoRA's dm and g * dy into dz (dy itself when dy
  // may be overwritten); dx (=|+=) dy W; dW; the adapter's dB and du (=|+=) dy B. With DoRA and dropout,
  // dora_dropout_backward with t (=|+=). lora_backward_input then finishes the adapter (once per projection).
  void project_backward(const Linear& L, Tensor dy, Tensor dz, Tensor x_op, Tensor dx, bool dx_acc, Tensor u, Tensor z,
                        Tensor du, bool du_acc, Tensor t, bool t_acc);
  // Linear y (T, N) = x (T, K) . W^T (N, K) [+ b]; backward dx (=) and dW, db (+=).
  void linear_forward(Tensor y, Tensor x, Tensor wc, Tensor b);
  void linear_backward_input(Tensor dx, Tensor dy, Tensor wc, bool accumulate);
  void linear_backward_weight(Tensor dw, Tensor dy, Tensor x);
  void bias_backward(Tensor db, Tensor dy);
  // LoRA pieces of a projection (see model/lora.h): u (T, r) = s * x A^T; y += u B^T for the Linear's
  // rows; backward: dB += dy^T u and du (=|+=) dy B, then (once per projection) du *= s, dA += du^T x,
  // dx += du A.
  bool lora_on(int64_t layer, Proj p) const;
  bool dora_on(int64_t layer, Proj p) const { return dora_ && lora_on(layer, p); }
  void lora_down(const Linear& L, Tensor u, Tensor x, Tensor x_op);
  void lora_up(const Linear& L, Tensor y, Tensor u);
  void lora_backward_rows(const Linear& L, Tensor du, Tensor dy_op, Tensor u, bool accumulate);
  // pre (T, K), when given, is added to du A before the dropout's backward (DoRA with dropout).
  void lora_backward_input(const Linear& L, Tensor dx, Tensor du, Tensor x, Tensor x_op, Tensor pre = Tensor());
  // DoRA (model/lora.h): y = g * (x W^T + s u B^T) + b. dora_forward applies the scale and bias to the
  // unscaled sum in y (keeping it in z); dora_backward turns dy into dz = g * dy and accumulates the
  // magnitude's gradient. refresh_dora takes every projection's norm n and g = m / n from the current
  // adapter (once per sequence: the adapter changes only between steps).
  void dora_forward(const Linear& L, Tensor y, Tensor z);
  void dora_backward(const Linear& L, Tensor dz, Tensor dy, Tensor z);
  // DoRA with LoRA dropout in training, PEFT's form: y = x W^T + b + (g - 1) x_d W^T + g s (x_d A^T) B^T with
  // x_d = dropout(x) (the base's own output keeps the whole x). Forward: y holds x W^T (no bias), u = s x_d A^T;
  // z keeps z_d = x_d W^T + s u B^T. Backward of one Linear's rows: dm from dy and z_d, dx (+)= dy W for the
  // base, du (+)= (g dy) B with dB, and t (+)= (g dy - dy) W, which lora_backward_input(..., pre = t) adds to
  // du A before the dropout's backward.
  void dora_dropout_forward(const Linear& L, Tensor y, Tensor x, Tensor u, Tensor z);
  void dora_dropout_backward(const Linear& L, Tensor dy, Tensor z, Tensor u, Tensor dx, bool dx_acc, Tensor t,
                             bool t_acc, Tensor du, bool du_acc);
  void refresh_dora();
  // LoRA dropout (PEFT's lora_dropout, on the adapter's input x, training only): the mask of projection p
  // of `layer` is drawn from the step's seed and the element's absolute position in the sequence, so the
  // recompute, the backward and chunk-recurrent runs see the same one.
  bool dropout_on() const { return training_ && lora_dropout_ > 0; }
  uint64_t dropout_seed(int64_t layer, Proj p) const;
  Tensor dropped(const Linear& L, Tensor x);  // dropout(x) as a matmul operand
  void ensure_grads();
  Tensor as_operand(Tensor x, int slot);  // x itself (fp32) or its bf16 copy in scratch slot 0/1 (2/3: (T, r))

  ModelConfig cfg_;
  Ops& ops_;
  ParamSet& params_;
  Arena& arena_;
  ModelOptions opt_;
  DType act_;
  std::unique_ptr<ParamSet> grads_;
  std::unique_ptr<AdapterSet> agrads_;
  // Gradients of the modules trained beside adapters (modules_to_save): embed, head (one matrix when tied).
  std::unique_ptr<ParamSet> sgrads_;
  Tensor g_embed_, g_head_;
  std::vector<LayerLora> aread_;  // the adapter tensors matmuls read (as bf16 in bf16 mode)
  LayerParams no_grads_;          // a frozen layer's gradients: all empty
  int64_t lora_r_ = 0;
  double lora_scale_ = 0, lora_dropout_ = 0;
  // DoRA: per layer and projection the base's row norms ||W_j|| (fixed), and the step's n and g = m / n;
  // scratch for A W^T (r, N), A A^T (r, r) and B A A^T (N, r).
  struct DoraRows {
    Tensor wn, n, g;
  };
  bool dora_ = false, hold_dora_ = false;
  std::vector<Buffer> dora_bufs_;
  std::vector<std::array<DoraRows, kProjCount>> dora_rows_;
  Tensor dora_p_, dora_aa_, dora_q_;
  uint64_t dropout_seed_ = 0;
  bool training_ = false;  // a training pass (dropout on) rather than evaluation or generation
  int64_t row0_ = 0;       // the absolute position of the current pass's first token (chunks)
  int64_t pos1_ = -1;      // a zigzag slice: the position of its second piece (chunked_step / chunked_eval)
  // The weights matmuls and the LM head read: the master tensors, or in bf16 mode the same tensors read
  // as bf16 (Tensor::as_bf16), rounded while the GEMM packs them, so no copy is kept or refreshed.
  std::vector<LayerParams> wread_;
  Tensor head_;
  std::unique_ptr<Scratch> s_;
  Buffer decode_logits_;  // decode_forward's last-token logits where the head computes them
  int64_t T_ = 0;        // current sequence length
  int64_t cap_T_ = 0;    // reserved
  bool cap_backward_ = false;
  bool cap_chunked_ = false;
  ChunkKv* chunk_kv_ = nullptr;  // set while a chunked pass runs: attention goes through it
  bool have_forward_ = false;
  bool share_layer_grads_ = false;
  GradHook grad_hook_;
  LayerFetch layer_fetch_;
  bool hook_this_backward_ = true;  // chunked_step: only chunk 0's backward fires the hook (or every chunk's:
  bool hook_every_chunk_ = false;   // hook_every_chunk), and the hook is dropped after chunk 0's
  bool drop_hook_after_ = true;
  void grads_final(int64_t group);
  std::optional<double> fused_scale_;  // the last forward left dh for this grad_scale
  std::unique_ptr<ActStorage> act_storage_;
  bool stash_ = false;  // the current forward keeps narrow copies for backward
  // Pass 1 of chunked_step (no copies kept): q, k, v rounded all the same, so that the history's keys and
  // values, and each layer's output, are those of the full sequence.
  bool round_qkv_ = false;
};

}  // namespace oomless
