#include "memory/offloader.h"

#include "memory/allocator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <utility>

namespace oomless {

namespace {

// Disk jobs per batch: enough to keep a disk busy, few enough that a failure names a small group.
constexpr size_t kMaxBatch = 32;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Offloader::Offloader(SpillFile* disk) : disk_(disk), worker_([this] { work(); }) {}

Offloader::~Offloader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  worker_.join();
}

Offloader::Ticket Offloader::issue(const Job& job) {
  Ticket id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_++;
    states_.emplace(id, State{});
    queue_.push_back(job);
    queue_.back().id = id;
  }
  work_cv_.notify_one();
  return id;
}

Offloader::Ticket Offloader::copy(void* dst, const void* src, size_t n, Tier from, Tier to) {
  OOM_CHECK(from != Tier::Disk && to != Tier::Disk, "[offload] copy() moves bytes between RAM buffers (",
            tier_name(from), " -> ", tier_name(to), "): use to_disk/from_disk for the disk tier");
  OOM_CHECK((dst && src) || n == 0, "[offload] copy() of ", n, " bytes without a buffer");
  return issue(Job{0, Kind::copy, dst, src, n, -1, 0, from, to, nullptr});
}

Offloader::Ticket Offloader::to_disk(int64_t slot, const void* src, size_t n, size_t offset, Tier from,
                                     SpillFile* file) {
  SpillFile* f = file ? file : disk_;
  OOM_CHECK(f, "[offload] to_disk() needs a spill file: construct the Offloader with one");
  OOM_CHECK(from != Tier::Disk, "[offload] to_disk() from the disk tier: the source must be a RAM buffer");
  OOM_CHECK(n <= f->slot_bytes() && offset <= f->slot_bytes() - n, "[offload] to_disk() of ", n,
            " bytes at offset ", offset, " runs past the spill file's ", f->slot_bytes(), "-byte slot");
  return issue(Job{0, Kind::write, nullptr, src, n, slot, offset, from, Tier::Disk, f});
}

Offloader::Ticket Offloader::from_disk(void* dst, int64_t slot, size_t n, size_t offset, Tier to, SpillFile* file) {
  SpillFile* f = file ? file : disk_;
  OOM_CHECK(f, "[offload] from_disk() needs a spill file: construct the Offloader with one");
  OOM_CHECK(to != Tier::Disk, "[offload] from_disk() to the disk tier: the destination must be a RAM buffer");
  OOM_CHECK(n <= f->slot_bytes() && offset <= f->slot_bytes() - n, "[offload] from_disk() of ", n,
            " bytes at offset ", offset, " runs past the spill file's ", f->slot_bytes(), "-byte slot");
  return issue(Job{0, Kind::read, dst, nullptr, n, slot, offset, Tier::Disk, to, f});
}

void Offloader::wait(Ticket t) {
  if (t == 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  auto it = states_.find(t);
  OOM_CHECK(it != states_.end() && !it->second.claimed, "[offload] wait(", t, "): ",
            t < next_ ? "that ticket was already waited on" : "no such ticket was issued");
  State& s = it->second;  // references into an unordered_map survive rehashing
  s.claimed = true;
  done_cv_.wait(lock, [&] { return s.done; });
  std::string error = std::move(s.error);
  states_.erase(t);
  stats_.wait_seconds += seconds_since(t0);
  lock.unlock();
  if (!error.empty()) throw Error(error);
}

bool Offloader::done(Ticket t) const {
  if (t == 0) return true;
  std::lock_guard<std::mutex> lock(mu_);
  OOM_CHECK(t < next_, "[offload] done(", t, "): no such ticket was issued");
  auto it = states_.find(t);
  return it == states_.end() || it->second.done;
}

void Offloader::wait_all() {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::pair<Ticket, std::string>> failed;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Tickets claimed by a wait() on another thread are left to that wait.
    done_cv_.wait(lock, [&] {
      return std::all_of(states_.begin(), states_.end(), [](const auto& kv) { return kv.second.claimed || kv.second.done; });
    });
    for (auto it = states_.begin(); it != states_.end();) {
      if (it->second.claimed) {
        ++it;
        continue;
      }
      if (!it->second.error.empty()) failed.emplace_back(it->first, std::move(it->second.error));
      it = states_.erase(it);
    }
    stats_.wait_seconds += seconds_since(t0);
  }
  if (failed.empty()) return;
  std::sort(failed.begin(), failed.end());
  if (failed.size() == 1) throw Error(failed[0].second);
  throw Error(failed[0].second + " (and " + std::to_string(failed.size() - 1) + " later transfers failed too)");
}

OffloadStats Offloader::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Offloader::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = OffloadStats{};
}

void Offloader::work() {
  std::vector<Job> batch;
  std::vector<std::string> errors;
  for (;;) {
    batch.clear();
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything issued has run
      batch.push_back(queue_.front());
      queue_.pop_front();
      // Disk jobs of the same direction on distinct slots commute, so running them as one batch keeps
      // the FIFO order observable by the caller. A different kind of job ends the batch.
      if (batch.front().kind != Kind::copy) {
        while (!queue_.empty() && batch.size() < kMaxBatch && queue_.front().kind == batch.front().kind &&
               queue_.front().file == batch.front().file &&
               std::none_of(batch.begin(), batch.end(), [&](const Job& j) { return j.slot == queue_.front().slot; })) {
          batch.push_back(queue_.front());
          queue_.pop_front();
        }
      }
    }
    errors.assign(batch.size(), std::string());
    const auto t0 = std::chrono::steady_clock::now();
    run(batch, errors);
    const double busy = seconds_since(t0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.busy_seconds += busy;
      for (size_t i = 0; i < batch.size(); ++i) {
        const Job& j = batch[i];
        State& s = states_.at(j.id);  // present until done: wait() and wait_all() erase only done tickets
        s.done = true;
        s.error = std::move(errors[i]);
        ++stats_.jobs;
        if (batch.size() > 1) ++stats_.batched_jobs;
        if (!s.error.empty())
          ++stats_.failed_jobs;
        else
          stats_.bytes[static_cast<int>(j.from)][static_cast<int>(j.to)] += j.n;
      }
    }
    done_cv_.notify_all();
  }
}

// Fills errors[i] for each job that failed; never throws.
void Offloader::run(const std::vector<Job>& batch, std::vector<std::string>& errors) {
  auto message = [](const char* what) {
    return what && *what ? std::string(what) : std::string("[offload] a transfer failed without a message");
  };
  try {
    DeviceAccess open;  // this worker is the transfer engine: it may touch Device memory (strict device mode)
    if (batch.size() == 1) {
      const Job& j = batch[0];
      switch (j.kind) {
        case Kind::copy:
          if (j.n) std::memcpy(j.dst, j.src, j.n);
          break;
        case Kind::write: j.file->write(j.slot, j.src, j.n, j.offset); break;
        case Kind::read: j.file->read(j.slot, j.dst, j.n, j.offset); break;
      }
      return;
    }
    std::vector<IoOp> ops;
    ops.reserve(batch.size());
    for (const Job& j : batch)
      ops.push_back(IoOp{j.slot, j.kind == Kind::write ? const_cast<void*>(j.src) : j.dst, j.n, j.offset});
    if (batch[0].kind == Kind::write)
      batch[0].file->write_batch(ops, &errors);
    else
      batch[0].file->read_batch(ops, &errors);
  } catch (const std::exception& e) {
    for (std::string& err : errors)
      if (err.empty()) err = message(e.what());
  } catch (...) {
    for (std::string& err : errors)
      if (err.empty()) err = message(nullptr);
  }
}

}  // namespace oomless
