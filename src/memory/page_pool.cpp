#include "memory/page_pool.h"

#include <cstring>
#include <limits>
#include <utility>

namespace oomless {

// ---- PagePool ----

PagePool::PagePool(Arena& arena, Category cat, PageShape shape, int64_t capacity, std::string what)
    : arena_(arena), cat_(cat), shape_(shape), capacity_(capacity), what_(std::move(what)) {
  OOM_CHECK(shape.Hkv > 0 && shape.P > 0 && shape.D > 0, "[page_pool] ", what_, ": page shape (Hkv ", shape.Hkv,
            ", P ", shape.P, ", D ", shape.D, ") must be positive");
  OOM_CHECK(capacity >= 0, "[page_pool] ", what_, ": capacity ", capacity, " must be >= 0");
}

char* PagePool::page_locked(int64_t id, const char* op) const {
  OOM_CHECK(id >= 0 && id < static_cast<int64_t>(state_.size()), "[page_pool] ", what_, ": ", op, " of page id ", id,
            ", which this pool never gave out (ids 0..", static_cast<int64_t>(state_.size()) - 1, ")");
  OOM_CHECK(state_[id] == State::in_use, "[page_pool] ", what_, ": ", op, " of page id ", id,
            ", which is not allocated (freed already?)");
  return pages_[id].as<char>();
}

int64_t PagePool::place_locked(Buffer b) {
  int64_t id;
  if (!vacant_.empty()) {
    id = vacant_.back();
    vacant_.pop_back();
    pages_[id] = std::move(b);
  } else {
    id = static_cast<int64_t>(pages_.size());
    pages_.push_back(std::move(b));
    state_.push_back(State::vacant);
  }
  ++held_;
  return id;
}

int64_t PagePool::alloc() {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else {
    if (in_use_ >= capacity_)
      throw OutOfBudget("[page_pool] " + what_ + ": all " + std::to_string(capacity_) + " pages are in use (capacity " +
                        std::to_string(capacity_) + ", in use " + std::to_string(in_use_) + ", " +
                        format_bytes(shape_.page_bytes()) + " per page). Free pages first, or plan a larger capacity.");
    id = place_locked(arena_.alloc(shape_.page_bytes(), cat_, what_));
  }
  state_[id] = State::in_use;
  if (++in_use_ > peak_in_use_) peak_in_use_ = in_use_;
  return id;
}

void PagePool::free(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  page_locked(id, "free");
  state_[id] = State::free;
  free_.push_back(id);
  --in_use_;
}

void PagePool::reserve(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  OOM_CHECK(n >= 0, "[page_pool] ", what_, ": cannot reserve ", n, " pages");
  if (n > capacity_)
    throw OutOfBudget("[page_pool] " + what_ + ": cannot reserve " + std::to_string(n) + " pages, capacity is " +
                      std::to_string(capacity_) + " (" + format_bytes(shape_.page_bytes()) + " per page)");
  // Take every page first so that an arena refusal leaves the pool untouched (the taken ones go back).
  std::vector<Buffer> got;
  for (int64_t i = held_; i < n; ++i) got.push_back(arena_.alloc(shape_.page_bytes(), cat_, what_));
  // Onto the free list highest id first, so that alloc hands out the lowest first.
  std::vector<int64_t> ids;
  for (Buffer& b : got) {
    const int64_t id = place_locked(std::move(b));
    state_[id] = State::free;
    ids.push_back(id);
  }
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) free_.push_back(*it);
}

int64_t PagePool::trim() {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = static_cast<int64_t>(free_.size());
  for (int64_t id : free_) {
    pages_[id].reset();
    state_[id] = State::vacant;
    vacant_.push_back(id);
  }
  free_.clear();
  held_ -= n;
  return n;
}

void* PagePool::k(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return page_locked(id, "k");
}

void* PagePool::v(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return page_locked(id, "v") + shape_.half_bytes();
}

KvBlock PagePool::block(int64_t id, int32_t start, int32_t len) const {
  OOM_CHECK(start >= 0 && len >= 0 && len <= shape_.P, "[page_pool] ", what_, ": block of page ", id, " with start ",
            start, " and len ", len, " (need start >= 0 and 0 <= len <= P = ", shape_.P, ")");
  std::lock_guard<std::mutex> lock(mu_);
  char* p = page_locked(id, "block");
  KvBlock b;
  b.k = p;
  b.v = p + shape_.half_bytes();
  b.start = start;
  b.len = len;
  return b;
}

void PagePool::zero(int64_t id) {
  char* p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    p = page_locked(id, "zero");
  }
  // The page is the caller's while it holds the id, and pages never move: no lock needed to write it.
  arena_.allocator()->zero(p, shape_.page_bytes());
}

int64_t PagePool::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

int64_t PagePool::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

int64_t PagePool::peak_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_in_use_;
}

// ---- PageTable ----

void PageTable::set(int64_t seq, int32_t layer, int64_t lpage, PageRef ref) {
  OOM_CHECK(layer >= 0 && lpage >= 0 && ref.slot >= 0 && ref.start >= 0 && ref.len >= 0, "[page_table] bad entry for seq ",
            seq, " layer ", layer, " page ", lpage, ": ", tier_name(ref.tier), " slot ", ref.slot, ", start ", ref.start,
            ", len ", ref.len, " (all must be >= 0)");
  map_.insert_or_assign(Key{seq, layer, lpage}, ref);
}

const PageRef* PageTable::find(int64_t seq, int32_t layer, int64_t lpage) const {
  auto it = map_.find(Key{seq, layer, lpage});
  return it == map_.end() ? nullptr : &it->second;
}

PageRef& PageTable::at(int64_t seq, int32_t layer, int64_t lpage) {
  auto it = map_.find(Key{seq, layer, lpage});
  OOM_CHECK(it != map_.end(), "[page_table] no entry for seq ", seq, " layer ", layer, " page ", lpage);
  return it->second;
}

bool PageTable::erase(int64_t seq, int32_t layer, int64_t lpage) { return map_.erase(Key{seq, layer, lpage}) > 0; }

std::vector<int64_t> PageTable::pages(int64_t seq, int32_t layer) const {
  std::vector<int64_t> out;
  for (auto it = map_.lower_bound(Key{seq, layer, std::numeric_limits<int64_t>::min()});
       it != map_.end() && std::get<0>(it->first) == seq && std::get<1>(it->first) == layer; ++it)
    out.push_back(std::get<2>(it->first));
  return out;
}

std::vector<PageRef> PageTable::drop_sequence(int64_t seq) {
  std::vector<PageRef> out;
  auto first = map_.lower_bound(
      Key{seq, std::numeric_limits<int32_t>::min(), std::numeric_limits<int64_t>::min()});
  auto last = first;
  for (; last != map_.end() && std::get<0>(last->first) == seq; ++last) out.push_back(last->second);
  map_.erase(first, last);
  return out;
}

}  // namespace oomless
