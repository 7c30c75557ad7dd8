// A frozen base whose projection matrices stay in a block-quantised encoding: the GGUF file's own
// blocks (Q4_0 ... Q6_K, Q8_0, F16, ...), each matrix copied once into the weights arena and read by the
// GEMM through Tensor::quant (dequantised while packing, never materialised as a whole). The rest of
// the model (embedding, norms, biases, LM head) stays in the ParamSet as f32.
#pragma once
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "io/gguf_model.h"
#include "memory/arena.h"
#include "model/params.h"
#include "quant/nf4.h"

namespace oomless {

// True for the seven projection weights of a block ("model.layers.N.self_attn.q_proj.weight", ...): the
// matrices a quantised base keeps quantised.
bool is_projection_weight(const std::string& hf_name);
// model.embed_tokens.weight or lm_head.weight.
bool is_embedding_or_head(const std::string& hf_name);

class SafetensorsSet;

class QuantBase {
 public:
  // Keeps the projection matrices of `tensors` (a GGUF's, HF names) quantised in `arena` and points the
  // matching views of `params` (built with those tensors not stored) at them; with `tables` the embedding
  // and LM head too.
  // Every matrix is written to `arena`'s memory through ops (write_host).
  QuantBase(Ops& ops, const std::vector<GgufHfTensor>& tensors, ParamSet& params, Arena& arena, bool tables = false);
  QuantBase() = default;
  // NF4 (bitsandbytes' layout, blocksize 64; double-quantised scales as bnb_4bit_use_double_quant) from
  // the f32 projection matrices of `f32`, bit-exact with bitsandbytes' quantize_4bit.
  void add_nf4_from(Ops& ops, const ParamSet& f32, ParamSet& params, Arena& arena, bool double_quant);
  // One matrix w (rows, cols) f32 as NF4, the view `name` of params pointed at it.
  void add_nf4_matrix(Ops& ops, const std::string& name, const float* w, int64_t rows, int64_t cols,
                      ParamSet& params, Arena& arena, bool double_quant);
  // One matrix w (rows, cols) f32 stored as bf16 (read through the same QuantMatrix path, format "bf16").
  void add_bf16_matrix(Ops& ops, const std::string& name, const float* w, int64_t rows, int64_t cols,
                       ParamSet& params, Arena& arena);
  // A bitsandbytes 4-bit checkpoint's projection matrices (weight, absmax, quant_map, nested_*,
  // quant_state), as they are stored.
  void add_bnb4_from(Ops& ops, const SafetensorsSet& files, ParamSet& params, Arena& arena);
  const char* format() const { return mats_.empty() ? "" : mats_.front().format; }
  size_t bytes() const { return bytes_; }
  int64_t matrices() const { return static_cast<int64_t>(mats_.size()); }
  // One-row products (decoding) over the GGUF matrices whose type has an integer kernel here (Q4_0, Q4_1,
  // Q8_0 with AVX2; io/gguf.h ggml_row_dot_q8) quantise the activation row to 8 bits and multiply integers,
  // as llama.cpp does (on), or read the dequantised values in f32, bitwise a many-row product (off, the
  // default). Returns how many matrices take the integer kernel.
  int64_t set_int8_activations(bool on);

  // One matrix: its GGUF type, block geometry and the llama.cpp Q/K row interleave to undo.
  struct Blocks {
    GgmlType type{};
    GgmlBlockDecoder decode = nullptr;  // the type's run-of-blocks loop (io/gguf.h)
    GgmlRowDot dot = nullptr;           // its one-row product kernel, where this CPU has one (io/gguf.h)
    GgmlRowDotQ8 dot_q8 = nullptr;      // its integer one-row kernel, where this CPU has one (io/gguf.h)
    int64_t block = 1, block_bytes = 0, row_bytes = 0;
    int64_t heads = 0, D = 0;  // 0 heads: rows as stored
  };

 private:
  std::deque<QuantMatrix> mats_;  // stable addresses: tensors point at them
  std::deque<Blocks> info_;
  std::deque<nf4::Matrix> nf4_;
  void add_nf4(Ops& ops, const std::string& name, const nf4::Matrix& m, ParamSet& params, Arena& arena);
  std::vector<Buffer> bufs_;
  size_t bytes_ = 0;
};

// The base model's weights as a run holds them: every parameter in f32, or, with keep_quantised and a
// GGUF source, the projection matrices in the file's blocks (QuantBase) and the rest in f32. Fills
// them from `src` (whose weights the caller may release afterwards).
// base_dtype: "fp32", or "nf4" / "nf4-dq" (double-quantised scales: QLoRA's --qlora) to quantise the
// projections at load, or "bf16" to store them rounded to bf16 (half the bytes; a matrix of format "bf16", as the
// bf16 tables), all refused for a GGUF, which keeps its own blocks. A bitsandbytes 4-bit folder is always read as
// NF4.
// embed_dtype: the frozen embedding and LM head (one matrix when tied): "auto" (a GGUF's own blocks when
// keep_quantised, else fp32), "fp32", or "bf16" / "nf4" (converted at load; nf4 double-quantised with
// base_dtype nf4-dq), which need keep_quantised. Read as the GEMM reads a quantised matrix: the embedding
// gathers dequantised rows, the fused cross-entropy dequantises each vocabulary chunk.
//
// held (ZeRO-3; an f32 base, trained or frozen under adapters, a quantised one refused): per param_specs entry,
// whether this rank keeps the tensor. The layers' tensors it does not keep are views into `gathered`, one layer's
// worth of storage (category weights) that every layer's other tensors share: whoever runs a layer first fills it
// (Model::on_layer_weights). gathered_copies k + 1 (up to 4): as many layers' storage, layer l's others viewing
// copy l % (k + 1), so that the next k layers of a pass can be filled while one computes (the trainer's prefetch).
// Loading still reads every tensor (the others' pass through `gathered`), so a preset's values are drawn as
// on one rank.
struct BaseWeights {
  std::unique_ptr<ParamSet> params;
  std::unique_ptr<QuantBase> quant;  // null: nothing kept quantised
  Buffer gathered;                   // held: one (or two) layers' storage for the tensors of other ranks
};
struct ModelSource;
BaseWeights load_base(ModelSource& src, Ops& ops, Arena& arena, bool keep_quantised, const std::string& base_dtype = "fp32",
                      const std::string& embed_dtype = "auto", const std::vector<bool>* held = nullptr,
                      int gathered_copies = 1);

}  // namespace oomless
