// The data pipeline streams files larger than memory: a generated 200 MB .ids file is indexed and read
// through a whole epoch while the process's resident memory grows by less than 64 MiB.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace oomless::test {
namespace {

namespace fs = std::filesystem;

// Resident set size in bytes, from /proc/self/statm (Linux).
int64_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

TEST(DatasetStream, TwoHundredMegabyteIdsFileWithBoundedMemory) {
  const fs::path dir = fs::temp_directory_path() / ("oomless_dataset_stream_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path path = dir / "big.ids";
  const int64_t target_bytes = 200ll << 20;
  int64_t lines = 0, ids = 0, bytes = 0;
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_TRUE(f);
    std::mt19937_64 rng(1);
    std::string line;
    while (bytes < target_bytes) {
      line.clear();
      const int n = 1 + static_cast<int>(rng() % 4000);  // documents of 1..4000 tokens
      for (int i = 0; i < n; ++i) line += std::to_string(rng() % 50000) + (i + 1 < n ? " " : "\n");
      if (lines % 97 == 0) line += "\n";  // blank lines, skipped
      ASSERT_EQ(std::fwrite(line.data(), 1, line.size(), f), line.size());
      bytes += static_cast<int64_t>(line.size());
      ids += n;
      ++lines;
    }
    std::fclose(f);
  }
  const int64_t before = rss_bytes();
  int64_t peak = before;
  {
    const int64_t T = 2048;
    Dataset d({{path.string()}, T, 3, 50000}, nullptr, json::Value());
    peak = std::max(peak, rss_bytes());
    EXPECT_EQ(d.documents(), lines);
    std::vector<int32_t> in(T), tg(T);
    // One epoch is ids + lines stream tokens (an EOS after each document).
    int64_t taken = 1, seqs = 0;
    while (d.epoch() == 0) {
      ASSERT_EQ(d.next(in.data(), tg.data()), 0);
      taken += T;
      if (++seqs % 256 == 0) peak = std::max(peak, rss_bytes());
    }
    EXPECT_GE(taken, ids + lines);
    EXPECT_LT(taken - T, ids + lines + 1);
    peak = std::max(peak, rss_bytes());
  }
  fs::remove_all(dir);
  std::printf("[ stream   ] %.0f MB, %lld documents; RSS growth %.1f MiB\n", bytes / 1e6,
              static_cast<long long>(lines), (peak - before) / 1048576.0);
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "resident memory is not meaningful under AddressSanitizer (its quarantine keeps freed memory)";
#else
  EXPECT_LT(peak - before, 64ll << 20);
#endif
}

}  // namespace
}  // namespace oomless::test
