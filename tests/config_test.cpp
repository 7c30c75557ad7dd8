// ModelConfig from config.json: transformers' defaults and switches per architecture, and clear errors
// for what the decoder does not implement; model folders whose weights disagree with their config.
#include <gtest/gtest.h>

#include <cmath>
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
  EXPECT_EQ(a.rope.scaling, RopeScaling::llama3);
  EXPECT_DOUBLE_EQ(a.rope.factor, 32.0);
  EXPECT_DOUBLE_EQ(a.rope.theta, 500000.0);
  ModelConfig b = parse(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
      "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100,
      "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}})");
  EXPECT_EQ(b.rope.scaling, RopeScaling::none);
  EXPECT_DOUBLE_EQ(b.rope.theta, 1e6);
  // to_json -> from_json keeps everything.
  ModelConfig c = ModelConfig::from_json(a.to_json(), "round trip");
  EXPECT_EQ(c.param_count(), a.param_count());
  EXPECT_TRUE(c.rope.scaling == RopeScaling::llama3 && c.tied);
  EXPECT_DOUBLE_EQ(c.rope.original_max_position, 8192.0);
}

TEST(Config, YarnAndLinearRopeScaling) {
  const std::string base = R"("architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100,
      "max_position_embeddings": 32768, )";
  // Qwen2.5's long-context form (transformers 4 spelling "type"): original from the key, the factor's
  // attention factor 1 + 0.1 ln 4.
  ModelConfig y = parse("{" + base + R"("rope_scaling": {"type": "yarn", "factor": 4.0,
      "original_max_position_embeddings": 8192}})");
  EXPECT_EQ(y.rope.scaling, RopeScaling::yarn);
  EXPECT_DOUBLE_EQ(y.rope.original_max_position, 8192.0);
  EXPECT_DOUBLE_EQ(y.rope.attention_factor, 1.0 + 0.1 * std::log(4.0));
  EXPECT_DOUBLE_EQ(y.rope.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(y.rope.beta_slow, 1.0);
  // mscale / mscale_all_dim (DeepSeek form), no factor: the ratio of the context lengths.
  ModelConfig d = parse("{" + base + R"("rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "mscale": 0.707,
      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}})");
  EXPECT_DOUBLE_EQ(d.rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(d.rope.attention_factor, (0.1 * 0.707 * std::log(8.0) + 1) / (0.1 * std::log(8.0) + 1));
  // Round trip: what to_json writes reads back the same (attention factor written explicitly).
  ModelConfig r = ModelConfig::from_json(d.to_json(), "round trip");
  EXPECT_EQ(r.rope.scaling, RopeScaling::yarn);
  EXPECT_DOUBLE_EQ(r.rope.attention_factor, d.rope.attention_factor);
  EXPECT_DOUBLE_EQ(r.rope.original_max_position, 4096.0);
  ModelConfig l = parse("{" + base + R"("rope_scaling": {"rope_type": "linear", "factor": 2.0}})");
  EXPECT_EQ(l.rope.scaling, RopeScaling::linear);
  EXPECT_EQ(ModelConfig::from_json(l.to_json(), "round trip").rope.scaling, RopeScaling::linear);
  // llama3 without original_max_position_embeddings: transformers 5 takes max_position_embeddings.
  EXPECT_DOUBLE_EQ(parse("{" + base + R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0}})")
                       .rope.original_max_position,
                   32768.0);
}

