// Crash-safe checkpoint folders. A checkpoint is OUT/checkpoint-STEP/ holding the trainer's files and a
// manifest.json that lists each file's size and SHA-256. The folder is built under a hidden temporary
// name and renamed into place only after every byte is on disk, so at any instant OUT holds, for each
// step, either no checkpoint, the old complete one or the new complete one. Readers trust a checkpoint
// only when its manifest verifies, so a disk that lost or corrupted data after the save is caught too.
//
// One saver per OUT at a time: a save removes every leftover hidden folder of an interrupted save.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace oomless {

// SHA-256 (FIPS 180-4), streaming: update() any number of times, then digest() once.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  std::array<uint8_t, 32> digest();  // finishes; the object must not be updated afterwards
  std::string hex_digest();          // digest() as 64 lowercase hex digits

 private:
  void blocks(const uint8_t* p, size_t n);  // n whole 64-byte blocks
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;  // bytes hashed so far
};
std::string sha256_hex(const void* data, size_t n);
// Whether Sha256 runs on the CPU's SHA extensions (x86 SHA-NI: some 5x the portable code's rate), and a switch
// for tests and benchmarks (on only where the CPU has them; not while a hash is running).
bool sha256_sha_ni();
void set_sha256_sha_ni(bool on);
// Hashes a file in 1 MiB blocks (files can be many GB). Throws "[checkpoint] PATH: ..." on read errors.
std::string sha256_file_hex(const std::string& path);

// Writes all n bytes to fd: retries after EINTR and short writes; throws on any other error with a
// message that names the file being saved and what to do (ENOSPC: free space or point --out elsewhere).
// CheckpointFile::write callbacks should write through this so that errors read the same for every
// file and the test fault hook below applies to them; the saver hashes what is on disk afterwards, so a
// callback that writes some other way still gets a correct manifest.
//
// Test-only fault hook: with env OOMLESS_FAULT_ENOSPC_AFTER=N set when save_checkpoint starts, writes
// fail with ENOSPC once N bytes in total have been written by that save (the last one short).
void checkpoint_write(int fd, const void* data, size_t n);

// One file of a checkpoint: its name inside the folder and how to produce its bytes. Exactly one of
// `bytes` (small files) and `write` (which writes the whole file to an open fd, positioned at 0) is
// used: `write` when set, and then `bytes` must be empty. The saver owns the fd, fsync and checksum.
// Names are plain file names: not empty, no '/', not "." or "..", not starting with '.', not
// "manifest.json", no two alike.
struct CheckpointFile {
  std::string name;
  std::string bytes;
  std::function<void(int fd)> write;
};

struct SaveOptions {
  int keep = 0;  // 0: keep every checkpoint; K > 0: keep the newest K complete ones (this one included)
};

// Saves OUT/checkpoint-STEP/ (STEP in plain decimal; checkpoints sort by the number, not the name),
// creating OUT when missing, in these steps:
//   1 create OUT/.checkpoint-STEP.tmp/ (leftovers of interrupted saves are removed first)
//   2 write each file   3 fsync each file (and hash it)   4 write manifest.json   5 fsync the manifest
//   6 fsync the tmp folder   7 rename it to OUT/checkpoint-STEP (an existing checkpoint of the same
//   step is swapped out atomically, then removed)   8 fsync OUT   9 prune beyond opt.keep, oldest first
// Returns the final path. On an error before step 7 the tmp folder is removed and every checkpoint
// already in OUT is untouched; an error after it (fsync of OUT, pruning) throws too, saying that the
// checkpoint was saved. Pruning never removes a checkpoint newer than this one: such a folder
// comes from a run that went further, and it is not this save's to judge.
//
// Test-only crash hook: with env OOMLESS_CRASH_AT=k (1..9), the process calls _exit(86) right after step
// k, to test that a crash anywhere leaves a usable OUT.
std::string save_checkpoint(const std::string& out_dir, int64_t step, const std::vector<CheckpointFile>& files,
                            const SaveOptions& opt);

struct FoundCheckpoint {
  std::string path;
  int64_t step;
};
// The newest OUT/checkpoint-STEP whose manifest verifies. Newer ones that fail are skipped and reported
// through `warn` ("checkpoint-20 is incomplete or corrupt (model.safetensors: checksum mismatch); using
// checkpoint-10"); leftover hidden folders of interrupted saves are ignored and reported too. nullopt
// when none verifies or OUT does not exist.
std::optional<FoundCheckpoint> find_latest_checkpoint(const std::string& out_dir,
                                                      const std::function<void(const std::string&)>& warn);

// True when PATH/manifest.json parses and every file it lists is present with its size and SHA-256
// (sizes are checked first, so a truncated file is found without hashing the rest). Otherwise false,
// with the first problem in *why (when not null), e.g. "model.safetensors: checksum mismatch".
bool verify_checkpoint(const std::string& path, std::string* why);

}  // namespace oomless
