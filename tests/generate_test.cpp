// Generation: the chat prompt (the template's add_generation_prompt) against transformers'
// apply_chat_template, and the sampling controls (top-k, repetition penalty) against their definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "data/chat.h"
#include "io/json.h"
#include "model/generate.h"
#include "tokenizer/tokenizer.h"
#include "util/harness.h"

namespace oomless {
namespace {

std::vector<int32_t> ids_of(const json::Value& a) {
  std::vector<int32_t> v;
  for (const json::Value& x : a.as_array()) v.push_back(static_cast<int32_t>(x.as_int()));
  return v;
}

std::vector<ChatMessage> messages_of(const json::Value& a) {
  std::vector<ChatMessage> m;
  for (const json::Value& x : a.as_array()) m.push_back({x.at("role").as_string(), x.at("content").as_string()});
  return m;
}

// SmolLM2's chat prompt for generation is transformers' apply_chat_template(add_generation_prompt=True)
// id for id (tests/golden/smollm2/generate.json, made by tools/golden/make_smollm2.py).
TEST(Generate, ChatPromptIsTransformersAddGenerationPrompt) {
  const json::Value g = json::parse_file(test::source_path("tests/golden/smollm2/generate.json"));
  const json::Value chat = json::parse_file(test::source_path("tests/golden/chat/smollm2.json"));
  const Tokenizer tok = Tokenizer::from_file(test::source_path(chat.at("tokenizer").as_string()));
  const ChatTemplate ct = ChatTemplate::from_config(chat.at("tokenizer_config"));
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  ct.render(messages_of(g.at("messages")), tok, ids, mask, true);
  EXPECT_EQ(ids, ids_of(g.at("prompt_ids")));
  EXPECT_EQ(tok.decode(ids), g.at("prompt").as_string());
  EXPECT_EQ(std::string(ct.end_of_turn()), "<|im_end|>");
}

// For both template families: the prompt for the last assistant turn of each golden conversation is the
// beginning of transformers' rendering of the whole conversation (the header is the one the template
// writes before assistant content).
TEST(Generate, ChatPromptIsThePrefixOfTheRenderedConversation) {
  for (const char* name : {"smollm2", "llama3"}) {
    SCOPED_TRACE(name);
    const json::Value chat = json::parse_file(test::source_path(std::string("tests/golden/chat/") + name + ".json"));
    const Tokenizer tok = Tokenizer::from_file(test::source_path(chat.at("tokenizer").as_string()));
    const ChatTemplate ct = ChatTemplate::from_config(chat.at("tokenizer_config"));
    for (const json::Value& c : chat.at("cases").as_array()) {
      std::vector<ChatMessage> m = messages_of(c.at("messages"));
      ASSERT_EQ(m.back().role, "assistant");
      m.pop_back();
      std::vector<int32_t> prompt;
      std::vector<uint8_t> mask;
      ct.render(m, tok, prompt, mask, true);
      const std::vector<int32_t> whole = ids_of(c.at("ids"));
      ASSERT_LT(prompt.size(), whole.size());
      // The last prompt token may merge with the content's first characters (e.g. "\n\n" + "\n"):
      // all but the header's final piece must agree, and the next golden token must be supervised content.
      const size_t n = prompt.size() - 1;
      EXPECT_TRUE(std::equal(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(n), whole.begin()));
      EXPECT_EQ(std::string(ct.end_of_turn()), std::string(name) == "llama3" ? "<|eot_id|>" : "<|im_end|>");
    }
  }
}

// transformers' RepetitionPenaltyLogitsProcessor: a seen token's logit is divided by the penalty when
// positive and multiplied when negative; greedy then picks the best penalised logit.
TEST(Generate, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogits) {
  GenerateOptions o;
  uint64_t rng = 0;
  const std::vector<float> logits = {2.0f, 1.9f, -1.0f, -1.2f};
  EXPECT_EQ(sample_next(logits, o, {0}, rng), 0);  // no penalty
  o.repetition_penalty = 1.5;
  EXPECT_EQ(sample_next(logits, o, {0}, rng), 1);      // 2.0 / 1.5 < 1.9
  EXPECT_EQ(sample_next(logits, o, {0, 1}, rng), 0);   // 1.333 > 1.267
  const std::vector<float> neg = {-1.0f, -1.2f};
  EXPECT_EQ(sample_next(neg, o, {0}, rng), 1);         // -1.5 < -1.2
  o.repetition_penalty = 0.5;                          // < 1 favours repeats
  EXPECT_EQ(sample_next(logits, o, {1}, rng), 1);
}

// Top-k keeps the k most likely tokens; sampling then follows their renormalised probabilities.
TEST(Generate, TopKSamplesOnlyTheKMostLikelyInProportion) {
  GenerateOptions o;
  o.temperature = 1.0;
  o.top_k = 2;
  const std::vector<float> logits = {0.0f, 1.0f, std::log(3.0f), -0.5f};  // p ∝ 1, e, 3, e^-0.5
  std::map<int32_t, int> n;
  uint64_t rng = 7;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) ++n[sample_next(logits, o, {}, rng)];
  EXPECT_EQ(n.count(0) + n.count(3), 0u);
  const double p2 = 3.0 / (3.0 + std::exp(1.0));  // token 2 among the top 2
  const double f2 = static_cast<double>(n[2]) / draws;
  EXPECT_NEAR(f2, p2, 4 * std::sqrt(p2 * (1 - p2) / draws));
  o.top_k = 1;
  for (int i = 0; i < 100; ++i) EXPECT_EQ(sample_next(logits, o, {}, rng), 2);
}

}  // namespace
}  // namespace oomless
