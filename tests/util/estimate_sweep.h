// The configurations the estimate is held to the ledger over (tests/estimate_test.cpp; the tiny and
// smollm2-shaped sweeps in tests/estimate_slowtest.cpp): every memory option, each run set up and stepped once.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "io/json.h"
#include "train/estimate.h"
#include "train/trainer.h"
#include "util/harness.h"

namespace oomless::test {

struct Sweep {
  std::string what;
  TrainConfig c;
};

// model: "preset:micro" or "preset:tiny" (every option on it), or "preset:smollm2-135m" (three runs).
inline std::vector<Sweep> sweep(const std::string& model) {
  const std::string here = std::filesystem::current_path().string();  // the build folder: not tmpfs
  std::vector<Sweep> v;
  auto add = [&](const std::string& what, const std::string& model, int64_t seq, auto&& set) {
    TrainConfig c;
    c.model = model;
    c.seq = seq;
    c.batch = 1;
    c.steps = 1;
    c.lr = 1e-3;
    c.warmup = 1;
    c.eval_every = 0;
    set(c);
    if (c.kv_offload == "disk" || c.act_offload.find("disk") != std::string::npos || c.optim_state == "disk")
      c.spill_dir = here;
    v.push_back({model + " T=" + std::to_string(seq) + " " + what, c});
  };
  auto none = [](TrainConfig&) {};
  // A copy of a golden folder whose config names no EOS token (Qwen's), with one: training packs with it.
  auto with_eos = [&](const std::string& dir) {
    const std::string out = here + "/estimate_" + std::filesystem::path(dir).filename().string();
    std::filesystem::create_directories(out);
    json::Value cfg = json::parse_file(dir + "/config.json");
    cfg.set("eos_token_id", json::Value::integer(1));
    std::ofstream(out + "/config.json") << json::dump(cfg);
    std::filesystem::copy_file(dir + "/model.safetensors", out + "/model.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    return out;
  };
  if (model == "files") {  // the bases a user brings: a GGUF kept in its blocks, a bitsandbytes 4-bit folder, Qwen's
    const std::string g = source_path("tests/golden/");  // biases and q/k norms
    add("gguf lora", g + "gguf/small.gguf", 32, [](TrainConfig& c) { c.lora = 4; });
    add("gguf full", g + "gguf/small.gguf", 32, none);
    add("bnb4 lora bf16", g + "bnb4/llama_gqa_untied", 32, [](TrainConfig& c) { c.lora = 4, c.dtype = "bf16"; });
    const std::string qwen3 = with_eos(g + "models/qwen3"), qwen2 = with_eos(g + "models/qwen2");
    add("qwen3 full", qwen3, 32, none);
    add("qwen3 dora selective", qwen3, 32, [](TrainConfig& c) { c.lora = 4, c.dora = true, c.save_policy = "selective"; });
    add("qwen2 lora nf4", qwen2, 32, [](TrainConfig& c) { c.lora = 4, c.base_dtype = "nf4"; });
    add("attention bias galore", g + "models/llama_attn_bias", 32, [](TrainConfig& c) { c.optim = "galore", c.galore_rank = 4; });
    return v;
  }
  if (model != "preset:smollm2-135m") {
    const std::string m = model;
    add("full fp32", m, 128, none);
    add("full bf16", m, 128, [](TrainConfig& c) { c.dtype = "bf16"; });
    add("selective", m, 128, [](TrainConfig& c) { c.save_policy = "selective"; });
    add("none", m, 256, [](TrainConfig& c) { c.save_policy = "none"; });
    add("per-layer policies", m, 128, [](TrainConfig& c) { c.save_policy = "none,all:0,selective:1"; });
    add("act bf16", m, 128, [](TrainConfig& c) { c.act_dtype = "bf16"; });
    add("act fp8 + bf16", m, 128, [](TrainConfig& c) { c.act_dtype = "fp8", c.dtype = "bf16"; });
    add("act offload host", m, 128, [](TrainConfig& c) { c.act_offload = "host"; });
    add("act offload disk", m, 128, [](TrainConfig& c) { c.act_offload = "disk", c.save_policy = "selective"; });
    add("adamw8bit", m, 128, [](TrainConfig& c) { c.optim = "adamw8bit"; });
    add("galore", m, 128, [](TrainConfig& c) { c.optim = "galore"; });
    add("galore8bit rank 32", m, 128, [](TrainConfig& c) { c.optim = "galore8bit", c.galore_rank = 32; });
    add("optimizer on device", m, 128, [](TrainConfig& c) { c.optim_state = "device"; });
    add("optimizer on disk", m, 128, [](TrainConfig& c) { c.optim_state = "disk"; });
    add("adamw8bit on disk", m, 128, [](TrainConfig& c) { c.optim_state = "disk", c.optim = "adamw8bit"; });
    add("step in backward", m, 128, [](TrainConfig& c) { c.step_in_backward = true, c.clip = 0; });
    add("lora 8", m, 128, [](TrainConfig& c) { c.lora = 8; });
    add("lora 16 q,v bf16", m, 128, [](TrainConfig& c) { c.lora = 16, c.lora_targets = "q,v", c.dtype = "bf16"; });
    add("lora dropout", m, 128, [](TrainConfig& c) { c.lora = 8, c.lora_dropout = 0.1; });
    add("dora", m, 128, [](TrainConfig& c) { c.lora = 8, c.dora = true; });
    add("dora dropout none", m, 128, [](TrainConfig& c) { c.lora = 4, c.dora = true, c.lora_dropout = 0.1, c.save_policy = "none"; });
    add("qlora", m, 128, [](TrainConfig& c) { c.lora = 8, c.qlora = true; });
    add("nf4 + bf16 tables", m, 128, [](TrainConfig& c) { c.lora = 8, c.base_dtype = "nf4", c.embed_dtype = "bf16"; });
    add("bf16 base and tables", m, 128, [](TrainConfig& c) {
      c.lora = 8, c.base_dtype = "bf16", c.embed_dtype = "bf16", c.dtype = "bf16";
    });
    add("qlora nf4 tables", m, 128, [](TrainConfig& c) { c.lora = 8, c.qlora = true, c.embed_dtype = "nf4"; });
    add("lora modules_to_save", m, 128, [](TrainConfig& c) { c.lora = 8, c.modules_to_save = "lm_head"; });
    add("lora adamw8bit on disk", m, 128, [](TrainConfig& c) { c.lora = 8, c.optim = "adamw8bit", c.optim_state = "disk"; });
    add("chunk", m, 256, [](TrainConfig& c) { c.chunk = 64; });
    add("chunk none bf16 kv", m, 256, [](TrainConfig& c) { c.chunk = 64, c.save_policy = "none", c.kv_dtype = "bf16"; });
    add("chunk kv host", m, 256, [](TrainConfig& c) { c.chunk = 64, c.kv_offload = "host"; });
    add("chunk kv disk fp8", m, 256, [](TrainConfig& c) { c.chunk = 64, c.kv_offload = "disk", c.kv_dtype = "fp8"; });
    add("chunk sparse", m, 512, [](TrainConfig& c) { c.chunk = 64, c.page = 16, c.sparse_pages = 2; });
    add("chunk sparse mean host", m, 512, [](TrainConfig& c) {
      c.chunk = 128, c.page = 32, c.sparse_pages = 1, c.page_summary = "mean", c.kv_offload = "host";
    });
    add("chunk lora", m, 256, [](TrainConfig& c) { c.chunk = 128, c.lora = 8; });
  }
  if (model == "preset:tiny") {
    add("act offload per layer", model, 128, [](TrainConfig& c) {
      c.act_offload = "disk:0,host:1-2,none", c.save_policy = "all:0,selective:1,none:2,all";
    });
    add("full fp32", model, 512, none);
    add("none bf16", model, 1024, [](TrainConfig& c) { c.save_policy = "none", c.dtype = "bf16"; });
  }
  if (model != "preset:smollm2-135m") return v;
  const char* s = "preset:smollm2-135m";
  add("lora 16", s, 128, [](TrainConfig& c) { c.lora = 16; });
  add("qlora bf16", s, 128, [](TrainConfig& c) { c.lora = 16, c.qlora = true, c.dtype = "bf16"; });
  add("full adamw8bit selective", s, 64, [](TrainConfig& c) { c.optim = "adamw8bit", c.save_policy = "selective"; });
  return v;
}

// Within 5%, or a few KiB for a category that small (page tables and selection counts).
inline bool close(size_t est, size_t got) {
  const double e = static_cast<double>(est), g = static_cast<double>(got);
  return std::abs(e - g) <= std::max(0.05 * g, 4096.0);
}

inline void check_sweep(const std::vector<Sweep>& cases) {
  for (const Sweep& k : cases) {
    SCOPED_TRACE(k.what);
    MemoryEstimate est;
    ASSERT_NO_THROW(est = estimate_training(k.c)) << k.what;
    Trainer t(k.c, "");
    t.step(synthetic_batch(1, k.c.seq, t.engine().src.cfg.V));
    const Ledger& l = t.engine().mem->ledger;
    for (int ti = 0; ti < kTierCount; ++ti) {
      const Tier tier = static_cast<Tier>(ti);
      for (int ci = 0; ci < kCategoryCount; ++ci) {
        const Category cat = static_cast<Category>(ci);
        EXPECT_TRUE(close(est.at(tier, cat), l.peak(tier, cat)))
            << k.what << ": " << tier_name(tier) << " " << category_name(cat) << " estimated " << est.at(tier, cat)
            << ", ledger " << l.peak(tier, cat);
      }
      EXPECT_TRUE(close(est.peak(tier), l.peak_total(tier)))
          << k.what << ": " << tier_name(tier) << " peak estimated " << est.peak(tier) << ", ledger " << l.peak_total(tier);
    }
  }
}

}  // namespace oomless::test
