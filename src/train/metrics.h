// Training metrics as JSON lines in OUT/metrics.jsonl, one object per line:
//   {"type":"train","step":N,"loss":x,"lr":x,"grad_norm":x,"tokens_per_s":x,"skipped":false,
//    "params":{"trainable":N,"trainable_bytes":B,"frozen":N,"frozen_bytes":B},
//    "memory":{"device":{"weights":{"current":B,"peak":B},...,"total":{...}},...}}
//   {"type":"eval","step":N,"loss":x,"ppl":x}
// A run over several ranks adds "ranks":{"size":N,"peak":[B per rank],"bytes_sent":[B per rank],
// "optimizer":[B per rank]} to train lines.
// memory lists, per tier, the ledger categories that have held bytes (peak > 0) and the tier's total;
// tiers that never held anything are left out. Nonfinite numbers (a skipped step's NaN norm) are
// written as null, since JSON has no NaN.
//
// Each line goes out in one write and is flushed, so a crash leaves at most one torn last line. On
// resume, truncate_after(path, checkpoint_step) drops that torn line and every line from steps after
// the checkpoint, which the resumed run writes again; construct the writer after it.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

#include "io/json.h"
#include "memory/arena.h"

namespace oomless {

class MetricsWriter {
 public:
  // Appends to out_dir/metrics.jsonl, creating the file (not the folder) when absent.
  explicit MetricsWriter(const std::string& out_dir);
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  ~MetricsWriter();

  static std::string path_in(const std::string& out_dir);  // out_dir/metrics.jsonl
  const std::string& path() const { return path_; }

  void write_step(int64_t step, double loss, double lr, double grad_norm, double tokens_per_s, bool skipped,
                  const Ledger& ledger,
                  const json::Value& kv_fp8 = json::Value(), const json::Value& act_fp8 = json::Value(),
                  const json::Value& ranks = json::Value());
  void write_eval(int64_t step, double loss, double ppl);
  // Written with every train line as "params": what trains and what is frozen, counts and bytes.
  void set_params(int64_t trainable, int64_t trainable_bytes, int64_t frozen, int64_t frozen_bytes);

  // Rewrites `path` keeping only the complete lines whose "step" is <= step, in order. The rewrite is
  // atomic (PATH.tmp, fsync, rename), so a crash during it leaves the old file or the new one. A missing
  // file is left missing. A last line without its newline, or one that does not parse, is a torn write
  // and is dropped; a line before the last that does not parse, or has no integer "step", is an error.
  static void truncate_after(const std::string& path, int64_t step);

 private:
  void append(const std::string& line);
  std::string path_;
  std::FILE* f_ = nullptr;
  json::Value params_;
};

}  // namespace oomless
