#include "memory/arena.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace oomless {

namespace {
constexpr size_t kAlign = 64;
}  // namespace

const char* category_name(Category c) {
  switch (c) {
    case Category::weights: return "weights";
    case Category::grads: return "grads";
    case Category::optimizer: return "optimizer";
    case Category::adapter: return "adapter";
    case Category::activations: return "activations";
    case Category::kv: return "kv";
    case Category::kv_grad: return "kv_grad";
    case Category::workspace: return "workspace";
  }
  return "?";
}

std::string format_bytes(size_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%zu B", n);
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

size_t parse_size(std::string_view s) {
  auto bad = [&]() -> size_t {
    fail("[size] cannot read '", s, "' as a size: use a number with an optional unit, e.g. 24GiB, 24GB, 512MiB, 1.5G");
  };
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == 0) return bad();
  double v = 0;
  try {
    size_t used = 0;
    v = std::stod(std::string(s.substr(0, i)), &used);
    if (used != i) return bad();
  } catch (...) {
    return bad();
  }
  std::string unit;
  for (char ch : s.substr(i))
    if (ch != ' ') unit += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  double mult = 0;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kib") mult = 1024.0;
  else if (unit == "m" || unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb") mult = 1e3;
  else if (unit == "mb") mult = 1e6;
  else if (unit == "gb") mult = 1e9;
  else if (unit == "tb") mult = 1e12;
  else return bad();
  double bytes = v * mult;
  if (!(bytes >= 0) || bytes > 1.8e19) return bad();
  return static_cast<size_t>(std::llround(bytes));
}

// ---- Ledger ----

void Ledger::on_alloc(Tier t, Category c, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  by_cat_[static_cast<int>(t)][static_cast<int>(c)].add(n);
  by_tier_[static_cast<int>(t)].add(n);
  (is_static(c) ? static_ : dynamic_).add(n);
  all_.add(n);
}

void Ledger::on_free(Tier t, Category c, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  by_cat_[static_cast<int>(t)][static_cast<int>(c)].cur -= n;
  by_tier_[static_cast<int>(t)].cur -= n;
  (is_static(c) ? static_ : dynamic_).cur -= n;
  all_.cur -= n;
}

size_t Ledger::current(Tier t, Category c) const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_cat_[static_cast<int>(t)][static_cast<int>(c)].cur;
}
size_t Ledger::peak(Tier t, Category c) const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_cat_[static_cast<int>(t)][static_cast<int>(c)].peak;
}
size_t Ledger::current_total(Tier t) const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_tier_[static_cast<int>(t)].cur;
}
size_t Ledger::peak_total(Tier t) const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_tier_[static_cast<int>(t)].peak;
}
size_t Ledger::peak_static() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_.peak;
}
size_t Ledger::peak_dynamic() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dynamic_.peak;
}
size_t Ledger::peak_all() const {
  std::lock_guard<std::mutex> lock(mu_);
  return all_.peak;
}

void Ledger::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& tier : by_cat_)
    for (auto& c : tier) c.peak = c.cur;
  for (auto& c : by_tier_) c.peak = c.cur;
  static_.peak = static_.cur;
  dynamic_.peak = dynamic_.cur;
  all_.peak = all_.cur;
}

std::string Ledger::table() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream os;
  char line[160];
  std::snprintf(line, sizeof line, "%-12s %-7s", "category", "kind");
  os << line;
  for (int t = 0; t < kTierCount; ++t) {
    std::snprintf(line, sizeof line, " %12s %12s", (std::string(tier_name(static_cast<Tier>(t))) + " now").c_str(),
                  (std::string(tier_name(static_cast<Tier>(t))) + " peak").c_str());
    os << line;
  }
  os << "\n";
  for (int c = 0; c < kCategoryCount; ++c) {
    Category cat = static_cast<Category>(c);
    std::snprintf(line, sizeof line, "%-12s %-7s", category_name(cat), is_static(cat) ? "static" : "dynamic");
    os << line;
    for (int t = 0; t < kTierCount; ++t) {
      std::snprintf(line, sizeof line, " %12s %12s", format_bytes(by_cat_[t][c].cur).c_str(),
                    format_bytes(by_cat_[t][c].peak).c_str());
      os << line;
    }
    os << "\n";
  }
  std::snprintf(line, sizeof line, "%-12s %-7s", "total", "");
  os << line;
  for (int t = 0; t < kTierCount; ++t) {
    std::snprintf(line, sizeof line, " %12s %12s", format_bytes(by_tier_[t].cur).c_str(),
                  format_bytes(by_tier_[t].peak).c_str());
    os << line;
  }
  os << "\npeak static " << format_bytes(static_.peak) << ", peak dynamic " << format_bytes(dynamic_.peak)
     << ", peak of all held " << format_bytes(all_.peak) << "\n";
  return os.str();
}

std::string Ledger::json() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream os;
  auto counter = [&](const Counter& c) { os << "{\"current\": " << c.cur << ", \"peak\": " << c.peak << "}"; };
  os << "{";
  for (int t = 0; t < kTierCount; ++t) {
    os << (t ? ", " : "") << "\"" << tier_name(static_cast<Tier>(t)) << "\": {";
    for (int c = 0; c < kCategoryCount; ++c) {
      os << "\"" << category_name(static_cast<Category>(c)) << "\": ";
      counter(by_cat_[t][c]);
      os << ", ";
    }
    os << "\"total\": ";
    counter(by_tier_[t]);
    os << "}";
  }
  os << ", \"static\": ";
  counter(static_);
  os << ", \"dynamic\": ";
  counter(dynamic_);
  os << ", \"all\": ";
  counter(all_);
  os << "}";
  return os.str();
}

