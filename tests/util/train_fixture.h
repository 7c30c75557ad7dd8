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

}  // namespace oomless::test
