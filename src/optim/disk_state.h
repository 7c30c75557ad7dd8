// --optim-state disk: any optimizer's state kept in a spill file (Tier::Disk) instead of memory, in the
// manner of ZeRO-Infinity's NVMe offload on one machine. The state is streamed through a window of a few
// pieces' state: while the CPU threads update piece k, the Offloader reads piece k+1's state in and writes
// piece k-1's back, so memory holds `window` pieces' state and the ledger shows the rest as Disk bytes.
//
// A piece is a trainable tensor, or for a tensor the optimizer updates element by element (AdamW, and
// AdamW8bit in whole 256-element blocks: `splittable`), a run of its elements of about the size of the
// largest tensor that cannot be split (at least 1M elements, a multiple of 256, never a tail under
// 4096), so one large embedding does not set the window's size. Each piece is stepped by its own instance
// of the optimizer over that piece, built in a window slot for the step (AdamW, AdamW8bit and GaLore update
// every tensor independently of the others), so the update, the state bytes and the checkpoint file are
// bit for bit those of the optimizer holding its whole state in memory. The file holds each state tensor
// whole (its pieces one after another); checkpoints stream it from the file (StWrite::read) and a resume
// writes it back there.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "memory/offloader.h"
#include "memory/spill_file.h"
#include "optim/optimizer.h"

namespace oomless {

class DiskState final : public Optimizer {
 public:
  // Builds the optimizer over one tensor with its state from `arena`.
  using Make = std::function<std::unique_ptr<Optimizer>(const TrainableSet& one, Arena& arena)>;
  // The state file goes in `dir` (not tmpfs; SpillFile's checks); the window's memory comes from
  // `window_arena` (category optimizer); its disk bytes are recorded in that arena's ledger.
  // splittable(t): the optimizer updates t element by element (in 256-element blocks), so pieces of it
  // may be stepped apart.
  DiskState(const TrainableSet& params, Make make, std::function<bool(const Trainable&)> splittable,
            const std::string& dir, Arena& window_arena, int window = 3);
  ~DiskState() override;

  const char* name() const override { return name_.c_str(); }
  void step_tensors(Ops& ops, const TrainableSet& params, const std::vector<size_t>& which, double lr,
                    int64_t step) override;
  // The state is not in memory: throws (checkpoints use state_entries / load_state).
  std::vector<NamedTensor> state() override;
  std::vector<StWrite> state_entries(Ops& ops) override;
  void load_state(Ops& ops, const SafetensorsFile& f) override;
  json::Value settings_json() const override { return settings_; }

  size_t disk_bytes() const { return total_; }
  size_t window_bytes() const { return slot_bytes_ * slots_.size(); }
  OffloadStats io() const { return offload_->stats(); }

 private:
  struct Entry {  // one state tensor of a trainable tensor, whole
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    size_t offset = 0, bytes = 0;  // in the state file
  };
  struct Piece {
    size_t tensor = 0;               // trainable index
    int64_t first = 0, count = 0;    // elements; count = numel when the tensor is one piece
    std::vector<size_t> at, bytes;   // per Entry of the tensor: this piece's part (file offset, bytes)
  };
  struct Slot;
  Trainable piece_of(const TrainableSet& params, const Piece& p) const;
  void load(Slot& slot, const TrainableSet& params, size_t piece);  // build its optimizer, issue its reads
  void drain(Slot& slot);                                           // wait for the slot's writes

  Make make_;
  std::string name_;
  json::Value settings_;
  std::vector<std::vector<Entry>> entries_;  // per trainable tensor, in its optimizer's state() order
  std::vector<Piece> pieces_;                // in trainable order
  std::vector<std::vector<size_t>> pieces_of_;  // per trainable tensor: its pieces
  std::vector<std::string> names_;           // the trainable tensors'
  size_t total_ = 0, slot_bytes_ = 0;
  std::unique_ptr<SpillFile> file_;
  int64_t file_slot_ = -1;
  std::unique_ptr<Offloader> offload_;
  std::vector<std::unique_ptr<Slot>> slots_;
};

}  // namespace oomless