// ---- Buffer ----

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    arena_ = o.arena_;
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    cat_ = o.cat_;
    o.arena_ = nullptr;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void Buffer::reset() {
  if (ptr_ && arena_) arena_->release(ptr_, bytes_, cat_);
  arena_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

Tier Buffer::tier() const { return arena_ ? arena_->tier() : Tier::Host; }

Tensor Buffer::view(DType t, std::initializer_list<int64_t> shape) const {
  Tensor v(ptr_, t, shape, tier());
  OOM_CHECK(static_cast<size_t>(v.nbytes()) <= bytes_, "[arena] a view ", v.str(), " needs ", v.nbytes(),
            " bytes but the buffer holds ", bytes_);
  return v;
}

// ---- Arena ----

Arena::Arena(Tier tier, size_t budget, Ledger& ledger, Budget* shared, Allocator* from)
    : tier_(tier), budget_(budget), ledger_(ledger), shared_(shared), from_(from ? from : &tier_allocator(tier)) {}

Arena::~Arena() = default;

size_t Arena::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

Arena::Arena(void* base, size_t bytes, Tier tier, Ledger& ledger, Allocator* from)
    : tier_(tier),
      budget_(bytes),
      ledger_(ledger),
      shared_(nullptr),
      from_(from ? from : &tier_allocator(tier)),
      region_(static_cast<char*>(base)) {
  OOM_CHECK(base && reinterpret_cast<uintptr_t>(base) % kAlign == 0, "[arena] a sub-arena needs a ", kAlign,
            "-byte aligned region");
}

Buffer Arena::alloc(size_t bytes, Category cat, std::string_view what) { return take(bytes, cat, what, false); }
Buffer Arena::alloc_zeroed(size_t bytes, Category cat, std::string_view what) { return take(bytes, cat, what, true); }

Buffer Arena::take(size_t bytes, Category cat, std::string_view what, bool zeroed) {
  Buffer b;
  if (bytes == 0) return b;
  if (region_) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t need = (bytes + kAlign - 1) / kAlign * kAlign;
    if (need > budget_ - region_next_)
      throw OutOfBudget("[arena] a sub-arena of " + format_bytes(budget_) + " has no room for " + format_bytes(bytes) +
                        " of " + category_name(cat) + (what.empty() ? std::string() : " (" + std::string(what) + ")") +
                        " after " + format_bytes(region_next_));
    b.ptr_ = region_ + region_next_;
    if (zeroed) from_->zero(b.ptr_, bytes);
    region_next_ += need;
    ++region_live_;
    used_ += bytes;
    ledger_.on_alloc(tier_, cat, bytes);
    b.arena_ = this;
    b.bytes_ = bytes;
    b.cat_ = cat;
    return b;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool over_own = bytes > budget_ - std::min(used_, budget_);
    bool over_shared = shared_ && bytes > shared_->limit - std::min(shared_->used, shared_->limit);
    if (over_own || over_shared) {
      std::ostringstream held;
      for (int c = 0; c < kCategoryCount; ++c) {
        size_t n = ledger_.current(tier_, static_cast<Category>(c));
        if (n) held << (held.tellp() > 0 ? ", " : "") << category_name(static_cast<Category>(c)) << " "
                    << format_bytes(n);
      }
      std::string held_s = held.str().empty() ? "nothing" : held.str();
      size_t limit = over_own ? budget_ : shared_->limit;
      size_t in_use = over_own ? used_ : shared_->used;
      throw OutOfBudget("[arena] out of budget on " + std::string(tier_name(tier_)) + ": requested " +
                        format_bytes(bytes) + " for " + category_name(cat) +
                        (what.empty() ? std::string() : " (" + std::string(what) + ")") + "; held on this tier: " +
                        held_s + "; " + (over_own ? "tier" : "shared") + " budget " + format_bytes(limit) + ", in use " +
                        format_bytes(in_use) + ".");
    }
    used_ += bytes;
    if (shared_) shared_->used += bytes;
  }
  void* p = zeroed ? from_->allocate_zeroed(bytes) : from_->allocate(bytes);
  if (!p) {
    std::lock_guard<std::mutex> lock(mu_);
    used_ -= bytes;
    if (shared_) shared_->used -= bytes;
    throw OutOfBudget("[arena] the operating system refused " + format_bytes(bytes) + " for " + category_name(cat) +
                      " on " + tier_name(tier_) + " (more than the machine can give)");
  }
  ledger_.on_alloc(tier_, cat, bytes);
  b.arena_ = this;
  b.ptr_ = p;
  b.bytes_ = bytes;
  b.cat_ = cat;
  return b;
}

void Arena::release(void* p, size_t bytes, Category c) {
  if (region_) {
    ledger_.on_free(tier_, c, bytes);
    std::lock_guard<std::mutex> lock(mu_);
    used_ -= bytes;
    if (--region_live_ == 0) region_next_ = 0;
    return;
  }
  from_->deallocate(p, bytes);
  ledger_.on_free(tier_, c, bytes);
  std::lock_guard<std::mutex> lock(mu_);
  used_ -= bytes;
  if (shared_) shared_->used -= bytes;
}

CpuMemory::CpuMemory(size_t budget)
    : shared(budget), device(Tier::Device, budget, ledger, &shared), host(Tier::Host, budget, ledger, &shared) {}

}  // namespace oomless
