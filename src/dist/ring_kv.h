// Context parallel (`train --context-parallel N` under mpirun): the N ranks hold consecutive slices of each
// sequence, rank r the T tokens at positions [r T, (r + 1) T), and run the model on their slice at once,
// layer by layer. Attention is the only place a slice needs the others: its queries see the keys of every
// earlier slice. RingKv is the ChunkKv the model's chunked pass talks to (one chunk: the slice), so the
// model itself is unchanged:
//   forward  a rank posts its layer's keys and values to every later rank and the receives of the earlier
//            ones (dist::isend / irecv), attends over its own slice (causal) while they travel, then over each
//            earlier slice as it needs it, nearest first, merging each into O and lse (attention_merge);
//   backward the keys and values travel again (nothing is kept between the passes: a rank holds one earlier
//            slice on the Device at a time); the own slice's backward first (dq, and its keys' share of dk,
//            dv), then each earlier slice's (its dq added, its key gradients sent back to its rank); last,
//            each rank adds the later ranks' gradients for its keys in rank order.
// The order of every sum is fixed, so a rerun gives the same bits; the 1-rank run's results within fp32
// rounding. Per layer and step the ranks move N (N - 1) / 2 blocks of keys and values twice and as many
// gradient blocks: rank r receives r blocks each time and sends N - 1 - r (and r gradient blocks), the causal
// half of a ring's traffic. The parameters' gradients are summed over the ranks as data parallel sums them.
//
// Page-sparse (RingOptions::pages, `--sparse-pages k` beside --context-parallel): each query page of P rows reads its
// own slice and the k best earlier pages beside the first `sinks`, as chunk-recurrent training with chunks of a
// slice reads its store (PagedKvStore), and only the pages some query page of a later rank selected travel:
// forward, a rank sends its pages' summaries to the later ranks, selects among the earlier ranks' (page_select),
// asks each earlier rank for the union of its pages selected, serves the later ranks' asks, and attends over the
// pages that arrive; backward, the same pages travel again (the selection and the asks kept from the forward) and
// their key gradients go back to their ranks, which add them in rank order. Bytes a step: the summaries, the asks,
// and the selected pages twice with their gradients once, instead of every earlier slice.
//
// Zigzag (RingOptions::zigzag, `--cp-split zigzag`): the sequence in 2N pieces of h = T / 2 tokens, rank r holding
// pieces r and 2N - 1 - r (positions [r h, (r + 1) h) and [(2N - 1 - r) h, (2N - r) h)), so every rank's queries
// see as many keys (the causal split gives the last rank N times the first one's attention work). A rank's first
// piece is read by every later rank's queries and its second by the earlier ranks' second pieces: it sends its
// first piece to the later ranks and both to the earlier ones, attends over its own two pieces (causal), each
// earlier rank's first piece (every row) and each later rank's two pieces (its second piece's rows), and the key
// gradients go back the same way, added by their rank in rank order. Bytes a layer: N (N - 1) h-blocks twice
// (h-blocks of keys and values) against the causal split's N (N - 1) / 2 slices; the same traffic per rank.
#pragma once

#include <vector>

#include "backend/ops.h"
#include "dist/comm.h"
#include "kv/chunk_kv.h"
#include "memory/arena.h"

namespace oomless {

// Page-sparse selection over the earlier slices (pages = 0: dense), or the zigzag split.
struct RingOptions {
  int64_t P = 0;      // rows of a page; divides the slice
  int64_t pages = 0;  // the best earlier pages each query page reads beside the sinks
  int64_t sinks = 1;  // the first pages of the sequence every query page reads
  int64_t S = 2;      // summary rows a page: 1 mean, 2 minimum and maximum
  bool zigzag = false;  // pieces r and 2N - 1 - r (dense only)
};

class RingKv final : public ChunkKv {
 public:
  // Transient blocks come from `device` (an earlier slice's keys and values, its gradients, a partial O or
  // dq) and `host` (the messages), as workspace. `ranks`: the ring's size; the ranks make consecutive rings
  // of it (ranks [g ranks, (g + 1) ranks) share a sequence: context parallel beside data parallel), this rank
  // holding slice dist::rank() % ranks of its ring's. 0: every rank in one ring.
  RingKv(const KvDims& dims, Ops& ops, Arena& device, Arena& host, int ranks = 0, RingOptions options = {});
  int index() const { return r_; }  // this rank's slice
  int ranks() const { return n_; }
  // The positions of this rank's tokens of a T-token sequence: [first, first + T / N) or, zigzag, two pieces of
  // T / (2N) at first and second (second < 0: one piece).
  int64_t first(int64_t T) const;
  int64_t second(int64_t T) const;

