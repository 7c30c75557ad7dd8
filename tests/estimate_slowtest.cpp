// The whole estimate sweep on tiny (every memory option, T up to 1024) and at SmolLM2-135M's shape (30 layers,
// V = 49152: adapters, QLoRA in bf16, full 8-bit training): every category and peak within 5% of the ledger.
#include <gtest/gtest.h>

#include "util/estimate_sweep.h"

namespace oomless {
namespace {

TEST(EstimateSweep, TinyEveryOptionWithinFivePercentOfTheLedger) { test::check_sweep(test::sweep("preset:tiny")); }

TEST(EstimateSweep, SmolLM2ShapedRunsWithinFivePercentOfTheLedger) {
  test::check_sweep(test::sweep("preset:smollm2-135m"));
}

}  // namespace
}  // namespace oomless
