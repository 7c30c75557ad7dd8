// The paged key/value store of chunk-recurrent training (ChunkKv): pages of P positions hold one layer's
// post-RoPE keys and values (K (Hkv, P, D) then V, the block layout the attention kernels read) and, in
// backward, their fp32 gradients. Where the pages of past chunks live is --kv-offload:
//   none  Device (on a CPU run: the working-set RAM);
//   host  Host RAM; attention streams them through a fixed double-buffered window on Device;
//   disk  a spill file (SpillFile, O_TMPFILE under --spill-dir); the same Device window.
// A chunk's history is streamed one earlier chunk (C/P pages) at a time: attention over its own keys
// first, then over each earlier chunk in order, merged with attention_merge; the backward runs per
// window with the merged O and LSE, accumulating dK/dV into the window's gradient pages, which then go
// back to their tier. Every mode makes the same calls on the same bytes in the same order, so the results
// are bitwise identical across modes. The schedule is known ahead: while window j is computed, window
// j + 1 is already being fetched (Offloader tickets); stats() says how long compute waited for transfers.
//
// Memory: everything is reserved at construction for sequences of up to max_T tokens: the history's pages
// in their tier (none: Device, host: Host; disk: the file grows on demand), the Device windows and the
// merge scratch, so a run that does not fit fails at setup. Device memory in host/disk modes does not
// depend on T.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "memory/offloader.h"
#include "memory/page_pool.h"
#include "memory/spill_file.h"
#include "model/chunk_kv.h"
#include "model/config.h"

namespace oomless {

enum class KvOffload { none, host, disk };
KvOffload parse_kv_offload(std::string_view s);  // "none", "host", "disk"; anything else: an error naming them
const char* kv_offload_name(KvOffload m);

struct PagedKvOptions {
  int64_t C = 0;                 // chunk length
  int64_t P = 0;                 // page length; divides C
  KvOffload offload = KvOffload::none;
  std::string spill_dir;         // disk: where the spill file goes (must exist, not tmpfs)
  IoMode io = IoMode::automatic;
};

class PagedKvStore final : public ChunkKv {
 public:
  // backward: also key-gradient pages (training); without, eval only. device/host arenas must outlive it.
  PagedKvStore(const ModelConfig& cfg, Ops& ops, Arena& device, Arena& host, const PagedKvOptions& opt, int64_t max_T,
               bool backward);
  ~PagedKvStore() override;
  PagedKvStore(const PagedKvStore&) = delete;
  PagedKvStore& operator=(const PagedKvStore&) = delete;

  void begin(int64_t T, int64_t C) override;
  void set_chunk(int64_t c) override;
  void store(int64_t layer, Tensor k, Tensor v) override;
  void forward(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos) override;
  void backward(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o,
                Tensor lse, Tensor pos) override;
  void chunk_done(int64_t c) override;
  void end() override;

  const PagedKvOptions& options() const { return opt_; }
  // Transfers so far (zero in mode none): bytes per direction and the time compute waited on them.
  OffloadStats stats() const;
  const char* io_name() const;  // the spill file's I/O path in disk mode, else ""
  int64_t pages_in_use() const;  // K/V and gradient pages held for the history (all tiers)

 private:
  struct Window;
  static constexpr int64_t kKv = 0, kGrad = 1;  // PageTable sequence ids: key/value pages and their gradients

  int64_t pages_per_chunk() const { return opt_.C / opt_.P; }
  void start_fetch(Window& w, int64_t layer, int64_t chunk, bool grads);
  void finish_fetch(Window& w);
  KvBlocks blocks_of(Window& w, bool grads);
  void write_back_grads(Window& w);
  void release(int64_t seq, int32_t layer, int64_t lpage);
  void settle(std::vector<Offloader::Ticket>& tickets);

  ModelConfig cfg_;
  Ops& ops_;
  PagedKvOptions opt_;
  bool backward_;
  PageShape shape_;
  std::unique_ptr<PagePool> home_, ghome_;  // none: Device, host: Host; null in disk mode
  std::unique_ptr<PagePool> win_, gwin_;    // host/disk: the Device windows (keys, gradients) and staging
  std::unique_ptr<SpillFile> spill_;
  std::unique_ptr<Offloader> off_;
  PageTable table_;
  std::vector<std::unique_ptr<Window>> kv_win_, grad_win_, own_win_, stage_;
  int next_stage_ = 0;
  Buffer scratch_;
  Tensor o2_, lse2_, dq2_;  // (C, H, D), (H, C), (C, H, D)
  int64_t T_ = 0, chunk_ = 0;
};

}  // namespace oomless
