// The closed-form estimate (train/estimate.h) against the ledger: a sweep of configurations (util/estimate_sweep.h)
// each set up and stepped once, every (tier, category) and every tier's peak within 5% of what the ledger
// recorded; the per-layer figures a planner weighs; errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "train/estimate.h"
#include "train/trainer.h"
#include "util/estimate_sweep.h"

namespace oomless {
namespace {

// Every option on micro (the fast suite's share of the sweep; tiny's and smollm2's are slow tests), the bases
// users bring (GGUF, bitsandbytes 4-bit, Qwen2/3 folders) and nine options on tiny: over 40 runs. Under the
// sanitizers, tiny's nine are left out (the same code as micro's, and most of the time there).
TEST(Estimate, EveryCategoryAndPeakWithinFivePercentOfTheLedgerOverASweep) {
  std::vector<test::Sweep> cases = test::sweep("preset:micro");
  for (const test::Sweep& k : test::sweep("files")) cases.push_back(k);
#if !defined(OOMLESS_SANITIZED)
  for (const test::Sweep& k : test::sweep("preset:tiny"))
    for (const char* w : {"full fp32", "full bf16", "lora 8", "qlora", "chunk", "act offload host", "adamw8bit",
                          "optimizer on disk", "act offload per layer"})
      if (k.what == "preset:tiny T=128 " + std::string(w) || k.what == "preset:tiny T=256 " + std::string(w)) cases.push_back(k);
  ASSERT_GE(cases.size(), 40u);
#endif
  test::check_sweep(cases);
}

// A layer's activations per policy: what the planner weighs. all > selective > none = 0 and the sum over the
// layers of the chosen policy is what the run keeps beside the residual stream.
TEST(Estimate, PerLayerActivationsOrderThePolicies) {
  TrainConfig c;
  c.model = "preset:tiny";
  c.seq = 128;
  const MemoryEstimate e = estimate_training(c);
  ASSERT_EQ(e.layer_activations.size(), 6u);
  for (const auto& l : e.layer_activations) {
    EXPECT_GT(l[0], l[1]);
    EXPECT_GT(l[1], 0u);
    EXPECT_EQ(l[2], 0u);
  }
  TrainConfig n = c;
  n.save_policy = "none";
  const MemoryEstimate en = estimate_training(n);
  size_t kept = 0;
  for (const auto& l : e.layer_activations) kept += l[0];
  EXPECT_EQ(e.at(Tier::Device, Category::activations) - en.at(Tier::Device, Category::activations), kept);
}

TEST(Estimate, ErrorsNameTheFlag) {
  TrainConfig c;
  c.model = "preset:tiny";
  c.seq = 128;
  c.optim = "galore";
  c.galore_rank = 5000;
  try {
    estimate_training(c);
    FAIL() << "a GaLore rank above the matrices was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--galore-rank"), std::string::npos) << e.what();
  }
  c = TrainConfig{};
  c.model = "preset:tiny";
  c.chunk = 100;
  c.seq = 400;
  c.page = 7;
  EXPECT_THROW(estimate_training(c), Error);
}

}  // namespace
}  // namespace oomless