  void set_bf16_products(bool on) override { bf16_ = on; }
  void begin(int64_t T, int64_t C) override;
  void set_chunk(int64_t c) override;
  void store(int64_t, Tensor, Tensor) override {}  // nothing kept: each call brings the earlier slices' keys
  void forward(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos) override;
  void backward(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o,
                Tensor lse, Tensor pos) override;
  void chunk_done(int64_t) override {}
  void end() override {}

  // The most bytes of transient buffers a call holds at once (the estimate's) on rank `rank` of `ranks` of a
  // ring: Device, beside the attention call's own scratch; Host, the messages in flight.
  static size_t device_bytes(const KvDims& d, int64_t T, DType kv, DType grad, int rank = 1,
                             const RingOptions& options = {});
  static size_t host_bytes(const KvDims& d, int64_t T, int rank, int ranks, DType kv, DType grad,
                           const RingOptions& options = {});

 private:
  // One call's traffic: this rank's keys and values sent to the later ranks, the earlier ranks' received into
  // `host` (slot s: rank s's; this rank's at slot rank), and a Device block the arrived ones go to in turn.
  struct Ring {
    Buffer host, dev;
    int64_t blk = 0;
    std::vector<dist::Request> recvs, sends;
  };
  void post(int64_t layer, int kind, Tensor k, Tensor v, Ring* ring);
  // Rank s's keys and values once here, on the Device: a one-block table.
  KvBlocks arrived(int s, Ring* ring, DType dtype, KvBlock* block);
  // Page-sparse: the same calls (RingOptions).
  void forward_sparse(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos);
  void backward_sparse(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
                       Tensor o, Tensor lse, Tensor pos);
  // Zigzag: the same calls.
  void forward_zigzag(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos);
  void backward_zigzag(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
                       Tensor o, Tensor lse, Tensor pos);
  // Zigzag: this rank's keys and values as pieces (first keys, first values, second keys, second values; each
  // (Hkv, h, D)) into dst.
  void pack_pieces(char* dst, Tensor k, Tensor v);
  // Zigzag: the own two pieces of (Hkv, T, D) tensors a and b (keys and values, or their gradients) as blocks.
  void own_pieces(const Tensor& a, const Tensor& b, KvBlock* out) const;
  // Zigzag: this rank's pieces packed at `at` and sent (the first to each later rank, both to each earlier one).
  std::vector<dist::Request> send_pieces(int64_t layer, int kind, Tensor k, Tensor v, char* at);
  // Rank s's pages this rank asked for (sorted, the page's place in s's slice), from `layer`'s selection.
  std::vector<int32_t> asked_of(int64_t layer, int s) const;
  // Pages `list` of k and v ((Hkv, T, D) each) into `dst` as blocks: page i at dst + i * page bytes, its keys
  // (Hkv, P, D) then its values.
  void pack_pages(char* dst, const std::vector<int32_t>& list, Tensor k, Tensor v);

  KvDims d_;
  int n_ = 1, r_ = 0, base_ = 0;  // the ring's size, this rank's place in it, its first rank
  Ops& ops_;
  Arena& device_;
  Arena& host_;
  bool bf16_ = false;
  int64_t T_ = 0;
  RingOptions sp_;
  std::vector<std::vector<int32_t>> sel_;                 // [layer]: (T / P, W) selected history pages, then counts
  std::vector<std::vector<std::vector<int32_t>>> served_;  // [layer][t - rank - 1]: pages sent to later rank t
};

}  // namespace oomless
