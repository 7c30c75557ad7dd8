#include "dist/comm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/dtype.h"
#include "core/error.h"
#include "memory/allocator.h"

#if OOMLESS_HAS_MPI
#include <mpi.h>
#endif

namespace oomless::dist {

namespace {

int g_rank = 0, g_size = 1, g_local = 1;
bool g_mpi = false;
uint64_t g_sent = 0;

const char* launcher_env() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_NUM_TASKS"})
    if (std::getenv(v)) return v;
  return nullptr;
}

#if OOMLESS_HAS_MPI
int local_ranks() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_TASKS_PER_NODE"})
    if (const char* s = std::getenv(v)) {
      const int n = std::atoi(s);  // Slurm's "2(x3)" reads as 2
      if (n >= 1) return n;
    }
  MPI_Comm node;  // no launcher count: the ranks sharing this machine's memory
  int n = 1;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
    MPI_Comm_size(node, &n);
    MPI_Comm_free(&node);
  }
  return n;
}
#endif

}  // namespace

bool built_with_mpi() { return OOMLESS_HAS_MPI != 0; }

bool init(int* argc, char*** argv) {
  if (g_mpi) return true;
  const char* env = launcher_env();
  if (!env) return false;
#if OOMLESS_HAS_MPI
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  g_local = local_ranks();
  g_mpi = true;
  return true;
#else
  (void)argc, (void)argv;
  fail("this oomless was built without MPI, but ", env, " says a launcher (mpirun, srun) started it: build on a "
       "machine with OpenMPI (scripts/setup.sh installs libopenmpi-dev), or run without the launcher");
#endif
}

void finalize() {
#if OOMLESS_HAS_MPI
  if (g_mpi) MPI_Finalize();
#endif
  g_mpi = false;
}

void abort(int code) {
#if OOMLESS_HAS_MPI
  if (g_mpi && g_size > 1) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  (void)code;
}

int rank() { return g_rank; }
int size() { return g_size; }
int local_size() { return g_local; }

std::string rank_prefix() {
  return g_size > 1 ? "rank " + std::to_string(g_rank) + " of " + std::to_string(g_size) + ": " : std::string();
}

void barrier() {
#if OOMLESS_HAS_MPI
  if (g_size > 1) MPI_Barrier(MPI_COMM_WORLD);
#endif
}

namespace {
#if OOMLESS_HAS_MPI
MPI_Datatype mpi_type(uint64_t) { return MPI_UINT64_T; }
MPI_Datatype mpi_type(double) { return MPI_DOUBLE; }
#endif
// Every rank's v, in rank order.
template <class T>
std::vector<T> all_of(T v) {
  std::vector<T> out(static_cast<size_t>(g_size), v);
#if OOMLESS_HAS_MPI
  if (g_size > 1) {
    MPI_Allgather(&v, 1, mpi_type(v), out.data(), 1, mpi_type(v), MPI_COMM_WORLD);
    g_sent += sizeof v * static_cast<uint64_t>(g_size - 1);
  }
#endif
  return out;
}
}  // namespace

std::vector<uint64_t> all_u64(uint64_t v) { return all_of(v); }
std::vector<double> all_f64(double v) { return all_of(v); }

bool any(bool v) {
  for (uint64_t x : all_u64(v ? 1 : 0))
    if (x) return true;
  return false;
}

// The transport reads and writes the engine's memory where it lies, as a device's own interconnect does (NCCL
// takes device pointers): the calls that touch tensors open Device memory (memory/allocator.h, strict mode).
namespace {
// n floats to bf16 (round to nearest even: core/dtype's conversion), and back.
void to_bf16(uint16_t* d, const float* s, int64_t n) { convert(d, DType::bf16, s, DType::f32, n); }
void from_bf16(float* d, const uint16_t* s, int64_t n) { convert(d, DType::f32, s, DType::bf16, n); }
}  // namespace

