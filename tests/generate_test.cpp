// Generation: the chat prompt (the template's add_generation_prompt) against transformers'
// apply_chat_template, and the sampling controls (top-k, repetition penalty) against their definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>
#include <cstring>
#include <memory>

#include "data/chat.h"
#include "io/json.h"
#include "memory/arena.h"
#include "model/generate.h"
#include "model/model.h"
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

// A micro model (weights drawn with std `init_std`), a prompt of P = 24 ids and 6 decode steps, and decode
// caches of any storage (fp8 / int8 with their row scales).
struct DecodeRig {
  static constexpr int64_t P = 24, steps = 6, cap = P + steps;
  ModelConfig cfg = preset_config("micro");
  CpuMemory mem{size_t{1} << 32};
  std::unique_ptr<Ops> ops = make_ops("cpu", &mem.device);
  ParamSet params{cfg, DType::f32, mem.device, Category::weights};
  std::unique_ptr<Model> model;
  std::vector<int32_t> ids;
  using Cache = DecodeCache;
  explicit DecodeRig(double init_std) {
    init_random(*ops, params, 5, init_std);
    model = std::make_unique<Model>(cfg, *ops, params, mem.device);
    ids.resize(static_cast<size_t>(cap));
    for (int64_t t = 0; t < cap; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>((t * 977 + 5) % cfg.V);
    model->reserve(P, false);
  }
  Cache make(DType dt) { return make_decode_cache(mem.device, cfg, cap, dt); }
  // The ledger's peak kv bytes of generate() with the cache in `dt`.
  size_t kv_bytes(DType dt) {
    CpuMemory m2(size_t{1} << 32);
    GenerateOptions o;
    o.max_new = 4;
    o.kv_dtype = dt;
    generate(*model, m2.device, std::vector<int32_t>(ids.begin(), ids.begin() + 8), o);
    return m2.ledger.peak(Tier::Device, Category::kv);
  }
};

// generate --kv-dtype bf16: the cache holds each key and value rounded to bf16 from the fp32 the model made
// (bit for bit, in layer 0, whose keys depend on the tokens alone), half the cache's bytes, and logits close
// to the fp32 cache's (within 5%) but not equal.
TEST(Generate, Bf16KvCacheHoldsTheRoundedKeysInHalfTheBytes) {
  DecodeRig r(0.3);
  const ModelConfig& cfg = r.cfg;
  Model& m = *r.model;
  const int64_t P = r.P, steps = r.steps, cap = r.cap;
  std::vector<int32_t>& ids = r.ids;
  auto make = [&](DType dt) { return r.make(dt); };
  using Cache = DecodeRig::Cache;
  Cache f = make(DType::f32), b = make(DType::bf16);
  std::vector<float> lf(static_cast<size_t>(cfg.V)), lb(lf.size());
  for (int64_t s = 0; s <= steps; ++s) {
    const int64_t t0 = s == 0 ? 0 : P + s - 1, n = s == 0 ? P : 1;
    Tensor in(ids.data() + t0, DType::i32, {n});
    m.decode_forward(in, t0, f.slots, Tensor::of(lf.data(), {cfg.V}));
    m.decode_forward(in, t0, b.slots, Tensor::of(lb.data(), {cfg.V}));
    double num = 0, den = 0;
    bool same = true;
    for (size_t v = 0; v < lf.size(); ++v) {
      num += (lf[v] - lb[v]) * (lf[v] - lb[v]);
      den += lf[v] * lf[v];
      same &= lf[v] == lb[v];
    }
    EXPECT_LE(std::sqrt(num / den), 5e-2) << "step " << s;  // large weights (std 0.3): sharp attention
    EXPECT_FALSE(same) << "step " << s << ": the cache was not rounded";
  }
  const int64_t n = cfg.Hkv * cap * cfg.D;
  for (const Tensor* t : {&f.slots[0].k, &f.slots[0].v}) {
    const Tensor& r = t == &f.slots[0].k ? b.slots[0].k : b.slots[0].v;
    std::vector<uint16_t> want(static_cast<size_t>(n));
    const std::vector<float> wide = test::tensor_values<float>(*t);
    convert(want.data(), DType::bf16, wide.data(), DType::f32, n);
    EXPECT_EQ(std::memcmp(want.data(), test::tensor_values<uint16_t>(r).data(), static_cast<size_t>(n) * 2), 0);
  }
  // generate() keeps the cache in the dtype asked: the ledger's kv bytes halve
  EXPECT_EQ(2 * r.kv_bytes(DType::bf16), r.kv_bytes(DType::f32));
  GenerateOptions bad;
  bad.kv_dtype = DType::f8_e5m2;
  EXPECT_THROW(generate(m, r.mem.device, {1, 2, 3}, bad), Error);
}

// generate --kv-dtype fp8|int8: layer 0's cache (whose keys depend on the tokens alone) holds the row-scaled
// codes of the fp32 cache's keys and values; logits stay close to the fp32 cache's; the ledger's kv bytes are
// a quarter of fp32's plus 4 bytes per head and position for K and V each.
TEST(Generate, Fp8AndInt8KvCacheHoldTheRowScaledCodes) {
  DecodeRig r(0.1);
  const ModelConfig& cfg = r.cfg;
  Model& m = *r.model;
  Ops* ops = r.ops.get();
  const int64_t P = r.P, steps = r.steps, cap = r.cap;
  std::vector<int32_t>& ids = r.ids;
  auto make = [&](DType dt) { return r.make(dt); };
  using Cache = DecodeRig::Cache;
  double worst_of[2] = {0, 0};
  for (DType t : {DType::f8_e4m3, DType::i8}) {
    SCOPED_TRACE(dtype_name(t));
    Cache f = make(DType::f32), n = make(t);
    std::vector<float> lf(static_cast<size_t>(cfg.V)), ln(lf.size());
    double worst = 0;
    for (int64_t s = 0; s <= steps; ++s) {
      const int64_t t0 = s == 0 ? 0 : P + s - 1, cnt = s == 0 ? P : 1;
      Tensor in(ids.data() + t0, DType::i32, {cnt});
      m.decode_forward(in, t0, f.slots, Tensor::of(lf.data(), {cfg.V}));
      m.decode_forward(in, t0, n.slots, Tensor::of(ln.data(), {cfg.V}));
      double num = 0, den = 0;
      for (size_t v = 0; v < lf.size(); ++v) num += (lf[v] - ln[v]) * (lf[v] - ln[v]), den += lf[v] * lf[v];
      worst = std::max(worst, std::sqrt(num / den));
    }
    EXPECT_GT(worst, 0.0) << "the cache was not narrowed";
    // (Random micro weights: logits near zero, so their relative error is large; SmolLM2's is measured in
    // bench_kv_cache.) int8's step is finer than E4M3's 3 mantissa bits.
    EXPECT_LT(worst, t == DType::i8 ? 2.5e-2 : 1e-1);
    worst_of[t == DType::i8] = worst;
    const int64_t rows = cfg.Hkv * cap;
    for (int kv = 0; kv < 2; ++kv) {
      const Tensor& src = kv == 0 ? f.slots[0].k : f.slots[0].v;
      std::vector<Buffer> keep;
      const Tensor codes = test::arena_copy(r.mem.device, keep, nullptr, t, {rows, cfg.D}),
                   scales = test::arena_copy(r.mem.device, keep, nullptr, DType::f32, {rows});
      ops->cast_rows_scaled(codes, scales, Tensor(src, DType::f32, {rows, cfg.D}));
      const std::vector<uint8_t> want = test::tensor_values<uint8_t>(codes);
      const std::vector<float> want_s = test::tensor_values<float>(scales);
      EXPECT_EQ(std::memcmp(want.data(), test::tensor_values<uint8_t>(kv == 0 ? n.slots[0].k : n.slots[0].v).data(),
                            want.size()), 0);
      EXPECT_EQ(std::memcmp(want_s.data(),
                            test::tensor_values<float>(kv == 0 ? n.slots[0].k_scale : n.slots[0].v_scale).data(),
                            4 * want_s.size()), 0);
    }
  }
  EXPECT_LT(worst_of[1], worst_of[0]);
  const size_t f32 = r.kv_bytes(DType::f32);
  for (DType t : {DType::f8_e4m3, DType::i8}) EXPECT_EQ(r.kv_bytes(t), f32 / 4 + f32 / static_cast<size_t>(cfg.D)) << dtype_name(t);
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
