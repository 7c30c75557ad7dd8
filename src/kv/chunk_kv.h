// What the chunk-recurrent schedule needs from a key/value store: attention of one chunk's queries over
// its own keys (held by the model, (Hkv, T, D)) and over every earlier chunk's keys (held by the store),
// forward and backward, and a place to keep each chunk's keys for the chunks after it.
//
// The model drives the schedule (Model::chunked_step, Model::chunked_eval) and calls, per sequence:
// begin(T, C); per chunk c: set_chunk(c), then per layer store / forward / backward; chunk_done(c) when
// chunk c's backward has finished (its keys and key gradients are never needed again); end(). The store
// decides where pages live (Device, Host, Disk) and when they move; it must give the same bits whatever it
// decides: every attention call sees the same blocks in the same order.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace oomless {

// The model's sizes a store needs: layers, query heads, key/value heads, head dimension.
struct KvDims {
  int64_t L = 0, H = 0, Hkv = 0, D = 0;
};

class ChunkKv {
 public:
  virtual ~ChunkKv() = default;

  // bf16 compute: attention's products take bf16 operands (KvBlocks::bf16_products). The model sets it
  // before each sequence.
  virtual void set_bf16_products(bool on) = 0;
  // A new sequence of T tokens in chunks of C (the last one T - (n-1) C tokens).
  virtual void begin(int64_t T, int64_t C) = 0;
  // The chunk the next calls are about; its queries and keys are at positions c*C ...
  virtual void set_chunk(int64_t c) = 0;
  // Keep the current chunk's keys and values of `layer` (post-RoPE, (Hkv, Tc, D)) for later chunks.
  virtual void store(int64_t layer, Tensor k, Tensor v) = 0;
  // o (Tc, H, D), lse (H, Tc) = causal attention of q (Tc, H, D) at positions pos over the chunk's own k, v
  // ((Hkv, Tc, D), causal) and every key of the earlier chunks.
  virtual void forward(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos) = 0;
  // dq (=); dk, dv (Hkv, Tc, D) (+=) get the chunk's own key gradients: what later chunks left for them
  // plus this chunk's share; earlier chunks' key gradients accumulate in the store.
  virtual void backward(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
                        Tensor o, Tensor lse, Tensor pos) = 0;
  // Chunk c will not be read again (its backward is done): free its pages.
  virtual void chunk_done(int64_t c) = 0;
  // The sequence is over: free everything.
  virtual void end() = 0;
};

}  // namespace oomless
