// The paged key/value store of chunk-recurrent training (ChunkKv): pages of P positions hold one layer's
// post-RoPE keys and values (K (Hkv, P, D) then V, the block layout the attention kernels read) and, in
// backward, their gradients (act dtype: fp32 on the CPU backend). Where the pages of past chunks live is
// --kv-offload:
//   none  Device (on a CPU run: the working-set RAM);
//   host  Host RAM; attention streams them through a fixed double-buffered window on Device;
//   disk  spill files (SpillFile, O_TMPFILE under --spill-dir: one for keys and values, one for their
//         gradients); the same Device window.
// --kv-dtype bf16 stores the history's keys and values as bf16 in every tier (half the bytes and the
// traffic); the attention kernels read bf16 pages as they are, and the gradients stay fp32.
// A chunk's history is streamed one window (at most C/P pages) at a time: attention over its own keys
// first, then over each window in order, merged with attention_merge; the backward runs per window with
// the merged O and LSE, accumulating dK/dV into the window's gradient pages, which then go back to their
// tier. Every mode makes the same calls on the same bytes in the same order, so the results are bitwise
// identical across modes. The schedule is known ahead: while window j is computed, window j + 1 is already
// being fetched (Offloader tickets); stats() says how long compute waited for transfers.
//
// Dense (sparse_pages 0): the windows are the earlier chunks, whole. Page-sparse (sparse_pages k > 0):
// each page keeps a summary of its keys, written when the page is stored (the mean over its positions, or
// the per-dimension min and max as in Quest). Each query page (P queries of the chunk) scores every earlier
// page by its summed query q_sum (over the page's queries) against the summary, summed over heads:
//   mean:    sum_h q_sum[h] . mean[h / group]
//   minmax:  sum_h sum_d max(q_sum[h][d] min[h / group][d], q_sum[h][d] max[h / group][d])
// and reads its k best (ties: the earlier page) plus the first sink_pages pages; its own chunk it always
// reads whole (causal). One selection per (layer, chunk, query page), made at the layer's first forward of
// the chunk and replayed by the recompute and the backward, so all three see the same pages; the backward
// accumulates dK/dV only into them. Only the union of the chunk's selections is fetched, in windows of up
// to C/P pages in page order; within a window, consecutive query pages with the same pages share one
// attention call. When every earlier page is selected the windows are the earlier chunks and every query
// page shares them, so the calls, and the results, are exactly the dense ones.
//
// Memory: everything is reserved at construction for sequences of up to max_T tokens: the history's pages
// in their tier (none: Device, host: Host; disk: the file grows on demand), the Device windows and the
// merge scratch, and with sparse_pages the summaries (Device, 1/(2P) of the keys' and values' bytes, twice
// that for minmax) and the selections (Host), so a run that does not fit fails at setup. Device memory in
// host/disk modes does not depend on T, but for the summaries.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "io/json.h"
#include "kv/chunk_kv.h"
#include "memory/offloader.h"
#include "memory/page_pool.h"
#include "memory/spill_file.h"

namespace oomless {

enum class KvOffload { none, host, disk };
KvOffload parse_kv_offload(std::string_view s);  // "none", "host", "disk"; anything else: an error naming them
const char* kv_offload_name(KvOffload m);

enum class PageSummary { mean, minmax };
PageSummary parse_page_summary(std::string_view s);  // "mean", "minmax"; anything else: an error naming them
const char* page_summary_name(PageSummary s);

struct PagedKvOptions {
  int64_t C = 0;                 // chunk length
  int64_t P = 0;                 // page length; divides C
  KvOffload offload = KvOffload::none;
  std::string spill_dir;         // disk: where the spill file goes (must exist, not tmpfs)
  IoMode io = IoMode::automatic;
  int64_t sparse_pages = 0;      // k: each query page reads its k best earlier pages (0: all, dense)
  int64_t sink_pages = 1;        // with sparse_pages: the first pages every query page reads
  PageSummary summary = PageSummary::minmax;
  // Storage of the history's keys and values in every tier: f32 (the act dtype), bf16 (rounded to
  // nearest even when a chunk is stored) or f8_e4m3 (scaled, see Fp8Stats); the attention kernels read
  // narrow pages as they are. Their gradients stay in the act dtype.
  DType kv_dtype = DType::f32;
  // Selections outlive the sequence: a later one replays the first one's (same length). For finite
  // differences with the selection fixed, and for analysis.
  bool keep_selection = false;
};

// f8_e4m3 pages, with delayed scaling as Transformer Engine does it: a chunk's keys (values) of a layer
// are multiplied by 448 / the largest |x| of that layer's keys (values) over the last kAmaxHistory chunks
// stored (its own amax when the history is empty) and rounded to E4M3, saturating; each page keeps the
// inverse as its scale. Counted per kind: values stored, saturated (|x| scaled past 448), flushed to zero
// (x != 0 stored as 0), and chunks whose amax was not finite (not put into the history; their pages hold
// NaN, so the step's loss is not finite and the trainer skips the step).
struct Fp8Counts {
  uint64_t values = 0, saturated = 0, flushed = 0, nonfinite_chunks = 0;
};
struct Fp8Stats {
  Fp8Counts k, v;
};

class PagedKvStore final : public ChunkKv {
 public:
  // backward: also key-gradient pages (training); without, eval only. device/host arenas must outlive it.
  PagedKvStore(const KvDims& cfg, Ops& ops, Arena& device, Arena& host, const PagedKvOptions& opt, int64_t max_T,
               bool backward);
  ~PagedKvStore() override;
  PagedKvStore(const PagedKvStore&) = delete;
  PagedKvStore& operator=(const PagedKvStore&) = delete;