void sum_floats(float* x, int64_t n, float* scratch, bool bf16_wire) {
#if OOMLESS_HAS_MPI
  if (g_size <= 1 || n <= 0) return;
  DeviceAccess open;
  OOM_CHECK(n <= INT32_MAX, "[dist] a sum of ", n, " floats at once; the caller splits it");
  const int N = g_size, r = g_rank;
  // Rank s reduces floats [start(s), start(s + 1)).
  auto start = [&](int s) { return static_cast<int>(n * s / N); };
  std::vector<int> cnt(static_cast<size_t>(N)), off(static_cast<size_t>(N)), rcnt(static_cast<size_t>(N)),
      roff(static_cast<size_t>(N));
  const int mine = start(r + 1) - start(r);
  for (int s = 0; s < N; ++s) {
    cnt[static_cast<size_t>(s)] = start(s + 1) - start(s);
    off[static_cast<size_t>(s)] = start(s);
    rcnt[static_cast<size_t>(s)] = mine;
    roff[static_cast<size_t>(s)] = s * mine;
  }
  const uint64_t moved = static_cast<uint64_t>(n - mine) + static_cast<uint64_t>(mine) * static_cast<uint64_t>(N - 1);
  float* part = x + start(r);
  if (bf16_wire) {
    // In scratch: this rank's x in bf16 (n halves), then every rank's copy of this rank's part (N mine halves,
    // at most n + N): n + N / 2 floats in all. The part's sum goes back into the rank's halves.
    uint16_t* wire = reinterpret_cast<uint16_t*>(scratch);
    uint16_t* parts = wire + n;
    to_bf16(wire, x, n);
    MPI_Alltoallv(wire, cnt.data(), off.data(), MPI_UINT16_T, parts, rcnt.data(), roff.data(), MPI_UINT16_T,
                  MPI_COMM_WORLD);
    from_bf16(part, parts, mine);
    for (int s = 1; s < N; ++s) {
      const uint16_t* y = parts + static_cast<size_t>(s) * static_cast<size_t>(mine);
      for (int j = 0; j < mine; ++j) part[j] += bf16_to_f32(y[j]);
    }
    to_bf16(wire + start(r), part, mine);
    MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_UINT16_T, wire, cnt.data(), off.data(), MPI_UINT16_T, MPI_COMM_WORLD);
    from_bf16(x, wire, n);
    g_sent += sizeof(uint16_t) * moved;
    return;
  }
  // Every rank's copy of this rank's part, in rank order, then their sum in that order.
  MPI_Alltoallv(x, cnt.data(), off.data(), MPI_FLOAT, scratch, rcnt.data(), roff.data(), MPI_FLOAT, MPI_COMM_WORLD);
  std::memcpy(part, scratch, sizeof(float) * static_cast<size_t>(mine));
  for (int s = 1; s < N; ++s) {
    const float* y = scratch + static_cast<size_t>(s) * static_cast<size_t>(mine);
    for (int j = 0; j < mine; ++j) part[j] += y[j];
  }
  MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, x, cnt.data(), off.data(), MPI_FLOAT, MPI_COMM_WORLD);
  g_sent += sizeof(float) * moved;
#else
  (void)x, (void)n, (void)scratch, (void)bf16_wire;
#endif
}

void broadcast(void* x, int64_t n, int root) {
#if OOMLESS_HAS_MPI
  if (g_size <= 1 || n <= 0) return;
  DeviceAccess open;
  OOM_CHECK(n <= INT32_MAX, "[dist] a broadcast of ", n, " bytes at once; the caller splits it");
  MPI_Bcast(x, static_cast<int>(n), MPI_BYTE, root, MPI_COMM_WORLD);
  if (g_rank == root) g_sent += static_cast<uint64_t>(n) * static_cast<uint64_t>(g_size - 1);
#else
  (void)x, (void)n, (void)root;
#endif
}

std::vector<int> owners(const std::vector<int64_t>& sizes, int ranks) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  std::vector<int> out(static_cast<size_t>(n), 0);
  // Rank r - 1's run ends where the next tensor's middle passes an equal share of what is left for ranks
  // r - 1 .. ranks - 1; each run holds at least one tensor while there are enough for the ranks after it.
  int64_t start = 0, before = 0;  // rank r - 1's first tensor, and the elements before it
  int64_t total = 0;
  for (int64_t x : sizes) total += x;
  for (int r = 1; r < ranks && start < n; ++r) {
    const int64_t share2 = 2 * (total - before) / (ranks - r + 1);  // twice the share
    int64_t i = start, mid_base = 0;  // mid_base: elements of rank r - 1's run before tensor i
    while (i < n && (i == start || 2 * mid_base + sizes[static_cast<size_t>(i)] <= share2))
      mid_base += sizes[static_cast<size_t>(i++)];
    i = std::min(i, n - (ranks - r));
    if (i <= start) break;  // fewer tensors than ranks: the last ranks own none
    for (int64_t j = i; j < n; ++j) out[static_cast<size_t>(j)] = r;
    for (int64_t j = start; j < i; ++j) before += sizes[static_cast<size_t>(j)];
    start = i;
  }
  return out;
}

namespace {
constexpr int kTagRequest = 7001, kTagData = 7002;
}  // namespace

