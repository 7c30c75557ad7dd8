// Gradients as backward finishes them: Model::on_grads_final fires once per group as soon as its gradients
// are final (they do not change afterwards), the trainer's clipping norm is taken there (bit for bit the
// norm of a pass after backward), and --step-in-backward steps each layer at that moment, with one layer's
// gradient storage for the whole model, to the same parameters as stepping after backward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "io/json.h"
#include "model/model.h"
#include "optim/clip.h"
#include "train/trainer.h"
#include "util/harness.h"
#include "util/train_fixture.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;
using test::slurp;

// The shared micro config with batch 1 (--step-in-backward refuses batch x accumulation > 1).
TrainConfig micro(const std::string& out) {
  TrainConfig c = test::micro(out);
  c.batch = 1;
  return c;
}

std::vector<std::string> column(const std::string& out, const char* key) {
  std::vector<std::string> v;
  std::ifstream f(out + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    json::Value o = json::parse(line);
    if (o.find("type") && o.at("type").as_string() == "eval") continue;
    v.push_back(json::dump(o.at(key)));
  }
  return v;
}

// A step's sequences drawn from a fixed pattern over the vocabulary (no data files needed).
StepBatch pattern_batch(int64_t n, int64_t T, int64_t V, int salt) {
  StepBatch b;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int32_t> ids(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>((t * 131 + i * 17 + salt * 7 + 3) % V);
    std::vector<int32_t> tg(ids.begin() + 1, ids.end());
    tg.push_back(-100);
    b.ids.push_back(ids);
    b.targets.push_back(tg);
  }
  return b;
}

struct Case {
  const char* what;
  std::string model;
  int64_t lora = 0, chunk = 0, batch = 1;
  bool dora = false;
  std::string modules_to_save;
};

// The Qwen3 golden model (untied head, q/k norms) with an end-of-sequence id, which a training run needs.
std::string qwen3_folder() {
  const fs::path dir = fs::path(testing::TempDir()) / "oomless_sib_qwen3";
  fs::create_directories(dir);
  const fs::path src = test::source_path("tests/golden/models/qwen3");
  fs::copy_file(src / "model.safetensors", dir / "model.safetensors", fs::copy_options::overwrite_existing);
  json::Value cfg = json::parse_file((src / "config.json").string());
  cfg.set("eos_token_id", json::Value::integer(0));
  std::ofstream(dir / "config.json") << json::dump(cfg);
  return dir.string();
}

std::vector<Case> cases() {
  const std::string qwen3 = qwen3_folder();
  return {
      {"micro full (tied)", "preset:micro", 0, 0, 1, false, ""},
      {"micro full, 2 sequences", "preset:micro", 0, 0, 2, false, ""},
      {"micro full, chunked", "preset:micro", 0, 16, 1, false, ""},
      {"micro lora + embed", "preset:micro", 4, 0, 1, false, "embed_tokens"},
      {"micro dora, chunked", "preset:micro", 4, 16, 1, true, ""},
      {"qwen3 full (untied, q/k norms)", qwen3, 0, 0, 1, false, ""},
      {"qwen3 lora + head", qwen3, 4, 0, 1, false, "lm_head"},
  };
}

TrainConfig case_config(const Case& k) {
  TrainConfig c = micro("");
  c.data.clear();
  c.out.clear();
  c.model = k.model;
  c.lora = k.lora;
  c.dora = k.dora;
  c.modules_to_save = k.modules_to_save;
  c.chunk = k.chunk;
  c.batch = k.batch;
  c.clip = 0;
  return c;
}