TEST(Config, RopeScalingOverride) {
  ModelConfig c = preset_config("micro");
  const int64_t native = c.max_position;
  const double theta = c.rope.theta;
  apply_rope_scaling(c, "yarn:4", "--rope-scaling");
  EXPECT_EQ(c.rope.scaling, RopeScaling::yarn);
  EXPECT_DOUBLE_EQ(c.rope.factor, 4.0);
  EXPECT_DOUBLE_EQ(c.rope.original_max_position, static_cast<double>(native));
  EXPECT_EQ(c.max_position, 4 * native);
  EXPECT_DOUBLE_EQ(c.rope.theta, theta);
  // What is trained is what is saved: the override survives config.json.
  ModelConfig back = ModelConfig::from_json(c.to_json(), "config.json");
  EXPECT_EQ(back.rope.scaling, RopeScaling::yarn);
  EXPECT_DOUBLE_EQ(back.rope.attention_factor, c.rope.attention_factor);
  EXPECT_EQ(back.max_position, 4 * native);
  apply_rope_scaling(c, R"({"rope_type": "linear", "factor": 3})", "--rope-scaling");
  EXPECT_EQ(c.rope.scaling, RopeScaling::linear);
  EXPECT_DOUBLE_EQ(c.rope.factor, 3.0);
  apply_rope_scaling(c, "none", "--rope-scaling");
  EXPECT_EQ(c.rope.scaling, RopeScaling::none);
  EXPECT_DOUBLE_EQ(c.rope.theta, theta);
  for (const char* bad : {"yarn", "yarn:", "yarn:x", "yarn:0.5", "ntk:2", "yarn:4x", "{\"rope_type\": \"ntk\"}"}) {
    std::string what;
    try {
      apply_rope_scaling(c, bad, "--rope-scaling");
    } catch (const Error& e) {
      what = e.what();
    }
    EXPECT_NE(what.find("--rope-scaling"), std::string::npos) << bad << ": " << what;
  }
  // A factor that would take the positions past an int32 (found by model_config_fuzz: the scaled count
  // overflowed and the written config no longer read back).
  std::string what;
  try {
    apply_rope_scaling(c, "linear:2555555555555555555555555555.5", "--rope-scaling");
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("give a smaller FACTOR"), std::string::npos) << what;
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
  EXPECT_NE(error_of(R"({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"type": "dynamic", "factor": 4}, )" +
                     base + "}")
                .find("supported: none/default, linear, llama3 and yarn"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 3, )" + base + "}")
                .find("multiple of num_key_value_heads"),
            std::string::npos);
  EXPECT_NE(error_of("[1, 2]").find("must be a JSON object"), std::string::npos);
  EXPECT_NE(error_of(R"({"hidden_size": 64})").find("which model"), std::string::npos);
  EXPECT_NE(error_of(R"({"architectures": ["LlamaForCausalLM"], "vocab_size": "big"})").find("vocab_size"),
            std::string::npos);
  // Context lengths are whole int32 counts: a fraction or one past 2^31-1 is refused by name (1e300 once reached a
  // double-to-int conversion when the config was written back).
  for (const char* orig : {"1e300", "4096.5", "0", "2147483648"}) {
    EXPECT_NE(error_of(R"({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "linear", "factor": 2,
                 "original_max_position_embeddings": )" + std::string(orig) + "}, " + base + "}")
                  .find("original_max_position_embeddings"),
              std::string::npos)
        << orig;
  }
  for (const char* maxpos : {"0", "-5", "2147483648"}) {
    EXPECT_NE(error_of(R"({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": )" + std::string(maxpos) +
                       ", " + base + "}")
                  .find("max_position_embeddings must be between 1 and 2^31-1"),
              std::string::npos)
        << maxpos;
  }
  // A layer count no model has (a per-layer list of it would take gigabytes) is refused by name.
  EXPECT_NE(error_of(R"({"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 22666661, "hidden_size": 64,
      "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 100})")
                .find("num_hidden_layers 22666661 is more than 4096"),
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
    m.load_weights(*make_ops("cpu"), p);
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
    m3.load_weights(*make_ops("cpu"), p3);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.2."), std::string::npos) << e.what();
  }
  EXPECT_THROW(open_model((dir / "nothing-here").string()), Error);
  EXPECT_THROW(open_model("preset:nope"), Error);
}

}  // namespace
}  // namespace oomless