void read_remote(int from, int64_t entry, void* dst, size_t offset, size_t n) {
#if OOMLESS_HAS_MPI
  const int64_t req[3] = {entry, static_cast<int64_t>(offset), static_cast<int64_t>(n)};
  MPI_Send(req, 3, MPI_INT64_T, from, kTagRequest, MPI_COMM_WORLD);
  OOM_CHECK(n <= INT32_MAX, "[dist] a read of ", n, " bytes at once");
  MPI_Recv(dst, static_cast<int>(n), MPI_BYTE, from, kTagData, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
#else
  (void)from, (void)entry, (void)dst, (void)offset, (void)n;
  fail("[dist] read_remote without MPI");
#endif
}

void serve_reads(const std::function<void(int64_t entry, void* dst, size_t offset, size_t n)>& read_local) {
#if OOMLESS_HAS_MPI
  std::vector<char> buf;
  for (;;) {
    int64_t req[3];
    MPI_Recv(req, 3, MPI_INT64_T, 0, kTagRequest, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    if (req[0] < 0) return;  // end_reads
    buf.resize(static_cast<size_t>(req[2]));
    read_local(req[0], buf.data(), static_cast<size_t>(req[1]), static_cast<size_t>(req[2]));
    MPI_Send(buf.data(), static_cast<int>(req[2]), MPI_BYTE, 0, kTagData, MPI_COMM_WORLD);
    g_sent += static_cast<uint64_t>(req[2]);
  }
#else
  (void)read_local;
#endif
}

void end_reads() {
#if OOMLESS_HAS_MPI
  const int64_t done[3] = {-1, 0, 0};
  for (int r = 1; r < g_size; ++r) MPI_Send(done, 3, MPI_INT64_T, r, kTagRequest, MPI_COMM_WORLD);
#endif
}

#if OOMLESS_HAS_MPI
namespace {
// The counts and displacements of a gather of each rank's `n[r]` elements, and their total.
struct Counts {
  std::vector<int> cnt, off;
  int total = 0;
};
Counts counts_of(const std::vector<uint64_t>& n) {
  Counts c;
  for (uint64_t x : n) {
    c.cnt.push_back(static_cast<int>(x));
    c.off.push_back(c.total);
    c.total += static_cast<int>(x);
  }
  return c;
}
}  // namespace
#endif

std::vector<std::string> gather_strings(const std::string& s) {
  std::vector<std::string> out;
#if OOMLESS_HAS_MPI
  if (g_size > 1) {
    const uint64_t n = s.size();
    std::vector<uint64_t> sizes(static_cast<size_t>(g_size));
    MPI_Gather(&n, 1, MPI_UINT64_T, sizes.data(), 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    const Counts c = counts_of(sizes);
    const std::vector<int>& cnt = c.cnt;
    const std::vector<int>& off = c.off;
    const int total = c.total;
    std::string all(g_rank == 0 ? static_cast<size_t>(total) : 0, '\0');
    MPI_Gatherv(s.data(), static_cast<int>(n), MPI_CHAR, all.data(), cnt.data(), off.data(), MPI_CHAR, 0, MPI_COMM_WORLD);
    if (g_rank != 0) {
      g_sent += n;
      return out;
    }
    for (int r = 0; r < g_size; ++r)
      out.push_back(all.substr(static_cast<size_t>(off[static_cast<size_t>(r)]), static_cast<size_t>(cnt[static_cast<size_t>(r)])));
    return out;
  }
#endif
  out.push_back(s);
  return out;
}

void sum_floats_to(float* x, int64_t n, float* scratch, int root, bool bf16_wire) {
#if OOMLESS_HAS_MPI
  if (g_size <= 1 || n <= 0) return;
  DeviceAccess open;
  OOM_CHECK(n <= INT32_MAX / g_size, "[dist] a sum of ", n, " floats at once; the caller splits it");
  if (bf16_wire) {  // in scratch: this rank's x in bf16, then on root every rank's (N + 1) n halves
    uint16_t* wire = reinterpret_cast<uint16_t*>(scratch);
    uint16_t* all = wire + n;
    to_bf16(wire, x, n);
    MPI_Gather(wire, static_cast<int>(n), MPI_UINT16_T, all, static_cast<int>(n), MPI_UINT16_T, root, MPI_COMM_WORLD);
    if (g_rank != root) {
      g_sent += sizeof(uint16_t) * static_cast<uint64_t>(n);
      return;
    }
    from_bf16(x, all, n);
    for (int s = 1; s < g_size; ++s) {
      const uint16_t* y = all + static_cast<size_t>(s) * static_cast<size_t>(n);
      for (int64_t j = 0; j < n; ++j) x[j] += bf16_to_f32(y[j]);
    }
    return;
  }
  MPI_Gather(x, static_cast<int>(n), MPI_FLOAT, scratch, static_cast<int>(n), MPI_FLOAT, root, MPI_COMM_WORLD);
  if (g_rank != root) {
    g_sent += sizeof(float) * static_cast<uint64_t>(n);
    return;
  }
  std::memcpy(x, scratch, sizeof(float) * static_cast<size_t>(n));
  for (int s = 1; s < g_size; ++s) {
    const float* y = scratch + static_cast<size_t>(s) * static_cast<size_t>(n);
    for (int64_t j = 0; j < n; ++j) x[j] += y[j];
  }
#else
  (void)x, (void)n, (void)scratch, (void)root, (void)bf16_wire;
#endif
}

std::vector<double> all_doubles(const std::vector<double>& mine) {
#if OOMLESS_HAS_MPI
  if (g_size > 1) {
    const std::vector<uint64_t> counts = all_u64(mine.size());
    const Counts c = counts_of(counts);
    const std::vector<int>& cnt = c.cnt;
    const std::vector<int>& off = c.off;
    const int total = c.total;
    std::vector<double> out(static_cast<size_t>(total));
    MPI_Allgatherv(mine.data(), static_cast<int>(mine.size()), MPI_DOUBLE, out.data(), cnt.data(), off.data(), MPI_DOUBLE,
                   MPI_COMM_WORLD);
    g_sent += sizeof(double) * mine.size() * static_cast<uint64_t>(g_size - 1);
    return out;
  }
#endif
  return mine;
}

std::pair<double, double> simulated_link() {
  static const std::pair<double, double> link = [] {
    const char* v = std::getenv("OOMLESS_DIST_LINK");
    if (!v || !*v) return std::pair<double, double>{0, 0};
    double us = 0, gbs = 0;
    OOM_CHECK(std::sscanf(v, "%lf,%lf", &us, &gbs) == 2 && us >= 0 && gbs > 0, "[dist] OOMLESS_DIST_LINK=", v,
              ": give LATENCY_US,GB_PER_S (e.g. 50,1.25 for 10 GbE)");
    return std::pair<double, double>{us * 1e-6, gbs * 1e9};
  }();
  return link;
}

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

double InboundLink::due(double now, int64_t bytes) {
  free_at = std::max(now, free_at) + static_cast<double>(bytes) / rate;
  return free_at + latency;
}

Request& Request::operator=(Request&& o) noexcept {
  std::swap(mpi, o.mpi);
  std::swap(due, o.due);
  return *this;
}

Request::~Request() {
#if OOMLESS_HAS_MPI
  if (mpi) {  // an unfinished request (an error unwinding): completed, so its buffer may go
    DeviceAccess open;
    MPI_Wait(static_cast<MPI_Request*>(mpi), MPI_STATUS_IGNORE);
    delete static_cast<MPI_Request*>(mpi);
  }
#endif
}

namespace {
// A send (buf read) or a receive (buf written) of `bytes` with rank `peer`.
Request post(void* buf, int64_t bytes, int peer, int tag, bool send) {
  Request r;
#if OOMLESS_HAS_MPI
  OOM_CHECK(bytes <= INT32_MAX, "[dist] a message of ", bytes, " bytes; the caller splits it");
  auto* q = new MPI_Request;
  DeviceAccess open;
  if (send) {
    MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, MPI_COMM_WORLD, q);
    g_sent += static_cast<uint64_t>(bytes);
  } else {
    MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, MPI_COMM_WORLD, q);
    const auto [latency, rate] = simulated_link();
    if (rate > 0) {  // one inbound link a rank: a receive starts once those posted before it are through
      static std::mutex m;
      static InboundLink link{latency, rate};
      std::lock_guard<std::mutex> hold(m);
      r.due = link.due(now_s(), bytes);
    }
  }
  r.mpi = q;
#else
  (void)buf, (void)bytes, (void)peer, (void)tag, (void)send;
#endif
  return r;
}
}  // namespace

Request isend(const void* buf, int64_t bytes, int to, int tag) {
  return post(const_cast<void*>(buf), bytes, to, tag, true);
}
Request irecv(void* buf, int64_t bytes, int from, int tag) { return post(buf, bytes, from, tag, false); }

void wait(Request& r) {
#if OOMLESS_HAS_MPI
  if (!r.mpi) return;
  DeviceAccess open;
  MPI_Wait(static_cast<MPI_Request*>(r.mpi), MPI_STATUS_IGNORE);
  delete static_cast<MPI_Request*>(r.mpi);
  r.mpi = nullptr;
  const double left = r.due - now_s();
  if (left > 0) std::this_thread::sleep_for(std::chrono::duration<double>(left));
#else
  (void)r;
#endif
}

uint64_t bytes_sent() { return g_sent; }

}  // namespace oomless::dist
