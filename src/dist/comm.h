// The ranks of a run beyond one process: MPI when `mpirun` or `srun` launched oomless, one rank otherwise.
//
// A run started by a launcher (OpenMPI's OMPI_COMM_WORLD_SIZE, PMI's PMI_SIZE, PMIx's PMIX_RANK, Slurm's
// SLURM_STEP_NUM_TASKS in the environment) joins MPI_COMM_WORLD at startup (dist::init, from main); any other
// run is one rank and never touches MPI. Every collective below is deterministic: its result depends on the
// ranks' inputs and the rank count only, never on timing or on the MPI library's algorithm choice (sums are
// taken here, in rank order, not by MPI_Allreduce).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace oomless::dist {

// Joins MPI_COMM_WORLD when a launcher started this process (once; later calls do nothing). Returns false
// for a plain run. Throws oomless::Error when the environment names a launcher but this build has no MPI.
bool init(int* argc, char*** argv);
// Leaves MPI (at a normal exit). After an error, abort() instead: the other ranks must not wait on this one.
void finalize();
// Ends every rank of the job with `code` (MPI_Abort); returns only for a plain run.
void abort(int code);

int rank();        // 0 for a plain run
int size();        // 1 for a plain run
int local_size();  // ranks on this machine (the launcher's count; 1 for a plain run)
inline bool distributed() { return size() > 1; }
// Whether this build can join MPI (false: a plain run only).
bool built_with_mpi();
// "rank 2 of 4: " for a distributed run, "" otherwise: the prefix of messages every rank prints.
std::string rank_prefix();

// Blocks until every rank reaches it.
void barrier();
// The values of every rank, in rank order.
std::vector<uint64_t> all_u64(uint64_t v);
std::vector<double> all_f64(double v);
// Whether any rank passes true.
bool any(bool v);

// Floats a caller sums at once (16 MiB; its scratch as much again): the trainer's gradient buckets.
inline constexpr int64_t kSumBucket = int64_t{1} << 22;

// x (n floats, the same n on every rank) becomes the sum over ranks, taken in rank order in float
// (((x0 + x1) + x2) + ...), identical on every rank. `scratch` holds at least n + size() floats. Moves 2 (N-1)/N n
// floats in and out of each rank (a reduce-scatter then an all-gather, as a ring all-reduce does).
// bf16_wire: the values travel in bf16, half the bytes: each rank's x rounded to bf16, the owner of a part sums
// them in float in rank order and rounds the sum to bf16 (its own copy too), so x is still identical on every
// rank, the bf16 of the sum of the bf16 values.
void sum_floats(float* x, int64_t n, float* scratch, bool bf16_wire = false);

// x (n bytes) becomes root's copy on every rank.
void broadcast(void* x, int64_t n, int root);

// The rank that owns each of a list of tensors (sizes in elements, in order) under sharding: contiguous runs of
// the list, each rank's run ending where the next tensor's middle passes an equal share of what is left for it
// and the ranks after it, each run at least one tensor while there are as many tensors as ranks. Whole tensors:
// a tensor larger than a share leaves its rank more (a tied embedding). The same for every rank and caller.
std::vector<int> owners(const std::vector<int64_t>& sizes, int ranks);

// For a checkpoint written by rank 0 from every rank's part (ZeRO): rank 0 reads `n` bytes at `offset` of entry
// `entry` of rank `from`'s list through read_remote; that rank answers in serve_reads, which returns when rank 0
// calls end_reads. `read_local(entry, dst, offset, n)` fills from this rank's own entries.
void read_remote(int from, int64_t entry, void* dst, size_t offset, size_t n);
void serve_reads(const std::function<void(int64_t entry, void* dst, size_t offset, size_t n)>& read_local);
void end_reads();
// Every rank's string, on rank 0 (in rank order; empty elsewhere).
std::vector<std::string> gather_strings(const std::string& s);

// The same sum on rank `root` only (x elsewhere is left as it was): the float sums of sum_floats, bit for bit,
// moving (N-1) n floats into root. `scratch` holds N n floats on root. bf16_wire: the ranks' x travel in bf16
// (rounded, root's own too) and are summed in float in rank order; the sum stays float.
void sum_floats_to(float* x, int64_t n, float* scratch, int root, bool bf16_wire = false);
// Every rank's doubles, concatenated in rank order (the ranks' counts may differ).
std::vector<double> all_doubles(const std::vector<double>& mine);

// Point to point without blocking (context parallel's ring): post, compute, then wait. A receive's wait
// returns once the message is here and, under a simulated link (OOMLESS_DIST_LINK="LATENCY_US,GB_PER_S", e.g.
// "50,1.25" for 10 GbE), not before it has crossed the rank's one inbound link + latency: the receives take
// the link one after another in post order, each from its post time or the previous one's end, whichever is
// later, for bytes / bandwidth (messages in flight together share it, as on a NIC). What a slower
// interconnect would add where compute does not hide it. Tags tell apart the messages of one pair of ranks.
struct Request {
  void* mpi = nullptr;  // the MPI request (owned)
  double due = 0;       // a receive under a simulated link: when it may complete (steady-clock seconds)
  Request() = default;
  Request(Request&& o) noexcept : mpi(o.mpi), due(o.due) { o.mpi = nullptr; }
  Request& operator=(Request&& o) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request();
};
Request isend(const void* buf, int64_t bytes, int to, int tag);
Request irecv(void* buf, int64_t bytes, int from, int tag);
void wait(Request& r);
// The simulated link, if any: {latency in seconds, bytes a second}; {0, 0} for none.
std::pair<double, double> simulated_link();
// One rank's simulated inbound link: due(now, bytes) is when a receive of `bytes` posted at `now` completes:
// after the receives posted before it have crossed the link, its own bytes / rate, then the latency.
struct InboundLink {
  double latency = 0, rate = 0;
  double free_at = 0;  // when the receives posted so far have crossed it
  double due(double now, int64_t bytes);
};

// Bytes this rank has sent through the collectives above since the start (what the benchmarks compare with
// the formulas: 2 (N-1)/N of the gradient per step for data parallel).
uint64_t bytes_sent();

}  // namespace oomless::dist