// Every group fires once, in backward's order, and no gradient changes after its group fired.
TEST(GradsFinal, EachGroupFiresOnceWhenItsGradientsAreFinal) {
  for (const Case& k : cases()) {
    SCOPED_TRACE(k.what);
    Trainer t(case_config(k), "");
    Model& m = *t.engine().model;
    Ops& ops = *t.engine().ops;
    const ModelConfig& cfg = m.config();
    const TrainableSet set = m.trainable();
    std::map<int64_t, std::vector<size_t>> members;
    for (size_t i = 0; i < set.size(); ++i) members[set[i].group].push_back(i);
    EXPECT_TRUE(members.count(0) && members.count(cfg.L - 1)) << "every layer trains something";
    const int64_t T = t.config().seq;
    const StepBatch b = pattern_batch(1, T, cfg.V, 0);
    const Tensor ids(const_cast<int32_t*>(b.ids[0].data()), DType::i32, {T});
    const Tensor tg(const_cast<int32_t*>(b.targets[0].data()), DType::i32, {T});
    std::vector<int64_t> order;
    std::vector<double> at_fire(set.size(), NAN);
    m.zero_grads();
    m.on_grads_final([&](int64_t g) {
      order.push_back(g);
      for (size_t i : members[g]) at_fire[i] = ops.sum_squares(set[i].grad);
    });
    if (t.kv()) {
      m.chunked_step(ids, tg, t.chunk(), *t.kv(), 1.0 / static_cast<double>(T - 1));
    } else {
      m.forward(ids, tg, true, 1.0 / static_cast<double>(T - 1));
      m.backward(1.0 / static_cast<double>(T - 1));
    }
    std::vector<int64_t> want{kHeadGroup};
    for (int64_t l = cfg.L - 1; l >= 0; --l) want.push_back(l);
    want.push_back(kEmbedGroup);
    EXPECT_EQ(order, want);
    for (size_t i = 0; i < set.size(); ++i) {
      const double now = ops.sum_squares(set[i].grad);
      EXPECT_EQ(at_fire[i], now) << set[i].name << " changed after its group (" << set[i].group << ") fired";
      // LoRA's B starts at zero, so A's first gradient is zero
      if (set[i].name.find("lora_A") == std::string::npos) {
        EXPECT_GT(now, 0) << set[i].name;
      }
    }
    // the hook is dropped after its pass
    order.clear();
    if (!t.kv()) {
      m.forward(ids, tg, true, 1.0);
      m.backward(1.0);
      EXPECT_TRUE(order.empty());
    }
  }
}

// The trainer's norm is taken as backward finishes each gradient: equal, bit for bit, to the norm of the
// gradients after the step (clip 0 and AdamW leave them as backward made them).
TEST(GradsFinal, TheStepsNormIsThePassAftersBitForBit) {
  for (const Case& k : cases()) {
    SCOPED_TRACE(k.what);
    Trainer t(case_config(k), "");
    for (int s = 0; s < 2; ++s) {
      const StepResult r = t.step(pattern_batch(k.batch, t.config().seq, t.engine().src.cfg.V, s));
      ASSERT_FALSE(r.skipped);
      EXPECT_EQ(r.grad_norm, global_grad_norm(*t.engine().ops, t.engine().model->trainable()));
    }
  }
}

// --step-in-backward gives the parameters, losses and norms of stepping after backward, for every
// optimizer, without clipping and with --clip-norm previous (where the clip bites).
TEST(StepInBackward, EqualsSteppingAfterBackwardBitForBit) {
  struct Run {
    std::string optim;
    int64_t lora;
    double clip;
  };
  for (const Run& run : {Run{"adamw", 0, 0}, Run{"adamw8bit", 0, 0}, Run{"galore", 0, 0}, Run{"adamw", 4, 0},
                         Run{"adamw", 0, 0.05}, Run{"galore8bit", 0, 0.05}, Run{"adamw8bit", 4, 0.05}}) {
    SCOPED_TRACE(run.optim + " lora " + std::to_string(run.lora) + " clip " + std::to_string(run.clip));
    const std::string a = testing::TempDir() + "/oomless_sib_after", b = testing::TempDir() + "/oomless_sib_in";
    TrainConfig ca = micro(a);
    ca.optim = run.optim;
    ca.lora = run.lora;
    ca.clip = run.clip;
    if (run.clip > 0) ca.clip_norm = "previous";
    if (run.optim.rfind("galore", 0) == 0) ca.galore_rank = 8, ca.galore_gap = 2;
    TrainConfig cb = ca;
    cb.out = b;
    cb.step_in_backward = true;
    fs::remove_all(b);
    ASSERT_EQ(run_training(ca), 0);
    ASSERT_EQ(run_training(cb), 0);
    const char* weights = run.lora ? "adapter_model.safetensors" : "model.safetensors";
    EXPECT_TRUE(slurp(a + "/checkpoint-4/" + weights) == slurp(b + "/checkpoint-4/" + weights));
    EXPECT_TRUE(slurp(a + "/checkpoint-4/optimizer.safetensors") == slurp(b + "/checkpoint-4/optimizer.safetensors"));
    EXPECT_EQ(column(a, "loss"), column(b, "loss"));
    EXPECT_EQ(column(a, "grad_norm"), column(b, "grad_norm"));
    if (run.clip > 0) {
      for (const std::string& n : column(a, "grad_norm")) EXPECT_GT(std::stod(n), run.clip) << "the clip must bite";
    }
  }
}