  void set_bf16_products(bool on) override { bf16_products_ = on; }

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
  // The earlier pages query page qp of chunk c reads in `layer` (ascending), once selected; empty when
  // dense or not selected yet.
  std::vector<int64_t> selection(int64_t layer, int64_t c, int64_t qp) const;
  // f8_e4m3 pages: the counts so far, and the amax history (JSON, exact) for checkpoints: a resumed run
  // scales as the uninterrupted one did.
  Fp8Stats fp8_stats() const { return fp8_; }
  json::Value amax_state() const;
  void restore_amax(const json::Value& state);

 private:
  struct Window;
  static constexpr int64_t kKv = 0, kGrad = 1;  // PageTable sequence ids: key/value pages and their gradients

  // One window of history: its pages, and the row groups that read them (rows [r0, r0 + n) of the chunk
  // read the window's pages idx, in order).
  struct Group {
    int64_t r0 = 0, n = 0;
    std::vector<int32_t> idx;
  };
  struct Step {
    std::vector<int64_t> pages;
    std::vector<Group> groups;
  };

  int64_t pages_per_chunk() const { return opt_.C / opt_.P; }
  bool sparse() const { return opt_.sparse_pages > 0; }
  int64_t sel_width() const { return opt_.sparse_pages + opt_.sink_pages; }
  void summarize(int64_t layer, int64_t lp, const Tensor& k, int64_t row0);
  void select(int64_t layer, const Tensor& q);
  std::vector<Step> plan(int64_t layer, int64_t Tc) const;
  void start_fetch(Window& w, int64_t layer, const std::vector<int64_t>& pages, bool grads);
  void finish_fetch(Window& w);
  KvBlocks blocks_of(Window& w, bool grads, const std::vector<int32_t>& idx);
  void write_back_grads(Window& w);
  void release(int64_t seq, int32_t layer, int64_t lpage);
  void settle(std::vector<Offloader::Ticket>& tickets);

  KvDims cfg_;
  Ops& ops_;
  PagedKvOptions opt_;
  bool bf16_products_ = false;
  bool backward_;
  PageShape shape_, gshape_;  // key/value pages; their gradients' pages
  std::unique_ptr<PagePool> home_, ghome_;  // none: Device, host: Host; null in disk mode
  std::unique_ptr<PagePool> win_, gwin_;    // host/disk: the Device windows (keys, gradients) and staging
  std::unique_ptr<SpillFile> spill_, gspill_;  // disk: key/value pages (category kv), gradients (kv_grad)
  std::unique_ptr<Offloader> off_;
  PageTable table_;
  std::vector<std::unique_ptr<Window>> kv_win_, grad_win_, own_win_, stage_;
  int next_stage_ = 0;
  Buffer scratch_;
  Tensor o2_, lse2_, dq2_;  // (C, H, D), (H, C), (C, H, D)
  int64_t max_T_ = 0, max_chunks_ = 0, hist_pages_ = 0;  // hist_pages_: per layer, for max_T
  Buffer summ_;                 // sparse: (L, hist_pages_, 1 or 2, Hkv, D) f32 summaries
  Buffer sel_, sel_n_;          // sparse: (L, max_chunks_, C/P, sel_width()) page ids; (L, max_chunks_, C/P) counts
  Buffer sel_dev_;              // sparse: one chunk's (C/P, sel_width()) ids and (C/P) counts where page_select runs
  std::vector<uint8_t> made_;   // sparse: (L, max_chunks_) selection made
  std::vector<std::vector<float>> amax_;  // fp8: per (layer, K | V), the last kAmaxHistory chunks' amax
  Fp8Stats fp8_;
  float quantize_chunk(int64_t layer, int kind, const Tensor& x);  // fp8: the chunk's scale (and counts)
  int64_t T_ = 0, chunk_ = 0;
};

}  // namespace oomless
