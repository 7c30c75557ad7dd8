// Context parallel (`train --context-parallel N` under mpirun): the N ranks hold consecutive slices of each
// sequence, rank r the T tokens at positions [r T, (r + 1) T), and run the model on their slice at once,
// layer by layer. Attention is the only place a slice needs the others: its queries see the keys of every
// earlier slice. RingKv is the ChunkKv the model's chunked pass talks to (one chunk: the slice), so the
// model itself is unchanged:
//   forward  every rank sends its layer's keys and values to the ranks after it; each rank attends over the
//            earlier slices' blocks and its own (causal) in one call, so its rows are those of a single
//            rank's call over the whole sequence (the key tiles fall on the same boundaries when T is a
//            multiple of the kernel's 128-key tile);
//   backward the keys and values are sent again (nothing is kept between the passes: a rank's memory holds
//            one layer's earlier blocks at a time), the attention backward gives dq, the own keys' share of
//            dk, dv and the earlier blocks' gradients, which go back to their ranks; each rank adds what the
//            later ranks sent for its keys in rank order (deterministic: bitwise the same run to run).
// Per layer and step the ranks move N (N - 1) / 2 blocks of keys and values twice (forward, backward) and as
// many gradient blocks: rank r receives r blocks each time and sends N - 1 - r, the causal half of a ring's
// traffic. The sends are not yet overlapped with attention. The parameters' gradients are summed over the
// ranks as data parallel sums them.
#pragma once

#include <vector>

#include "backend/ops.h"
#include "kv/chunk_kv.h"
#include "memory/arena.h"

namespace oomless {

class RingKv final : public ChunkKv {
 public:
  // Transient blocks come from `device` (the gathered keys and values, the earlier blocks' gradients) and
  // `host` (what goes through MPI), as workspace.
  RingKv(const KvDims& dims, Ops& ops, Arena& device, Arena& host);

  void set_bf16_products(bool on) override { bf16_ = on; }
  void begin(int64_t T, int64_t C) override;
  void set_chunk(int64_t c) override;
  void store(int64_t, Tensor, Tensor) override {}  // nothing kept: each call brings the earlier slices' keys
  void forward(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos) override;
  void backward(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o,
                Tensor lse, Tensor pos) override;
  void chunk_done(int64_t) override {}
  void end() override {}

  // The most bytes of transient buffers a call holds at once on rank `rank` of `ranks` (the estimate's):
  // Device, beside the attention call's own scratch; Host, around the sends.
  static size_t device_bytes(const KvDims& d, int64_t T, int rank, DType kv, DType grad);
  static size_t host_bytes(const KvDims& d, int64_t T, int ranks, DType kv, DType grad);

 private:
  // The earlier ranks' keys and values of this layer (k, v: this rank's, (Hkv, T, D)) into `held` (r blocks of
  // keys then values), and the block table over them and k, v.
  KvBlocks gather(Tensor k, Tensor v, Buffer* held, std::vector<KvBlock>* blocks);

  KvDims d_;
  Ops& ops_;
  Arena& device_;
  Arena& host_;
  bool bf16_ = false;
  int64_t T_ = 0;
};

}  // namespace oomless
