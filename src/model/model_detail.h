// Model internals shared by model.cpp, block.cpp and model_run.cpp: the activation set of one block
// and the memory reserved for a sequence length.
#pragma once
#include <memory>
#include <vector>

#include "memory/offloader.h"
#include "memory/spill_file.h"
#include "model/model.h"

namespace oomless {

// The activations of one block. Which of these live in per-layer saved buffers and which in the shared
// recompute set depends on the SavePolicy (acts_for_layer). Shapes for a sequence of T tokens.
struct Model::Acts {
  Tensor x_in;            // (T, E) block input (residual stream)
  Tensor h1, rstd1;       // (T, E), (T) input norm
  Tensor q_pre, q_rstd;   // (T, H, D), (T*H): q projection before the Qwen3 q norm
  Tensor k_pre, k_rstd;   // (Hkv, T, D), (Hkv*T)
  Tensor q;               // (T, H, D) attention query (normed, rotated)
  Tensor k, v;            // (Hkv, T, D) keys (normed, rotated) and values
  Tensor o, lse;          // (T, H, D), (H, T)
  Tensor x_mid;           // (T, E) residual after attention
  Tensor h2, rstd2;       // (T, E), (T) post-attention norm
  Tensor gate, up, act;   // (T, F)
  Tensor u[kProjCount];   // (T, r) LoRA s * x A^T per adapted projection, or empty
  Tensor z[kProjCount];   // DoRA: the projection's x W^T + s u B^T before its scale, (T, N) ((Hkv, T, D) for k, v)
};

// Memory reserved for sequences of up to cap_T tokens.
struct Model::Scratch {
  std::vector<Buffer> bufs;
  Tensor pos;                                // (T) i32 positions 0..T-1
  Tensor ones;                               // (T, 1) act dtype: bias add / bias gradient through matmul
  std::vector<Tensor> layer_in;              // L + 1 residual stream states (x_L is the final hidden input)
  // Per-layer saved tensors (all / selective) or empty.
  std::vector<Acts> saved;
  Acts work;                                 // one layer's worth, for whatever is not saved
  Tensor hn, rstd_f, lse_f;                  // (T, E), (T), (T) final norm and loss
  Tensor ids, targets;                       // copies of the last forward's inputs
  Tensor proj;                               // (T, E) projection output before the residual add
  // Backward scratch.
  Tensor dx, dh, dxn;                        // (T, E)
  Tensor dq, dq_pre, d_o;                    // (T, H, D)
  Tensor dk, dv, dk_pre;                     // (Hkv, T, D)
  Tensor dgate, dup, dact;                   // (T, F)
  Tensor tmp_rows;                           // (max(T*H, Hkv*T) * D) throwaway norm output when recomputing rstd
  Tensor op[5];                              // bf16 operand copies: 0, 1, 4 max(T*max(E, F, H*D)); 2, 3 (T, r)
  int64_t op_elems = 0, op_small_elems = 0;
  Tensor du[2];                              // (T, r) LoRA input gradients (k and v need two at once)
  Tensor xdrop, dxdrop;                      // T*max(E, F, H*D): LoRA dropout's input and input gradient
  Tensor dz;                                 // (T, E) DoRA: g * dy of o_proj / down_proj (dy is the residual's)
  Tensor dora_t, dora_t2, dora_dz;           // T*max(E, F, H*D): DoRA with dropout (x_d W^T; (g dy - dy) W; g dy)
  // --act-offload (ModelOptions::act_offload / act_tiers): the layers that leave Device, in order, are
  // off_layers; the i-th one's saved[l] are views into ring set i % kActRing, and its bytes (its set) wait in
  // host[l] or spill slot disk[l] between forward and backward. The last kActRing of them stay in their ring
  // sets. off_index[l]: i, or -1 for a layer that keeps its own set on Device. Declared last: the Offloader finishes its jobs
  // before the buffers and the spill file they use go.
  std::vector<Buffer> ring;
  std::vector<size_t> act_bytes;             // per layer
  std::vector<int64_t> off_layers, off_index;
  std::vector<Buffer> host;                  // per layer (Host offload)
  std::unique_ptr<SpillFile> spill;          // Disk offload
  std::vector<int64_t> disk;                 // per layer: its spill slot, or -1
  std::vector<Offloader::Ticket> out, in;    // per layer: the copy out of its set, the fetch back
  std::unique_ptr<Offloader> off;
};

}  // namespace oomless
