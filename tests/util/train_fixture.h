// Shared by the trainer tests: a micro training config writing to `out` (emptied first), a file's bytes,
// and the training losses of a run's metrics.jsonl as printed.
#pragma once
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "io/json.h"
#include "train/trainer.h"
#include "util/harness.h"

namespace oomless::test {

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

inline TrainConfig micro(const std::string& out) {
  TrainConfig c;
  c.model = "preset:micro";
  c.data = source_path("data/kjv/eval.txt");
  c.out = out;
  c.seq = 64;
  c.batch = 2;
  c.steps = 4;
  c.warmup = 1;
  c.lr = 3e-3;
  c.save_every = 2;
  c.keep = 0;
  c.eval_every = 0;
  std::filesystem::remove_all(out);
  return c;
}

inline std::vector<std::string> losses(const std::string& out) {
  std::vector<std::string> v;
  std::ifstream f(out + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    json::Value o = json::parse(line);
    if (o.find("type") && o.at("type").as_string() == "eval") continue;
    v.push_back(json::dump(o.at("loss")));
  }
  return v;
}

// The run `c` once more into `split` (emptied), stopped after its step-2 checkpoint as if killed there (the
// step-4 one removed), then resumed: returns the resumed config (resume = true, out = split).
inline TrainConfig run_interrupted(TrainConfig c, const std::string& split) {
  c.out = split;
  std::filesystem::remove_all(split);
  EXPECT_EQ(run_training(c), 0);
  std::filesystem::remove_all(split + "/checkpoint-4");
  c.resume = true;
  EXPECT_EQ(run_training(c), 0);
  return c;
}

// Two runs' step-4 weights (and optimizer state) and training losses are the same bytes.
inline void expect_same_run(const std::string& a, const std::string& b, bool optimizer = true) {
  EXPECT_TRUE(slurp(a + "/checkpoint-4/model.safetensors") == slurp(b + "/checkpoint-4/model.safetensors"));
  if (optimizer) {
    EXPECT_TRUE(slurp(a + "/checkpoint-4/optimizer.safetensors") == slurp(b + "/checkpoint-4/optimizer.safetensors"));
  }
  EXPECT_EQ(losses(a), losses(b));
}

// A run of `c` is refused at setup with an error whose text holds `message`.
inline void expect_refused(const TrainConfig& c, const std::string& message) {
  try {
    run_training(c);
    ADD_FAILURE() << "no error (expected one saying: " << message << ")";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

}  // namespace oomless::test
