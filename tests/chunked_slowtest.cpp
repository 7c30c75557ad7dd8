// Chunk-recurrent training at longer lengths than the fast suite runs: activation peak identical for 1K,
// 4K and 16K tokens at C = 256, and with the history on the disk tier Device + Host peak growing by at most
// 0.5 MB per 1K tokens.
#include "util/chunked_run.h"

namespace oomless::test {
namespace {

TEST(ChunkedTrainingLong, MemoryDoesNotGrowFrom1KTo16KTokens) {
  ModelConfig cfg = small_config();
  cfg.V = 64;
  expect_flat_memory(cfg, {1024, 4096, 16384}, 256, 64);
}

}  // namespace
}  // namespace oomless::test
