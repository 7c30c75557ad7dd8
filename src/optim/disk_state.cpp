#include "optim/disk_state.h"

#include <algorithm>

namespace oomless {

namespace {

// Alignment slack a slot keeps per allocation of a piece's optimizer (its state sets and scratch).
constexpr size_t kSlack = 64 * 16;
constexpr int64_t kMinPiece = int64_t{1} << 20;  // elements
constexpr int64_t kBlock = 256;                  // AdamW8bit's block: pieces start on one

}  // namespace

struct DiskState::Slot {
  Buffer mem;
  Ledger ledger;  // the sub-arena's own: the window is counted once, by `mem`
  std::unique_ptr<Arena> arena;
  std::unique_ptr<Optimizer> opt;
  size_t index = SIZE_MAX;
  std::vector<Offloader::Ticket> reads, writes;
};

DiskState::DiskState(const TrainableSet& params, Make make, std::function<bool(const Trainable&)> splittable,
                     const std::string& dir, Arena& window_arena, int window)
    : make_(std::move(make)) {
  OOM_CHECK(!params.empty(), "[optim] nothing to train: the trainable set is empty");
  OOM_CHECK(window >= 2, "[optim] the optimizer state window needs at least 2 pieces, got ", window);
  int64_t piece = kMinPiece;
  for (const Trainable& t : params)
    if (!splittable(t)) piece = std::max(piece, t.param.numel());
  piece = (piece + kBlock - 1) / kBlock * kBlock;
  // Pass 1: the pieces, and each one's state layout from its optimizer built alone (then dropped).
  for (size_t i = 0; i < params.size(); ++i) {
    const Trainable& t = params[i];
    const int64_t n = t.param.numel();
    std::vector<Piece> ps;
    if (splittable(t) && n >= 2 * piece) {
      const int64_t k = n / piece;  // k pieces, the last of piece .. 2 piece - 1 elements
      for (int64_t j = 0; j < k; ++j) ps.push_back({i, j * piece, j + 1 < k ? piece : n - j * piece, {}, {}});
    } else {
      ps.push_back({i, 0, n, {}, {}});
    }
    std::vector<Entry> es;
    for (size_t k = 0; k < ps.size(); ++k) {
      Ledger l;
      Arena a(window_arena.tier(), SIZE_MAX, l);
      const std::unique_ptr<Optimizer> o = make_(TrainableSet{piece_of(params, ps[k])}, a);
      if (names_.empty() && k == 0) name_ = o->name(), settings_ = o->settings_json();
      const std::vector<NamedTensor> st = o->state();
      if (k == 0)
        for (const NamedTensor& x : st) es.push_back({x.name, x.t.dtype, std::vector<int64_t>(x.t.dims, x.t.dims + x.t.ndim), 0, 0});
      OOM_CHECK(st.size() == es.size(), "[optim] ", t.name, ": its pieces' optimizers keep different state");
      for (size_t j = 0; j < st.size(); ++j) {
        OOM_CHECK(st[j].name == es[j].name && st[j].t.dtype == es[j].dtype, "[optim] ", t.name,
                  ": its pieces' optimizers keep different state");
        ps[k].bytes.push_back(static_cast<size_t>(st[j].t.nbytes()));
        es[j].bytes += static_cast<size_t>(st[j].t.nbytes());
      }
      slot_bytes_ = std::max(slot_bytes_, a.used() + kSlack);
    }
    for (Entry& e : es) {
      e.offset = total_;
      total_ += e.bytes;
      if (ps.size() > 1) {  // the whole tensor's shape: the parameter's, or a run (per-block scales)
        const int64_t elems = static_cast<int64_t>(e.bytes) / dtype_bytes(e.dtype, 1);
        e.shape = elems == n ? std::vector<int64_t>(t.param.dims, t.param.dims + t.param.ndim) : std::vector<int64_t>{elems};
      }
    }
    std::vector<size_t> next(es.size());
    for (size_t j = 0; j < es.size(); ++j) next[j] = es[j].offset;
    pieces_of_.emplace_back();
    for (Piece& p : ps) {
      for (size_t j = 0; j < es.size(); ++j) p.at.push_back(next[j]), next[j] += p.bytes[j];
      pieces_of_.back().push_back(pieces_.size());
      pieces_.push_back(std::move(p));
    }
    entries_.push_back(std::move(es));
    names_.push_back(t.name);
  }
  file_ = SpillFile::open(dir, std::max<size_t>(total_, 1), window_arena.ledger(), Category::optimizer);
  file_slot_ = file_->alloc_slot();
  offload_ = std::make_unique<Offloader>(file_.get());
  for (int w = 0; w < window; ++w) {
    auto s = std::make_unique<Slot>();
    s->mem = window_arena.alloc(slot_bytes_, Category::optimizer, "optimizer state window");
    s->arena = std::make_unique<Arena>(s->mem.data(), s->mem.size(), window_arena.tier(), s->ledger,
                                       window_arena.allocator());
    slots_.push_back(std::move(s));
  }
  // Pass 2: the initial state (as each optimizer starts it) into the file, through the window's first slot.
  Slot& s = *slots_[0];
  for (const Piece& p : pieces_) {
    s.opt = make_(TrainableSet{piece_of(params, p)}, *s.arena);
    const std::vector<NamedTensor> st = s.opt->state();
    for (size_t j = 0; j < st.size(); ++j) offload_->to_disk(file_slot_, st[j].t.data, p.bytes[j], p.at[j], s.arena->tier());
    offload_->wait_all();  // the window's memory is written from where it is, by the transfer engine
    s.opt.reset();
  }
}

Trainable DiskState::piece_of(const TrainableSet& params, const Piece& p) const {
  const Trainable& t = params[p.tensor];
  if (p.first == 0 && p.count == t.param.numel()) return t;
  Trainable x = t;
  x.param = Tensor(t.param, dtype_bytes(t.param.dtype, p.first), t.param.dtype, {p.count});
  x.grad = Tensor(t.grad, dtype_bytes(t.grad.dtype, p.first), t.grad.dtype, {p.count});
  return x;
}

DiskState::~DiskState() {
  // Every transfer ends before the window it reads or writes goes away.
  try {
    if (offload_) offload_->wait_all();
  } catch (const Error&) {
  }
  for (auto& s : slots_) s->opt.reset();
}

void DiskState::drain(Slot& slot) {
  for (Offloader::Ticket t : slot.writes) offload_->wait(t);
  slot.writes.clear();
}

void DiskState::load(Slot& slot, const TrainableSet& params, size_t piece) {
  drain(slot);
  slot.opt.reset();
  const Piece& p = pieces_[piece];
  slot.opt = make_(TrainableSet{piece_of(params, p)}, *slot.arena);
  slot.index = piece;
  const std::vector<NamedTensor> st = slot.opt->state();
  OOM_CHECK(st.size() == p.bytes.size(), "[optim] ", names_[p.tensor], ": the optimizer built ", st.size(),
            " state tensors where the state file holds ", p.bytes.size());
  for (size_t j = 0; j < st.size(); ++j) {
    OOM_CHECK(st[j].name == entries_[p.tensor][j].name && static_cast<size_t>(st[j].t.nbytes()) == p.bytes[j],
              "[optim] ", names_[p.tensor], ": state tensor ", st[j].name, " does not match the state file's ",
              entries_[p.tensor][j].name);
    slot.reads.push_back(offload_->from_disk(st[j].t.data, file_slot_, p.bytes[j], p.at[j], slot.arena->tier()));
  }
}

void DiskState::step_tensors(Ops& ops, const TrainableSet& params, const std::vector<size_t>& which, double lr,
                             int64_t step) {
  check_step(params, which, names_.size(), lr, step);
  std::vector<size_t> order;  // the pieces to step
  for (size_t i : which) {
    OOM_CHECK(params[i].name == names_[i] && params[i].param.numel() == pieces_[pieces_of_[i].back()].first +
                                                                          pieces_[pieces_of_[i].back()].count,
              "[optim] tensor ", i, " (", params[i].name, ") does not match the optimizer state (", names_[i], ")");
    order.insert(order.end(), pieces_of_[i].begin(), pieces_of_[i].end());
  }
  const size_t n = order.size(), W = slots_.size();
  auto slot = [&](size_t k) -> Slot& { return *slots_[k % W]; };
  // Up to W - 1 pieces ahead are being read while one is stepped; the slot a read goes to is the one
  // whose writes were issued a step earlier.
  for (size_t k = 0; k + 1 < W && k < n; ++k) load(slot(k), params, order[k]);
  for (size_t k = 0; k < n; ++k) {
    Slot& s = slot(k);
    for (Offloader::Ticket t : s.reads) offload_->wait(t);
    s.reads.clear();
    const Piece& p = pieces_[order[k]];
    s.opt->step(ops, TrainableSet{piece_of(params, p)}, lr, step);
    const std::vector<NamedTensor> st = s.opt->state();
    for (size_t j = 0; j < st.size(); ++j)
      s.writes.push_back(offload_->to_disk(file_slot_, st[j].t.data, p.bytes[j], p.at[j], s.arena->tier()));
    if (k + W - 1 < n) load(slot(k + W - 1), params, order[k + W - 1]);
  }
  for (auto& s : slots_) drain(*s);
}

std::vector<NamedTensor> DiskState::state() {
  fail("[optim] the ", name_, " state is on disk (--optim-state disk): read it through state_entries()");
}

std::vector<StWrite> DiskState::state_entries(Ops&) {  // file to the writer: no tensor memory
  std::vector<StWrite> w;
  for (const std::vector<Entry>& es : entries_)
    for (const Entry& e : es)
      w.push_back({e.name, e.dtype, e.shape, nullptr, [this, off = e.offset](void* dst, size_t o, size_t n) {
                     file_->read(file_slot_, dst, n, off + o);
                   }});
  return w;
}

void DiskState::load_state(Ops& ops, const SafetensorsFile& f) {  // file to file: no tensor memory
  check_state_file(f, state_entries(ops), name_.c_str());
  for (const std::vector<Entry>& es : entries_)
    for (const Entry& e : es) file_->write(file_slot_, f.find(e.name)->data, e.bytes, e.offset);
}

}  // namespace oomless
