// ModelConfig from config.json: transformers' defaults and switches per architecture, and clear errors
// for what the decoder does not implement; model folders whose weights disagree with their config.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/load.h"
#include "util/harness.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;

ModelConfig parse(const std::string& text) { return ModelConfig::from_json(json::parse(text), "config.json"); }

std::string error_of(const std::string& text) {
  try {
    parse(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Config, LlamaDefaultsAndAttentionBias) {
  ModelConfig c = parse(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
      "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100, "attention_bias": true, "unknown_key": [1]})");
  EXPECT_EQ(c.arch, Arch::llama);
  EXPECT_EQ(c.Hkv, 4);  // defaults to num_attention_heads
  EXPECT_EQ(c.D, 16);
  EXPECT_DOUBLE_EQ(c.rms_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_FALSE(c.tied);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.o_bias);  // Llama's attention_bias also puts a bias on o_proj
  EXPECT_FALSE(c.qk_norm);
}

TEST(Config, Qwen2BiasesAreBuiltInQwen3HasNormsAndHeadDim) {
  ModelConfig q2 = parse(R"({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100})");
  EXPECT_TRUE(q2.qkv_bias);
  EXPECT_FALSE(q2.o_bias);
  EXPECT_EQ(q2.sliding_window, 0);  // use_sliding_window defaults to false
  ModelConfig q3 = parse(R"({"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 24,
      "num_key_value_heads": 2, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100})");
  EXPECT_EQ(q3.arch, Arch::qwen3);
  EXPECT_TRUE(q3.qk_norm);
  EXPECT_EQ(q3.D, 24);
  EXPECT_EQ(q3.q_dim(), 96);
  EXPECT_FALSE(q3.qkv_bias);
}

TEST(Config, RopeScalingBothSpellingsAndTiedEmbeddings) {
  ModelConfig a = parse(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
      "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100, "tie_word_embeddings": true,
      "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})");
  EXPECT_TRUE(a.tied);
  EXPECT_TRUE(a.rope.llama3);
  EXPECT_DOUBLE_EQ(a.rope.factor, 32.0);
  EXPECT_DOUBLE_EQ(a.rope.theta, 500000.0);
  ModelConfig b = parse(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
      "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100,
      "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}})");
  EXPECT_FALSE(b.rope.llama3);
  EXPECT_DOUBLE_EQ(b.rope.theta, 1e6);
  // to_json -> from_json keeps everything.
  ModelConfig c = ModelConfig::from_json(a.to_json(), "round trip");
  EXPECT_EQ(c.param_count(), a.param_count());
  EXPECT_TRUE(c.rope.llama3 && c.tied);
  EXPECT_DOUBLE_EQ(c.rope.original_max_position, 8192.0);
}

TEST(Config, UnsupportedValuesSayWhatIsSupported) {
  const std::string base = R"("hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
      "num_hidden_layers": 2, "vocab_size": 100)";
  EXPECT_NE(error_of(R"({"architectures": ["GPT2LMHeadModel"], )" + base + "}").find("supported: LlamaForCausalLM"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu", )" + base + "}").find("silu"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"architectures": ["LlamaForCausalLM"], "mlp_bias": true, )" + base + "}").find("mlp_bias"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"type": "yarn", "factor": 4}, )" + base +
                     "}")
                .find("supported: none/default and llama3"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 3, )" + base + "}")
                .find("multiple of num_key_value_heads"),
            std::string::npos);
  EXPECT_NE(error_of("[1, 2]").find("must be a JSON object"), std::string::npos);
  EXPECT_NE(error_of(R"({"hidden_size": 64})").find("which model"), std::string::npos);
  EXPECT_NE(error_of(R"({"architectures": ["LlamaForCausalLM"], "vocab_size": "big"})").find("vocab_size"),
            std::string::npos);
  // Mistral's window defaults to 4096: longer sequences are refused with the limit named.
  ModelConfig m = parse(R"({"architectures": ["MistralForCausalLM"], "num_key_value_heads": 2, )" + base + "}");
  EXPECT_EQ(m.sliding_window, 4096);
  EXPECT_NO_THROW(m.check_sequence(4096));
  try {
    m.check_sequence(4097);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sliding_window 4096"), std::string::npos) << e.what();
  }
}

TEST(Config, PresetsHaveTheirShapes) {
  ModelConfig micro = preset_config("micro"), tiny = preset_config("tiny"), smol = preset_config("smollm2-135m");
  EXPECT_EQ(micro.L * 1000 + micro.E, 2064);
  EXPECT_EQ(tiny.E, 384);
  EXPECT_EQ(tiny.D, 64);
  EXPECT_EQ(smol.param_count(), 134515008);  // SmolLM2-135M (tied)
  EXPECT_THROW(preset_config("huge"), Error);
}

// A model folder whose weights disagree with config.json fails naming the tensor and both shapes; a
// missing tensor names the tensor.
TEST(Config, WeightsThatDisagreeWithTheConfigAreRefused) {
  const fs::path src = test::source_path("tests/golden/models/llama_gqa_untied");
  const fs::path dir = fs::path(testing::TempDir()) / "oomless_bad_model";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(src / "model.safetensors", dir / "model.safetensors");
  json::Value cfg = json::parse_file((src / "config.json").string());
  cfg.set("intermediate_size", json::Value::integer(cfg.at("intermediate_size").as_int() + 8));
  std::ofstream(dir / "config.json") << json::dump(cfg);
  ModelSource m = open_model(dir.string());
  Ledger ledger;
  Arena arena(Tier::Host, size_t{1} << 30, ledger);
  ParamSet p(m.cfg, DType::f32, arena, Category::weights);
  try {
    m.load_weights(p);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("mlp.gate_proj.weight"), std::string::npos) << w;
    EXPECT_NE(w.find("expected"), std::string::npos) << w;
  }
  cfg.set("intermediate_size", json::Value::integer(cfg.at("intermediate_size").as_int() - 8));
  cfg.set("num_hidden_layers", json::Value::integer(3));
  std::ofstream(dir / "config.json") << json::dump(cfg);
  ModelSource m3 = open_model(dir.string());
  ParamSet p3(m3.cfg, DType::f32, arena, Category::weights);
  try {
    m3.load_weights(p3);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.2."), std::string::npos) << e.what();
  }
  EXPECT_THROW(open_model((dir / "nothing-here").string()), Error);
  EXPECT_THROW(open_model("preset:nope"), Error);
}

}  // namespace
}  // namespace oomless