// The clip by the previous step's norm is a real clip (the run differs from no clip), starts at step 2,
// and a resumed run takes the norm from the checkpoint (bit-exact resume).
TEST(StepInBackward, PreviousNormClipResumesBitExact) {
  const std::string whole = testing::TempDir() + "/oomless_sib_whole", split = testing::TempDir() + "/oomless_sib_split",
                    free = testing::TempDir() + "/oomless_sib_free";
  TrainConfig c = micro(whole);
  c.step_in_backward = true;
  c.clip = 0.05;
  c.clip_norm = "previous";
  ASSERT_EQ(run_training(c), 0);
  TrainConfig f = micro(free);
  f.step_in_backward = true;
  f.clip = 0;
  ASSERT_EQ(run_training(f), 0);
  EXPECT_EQ(column(whole, "loss")[0], column(free, "loss")[0]);
  EXPECT_EQ(column(whole, "loss")[1], column(free, "loss")[1]) << "step 1 has no previous norm: unclipped";
  EXPECT_NE(column(whole, "loss")[2], column(free, "loss")[2]);
  TrainConfig s = micro(split);
  s.step_in_backward = true;
  s.clip = 0.05;
  s.clip_norm = "previous";
  ASSERT_EQ(run_training(s), 0);
  fs::remove_all(split + "/checkpoint-4");
  s.resume = true;
  ASSERT_EQ(run_training(s), 0);
  EXPECT_TRUE(slurp(whole + "/checkpoint-4/model.safetensors") == slurp(split + "/checkpoint-4/model.safetensors"));
  EXPECT_EQ(column(whole, "loss"), column(split, "loss"));
}

// One layer's gradient storage: the ledger's grads are the model's less L - 1 layers.
TEST(StepInBackward, HoldsOneLayersGradients) {
  TrainConfig c = micro("");
  c.data.clear();
  c.out.clear();
  c.clip = 0;
  auto grads_bytes = [](Trainer& t) {
    size_t n = 0;
    for (Tier tier : {Tier::Device, Tier::Host}) n += t.engine().mem->ledger.peak(tier, Category::grads);
    return n;
  };
  Trainer plain(c, "");
  c.step_in_backward = true;
  Trainer sib(c, "");
  const ModelConfig& cfg = plain.engine().src.cfg;
  const int64_t layer = (cfg.param_count() - cfg.V * cfg.E - cfg.E) / cfg.L;  // tied: embed once, final norm
  EXPECT_EQ(grads_bytes(plain), static_cast<size_t>(4 * cfg.param_count()));
  EXPECT_EQ(grads_bytes(sib), static_cast<size_t>(4 * (cfg.param_count() - (cfg.L - 1) * layer)));
  EXPECT_TRUE(sib.engine().model->layer_grads_shared());
}

TEST(StepInBackward, RefusesWhatItCannotCombineWith) {
  struct Bad {
    const char* what;
    std::function<void(TrainConfig&)> set;
    const char* names;
  };
  const std::vector<Bad> bad = {
      {"batch", [](TrainConfig& c) { c.batch = 2; }, "--batch 1 --grad-accum 1"},
      {"accumulation", [](TrainConfig& c) { c.grad_accum = 2; }, "--grad-accum"},
      {"chunks", [](TrainConfig& c) { c.chunk = 16; }, "--chunk"},
      {"clip now", [](TrainConfig& c) { c.clip = 1.0; }, "--clip-norm previous"},
  };
  for (const Bad& k : bad) {
    SCOPED_TRACE(k.what);
    TrainConfig c = micro(testing::TempDir() + "/oomless_sib_bad");
    c.step_in_backward = true;
    c.clip = 0;
    k.set(c);
    try {
      run_training(c);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(k.names), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("--step-in-backward"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(c.out + "/checkpoint-2"));
  }
  TrainConfig c = micro(testing::TempDir() + "/oomless_sib_bad");
  c.clip_norm = "last";
  EXPECT_THROW(run_training(c), Error);
  c.clip_norm = "previous";
  c.clip = 0;
  try {
    run_training(c);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--clip"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace oomless
