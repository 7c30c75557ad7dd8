// PEFT's LoRA adapter format against what peft 0.21.2 wrote (tests/golden/peft, tools/golden/make_peft.py):
// adapter_config.json parsed, written back byte for byte, built from settings equal to PEFT's own output,
// resolved to the modules PEFT adapted (with their r, alpha and scale), every tensor key mapped both ways;
// and each refusal: every field oomless cannot honour, unknown targets, r too large, foreign keys.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "io/json.h"
#include "io/peft.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "util/harness.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;

// golden -> the model golden it adapts (tests/golden/models/NAME)
const std::map<std::string, std::string> kBase = {{"llama_gqa_untied_lora", "llama_gqa_untied"},
                                                  {"qwen2_dora", "qwen2"},
                                                  {"qwen2_dora_dropout", "qwen2"},
                                                  {"qwen3_rslora_lm_head", "qwen3"},
                                                  {"mistral_patterns", "mistral"},
                                                  {"llama_mha_tied_regex", "llama_mha_tied"}};
const std::vector<std::string> kGoldens = {"llama_gqa_untied_lora", "qwen2_dora", "qwen2_dora_dropout",
                                           "qwen3_rslora_lm_head", "mistral_patterns", "llama_mha_tied_regex"};

std::string golden_dir(const std::string& name) { return test::source_path("tests/golden/peft/" + name); }

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

ModelConfig base_model_of(const AdapterConfig& a) {
  return ModelConfig::from_file(test::source_path(*a.base_model_name_or_path + "/config.json"));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A PEFT-written config with one field replaced (or removed, with a null json::Value and erase = true).
json::Value with_field(const std::string& name, const std::string& key, const std::string& value_json) {
  json::Value v = json::parse_file(golden_dir(name) + "/adapter_config.json");
  v.set(key, json::parse(value_json));
  return v;
}

std::string parse_error(const json::Value& v) {
  return error_of([&] { AdapterConfig::from_json(v, "DIR/adapter_config.json"); });
}

std::set<std::string> string_set(const json::Value& v) {
  std::set<std::string> s;
  for (size_t i = 0; i < v.size(); ++i) s.insert(v[i].as_string());
  return s;
}

// Field by field; target_modules as a set (PEFT writes it from a Python set).
void expect_same_fields(const json::Value& ours, const json::Value& peft, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(ours.size(), peft.size());
  for (const auto& [key, v] : peft.as_object()) {
    const json::Value* o = ours.find(key);
    ASSERT_TRUE(o) << "missing field " << key;
    if (key == "target_modules" && v.is_array()) {
      ASSERT_TRUE(o->is_array()) << key;
      EXPECT_EQ(string_set(*o), string_set(v)) << key;
    } else {
      EXPECT_TRUE(*o == v) << key << ": ours " << json::dump(*o) << ", PEFT " << json::dump(v);
    }
  }
}

TEST(Peft, GoldenConfigsParse) {
  for (const std::string& n : kGoldens) {
    SCOPED_TRACE(n);
    const AdapterConfig a = AdapterConfig::from_file(golden_dir(n));
    EXPECT_TRUE(a.warnings.empty()) << a.warnings.front();
    EXPECT_EQ(a.peft_version, "0.21.2");
    EXPECT_EQ(*a.base_model_name_or_path, "tests/golden/models/" + kBase.at(n));
  }
  const AdapterConfig lora = AdapterConfig::from_file(golden_dir("llama_gqa_untied_lora"));
  EXPECT_EQ(lora.r, 4);
  EXPECT_EQ(lora.lora_alpha, 8.0);
  EXPECT_EQ(lora.scale(lora.r), 2.0);
  EXPECT_FALSE(lora.use_dora || lora.use_rslora || lora.modules_to_save);
  EXPECT_EQ(lora.target_modules.kind, ModuleSelector::Kind::names);  // all-linear, expanded by PEFT
  EXPECT_EQ(lora.target_modules.names.size(), 14u);
  EXPECT_TRUE(AdapterConfig::from_file(golden_dir("qwen2_dora")).use_dora);
  const AdapterConfig rs = AdapterConfig::from_file(golden_dir("qwen3_rslora_lm_head") + "/adapter_config.json");
  EXPECT_TRUE(rs.use_rslora);
  EXPECT_EQ(rs.scale(4), 4.0);  // 8 / sqrt(4)
  EXPECT_EQ(*rs.modules_to_save, std::vector<std::string>{"lm_head"});
  const AdapterConfig pat = AdapterConfig::from_file(golden_dir("mistral_patterns"));
  EXPECT_EQ(pat.lora_dropout, 0.05);
  EXPECT_EQ(*pat.layers_to_transform, std::vector<int64_t>{1});
  ASSERT_EQ(pat.rank_pattern.size(), 1u);
  EXPECT_EQ(pat.rank_pattern[0], (std::pair<std::string, int64_t>{"down_proj", 2}));
  ASSERT_EQ(pat.alpha_pattern.size(), 1u);
  EXPECT_EQ(pat.alpha_pattern[0].second, 16.0);
  const AdapterConfig re = AdapterConfig::from_file(golden_dir("llama_mha_tied_regex"));
  EXPECT_EQ(re.target_modules.kind, ModuleSelector::Kind::regex);
  EXPECT_EQ(re.exclude_modules.kind, ModuleSelector::Kind::regex);
  EXPECT_EQ(re.init, LoraInit::gaussian);
  EXPECT_TRUE(re.ensure_weight_tying);
}

// Parsing then writing gives back PEFT's file exactly.
TEST(Peft, WriteReproducesPeftFileByteForByte) {
  for (const std::string& n : kGoldens) {
    const std::string path = golden_dir(n) + "/adapter_config.json";
    const AdapterConfig a = AdapterConfig::from_file(path);
    expect_same_fields(a.to_json(), json::parse_file(path), n);
    EXPECT_EQ(a.to_text(), read_text(path)) << n;
  }
}

TEST(Peft, WriteParseRoundTrip) {
  AdapterConfig a;
  a.r = 16;
  a.lora_alpha = 5.5;
  a.lora_dropout = 0.1;
  a.target_modules = {ModuleSelector::Kind::regex, {}, R"(.*\.(q|v)_proj)"};
  a.exclude_modules = {ModuleSelector::Kind::names, {"model.layers.3.self_attn.q_proj"}, ""};
  a.rank_pattern = {{"v_proj", 8}, {"q_proj", 4}};
  a.alpha_pattern = {{"q_proj", 2.5}};
  a.use_rslora = a.use_dora = a.ensure_weight_tying = true;
  a.modules_to_save = std::vector<std::string>{"embed_tokens", "lm_head"};
  a.init = LoraInit::random;
  a.base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M";
  a.revision = "main";
  const AdapterConfig b = AdapterConfig::from_json(json::parse(a.to_text()), "round trip");
  EXPECT_TRUE(b.warnings.empty());
  EXPECT_EQ(b.to_text(), a.to_text());
  EXPECT_EQ(b.r, 16);
  EXPECT_EQ(b.lora_alpha, 5.5);
  EXPECT_EQ(b.target_modules, a.target_modules);
  EXPECT_EQ(b.exclude_modules, a.exclude_modules);
  // json.dumps(sort_keys=True) sorts rank_pattern's keys too, and PEFT matches them in that order.
  EXPECT_EQ(b.rank_pattern, (std::vector<std::pair<std::string, int64_t>>{{"q_proj", 4}, {"v_proj", 8}}));
  EXPECT_EQ(b.alpha_pattern, a.alpha_pattern);
  EXPECT_TRUE(b.use_rslora && b.use_dora && b.ensure_weight_tying);
  EXPECT_EQ(b.modules_to_save, a.modules_to_save);
  EXPECT_EQ(b.init, LoraInit::random);
  EXPECT_EQ(b.revision, a.revision);
  // The layer filter and an int layers_to_transform (written back as a list).
  AdapterConfig c;
  c.target_modules = {ModuleSelector::Kind::names, {"q_proj"}, ""};
  json::Value v = json::parse(c.to_text());
  v.set("layers_to_transform", json::Value::integer(2));
  v.set("layers_pattern", json::Value::string("layers"));
  const AdapterConfig d = AdapterConfig::from_json(v, "int layers");
  EXPECT_EQ(*d.layers_to_transform, std::vector<int64_t>{2});
  EXPECT_EQ(AdapterConfig::from_json(json::parse(d.to_text()), "again").to_text(), d.to_text());
}

// The settings make_peft.py gave LoraConfig, built here, write what PEFT wrote for them.
TEST(Peft, BuiltConfigEqualsPeftOutputForTheSameSettings) {
  auto base = [](const std::string& model) {
    AdapterConfig a;
    a.r = 4;
    a.lora_alpha = 8;
    a.target_modules = {ModuleSelector::Kind::all_linear, {}, "all-linear"};
    a.base_model_name_or_path = "tests/golden/models/" + model;
    return a;
  };
  std::map<std::string, AdapterConfig> built;
  built["llama_gqa_untied_lora"] = base("llama_gqa_untied");
  built["qwen2_dora"] = base("qwen2");
  built["qwen2_dora"].use_dora = true;
  built["qwen3_rslora_lm_head"] = base("qwen3");
  built["qwen3_rslora_lm_head"].use_rslora = true;
  built["qwen3_rslora_lm_head"].modules_to_save = std::vector<std::string>{"lm_head"};
  AdapterConfig& p = built["mistral_patterns"] = base("mistral");
  p.target_modules = {ModuleSelector::Kind::names, {"q_proj", "v_proj", "down_proj"}, ""};
  p.layers_to_transform = std::vector<int64_t>{1};
  p.rank_pattern = {{"down_proj", 2}};
  p.alpha_pattern = {{"v_proj", 16}};
  p.lora_dropout = 0.05;
  AdapterConfig& r = built["llama_mha_tied_regex"] = base("llama_mha_tied");
  r.r = 2, r.lora_alpha = 4;
  r.target_modules = {ModuleSelector::Kind::regex, {}, R"(model\.layers\.\d+\.(self_attn\.(q|v)_proj|mlp\.down_proj))"};
  r.exclude_modules = {ModuleSelector::Kind::regex, {}, R"(.*\.0\.mlp\..*)"};
  // PEFT rewrites modules_to_save for a tied model with ensure_weight_tying: the full name is appended.
  r.modules_to_save = std::vector<std::string>{"embed_tokens", "model.embed_tokens"};
  r.ensure_weight_tying = true;
  r.init = LoraInit::gaussian;
  for (const auto& [name, a] : built) {
    const AdapterConfig expanded = a.with_all_linear_expanded(base_model_of(a));
    expect_same_fields(expanded.to_json(), json::parse_file(golden_dir(name) + "/adapter_config.json"), name);
  }
  // From 20 linear modules on PEFT saves the shortest distinguishing suffixes instead of full names.
  ModelConfig c3 = base_model_of(built["qwen2_dora"]);
  c3.L = 3;
  const AdapterConfig e3 = built["qwen2_dora"].with_all_linear_expanded(c3);
  EXPECT_EQ(std::set<std::string>(e3.target_modules.names.begin(), e3.target_modules.names.end()),
            (std::set<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
  c3.L = 2;
  EXPECT_EQ(built["qwen2_dora"].with_all_linear_expanded(c3).target_modules.names.size(), 14u);
}

// resolve_adapter adapts exactly the modules PEFT adapted, with PEFT's r, alpha, scale and shapes, and
// expects exactly the tensors PEFT saved.
TEST(Peft, ResolveMatchesPeftTargetsAndSavedTensors) {
  for (const std::string& n : kGoldens) {
    SCOPED_TRACE(n);
    const AdapterConfig a = AdapterConfig::from_file(golden_dir(n));
    const ModelConfig c = base_model_of(a);
    const json::Value info = json::parse_file(golden_dir(n) + "/targets.json");
    std::vector<std::string> modules;
    for (size_t i = 0; i < info.at("modules").size(); ++i) modules.push_back(info.at("modules")[i].as_string());
    EXPECT_EQ(hf_module_names(c), modules);

    const AdapterLayout lay = resolve_adapter(a, c, n);
    EXPECT_TRUE(lay.warnings.empty());
    const json::Value& want = info.at("targets");
    ASSERT_EQ(lay.targets.size(), want.size());
    std::vector<LoraTarget> sorted = lay.targets;
    std::sort(sorted.begin(), sorted.end(), [](const LoraTarget& x, const LoraTarget& y) { return x.name() < y.name(); });
    for (size_t i = 0; i < want.size(); ++i) {
      const json::Value& w = want[i];
      const LoraTarget& t = sorted[i];
      EXPECT_EQ(t.name(), w.at("name").as_string());
      EXPECT_EQ(t.r, w.at("r").as_int());
      EXPECT_EQ(t.alpha, w.at("lora_alpha").as_number());
      EXPECT_EQ(t.scale, w.at("scaling").as_number()) << t.name();
      EXPECT_EQ(t.in_features, w.at("in_features").as_int());
      EXPECT_EQ(t.out_features, w.at("out_features").as_int());
      EXPECT_EQ(lay.dora, w.at("use_dora").as_bool());
    }
    std::set<std::string> saved;
    for (size_t i = 0; i < info.at("modules_to_save").size(); ++i) saved.insert(info.at("modules_to_save")[i].as_string());
    EXPECT_EQ(lay.train_embed_tokens, saved.count("model.embed_tokens") > 0);
    EXPECT_EQ(lay.train_lm_head, saved.count("lm_head") > 0);

    const SafetensorsFile f = SafetensorsFile::open(golden_dir(n) + "/adapter_model.safetensors");
    std::vector<std::pair<std::string, std::vector<int64_t>>> in_file;
    for (const StTensor& t : f.tensors()) {
      in_file.emplace_back(t.name, t.shape);
      EXPECT_EQ(t.dtype, DType::f32) << t.name;
    }
    std::sort(in_file.begin(), in_file.end());
    EXPECT_EQ(lay.tensors(), in_file);
    EXPECT_NO_THROW(check_adapter_tensors(lay, f));
    EXPECT_EQ(f.metadata().at("format"), "pt");
  }
  // The unexpanded all-linear form resolves to the same modules as PEFT's expansion.
  AdapterConfig a = AdapterConfig::from_file(golden_dir("qwen2_dora"));
  const ModelConfig c = base_model_of(a);
  const auto expanded = resolve_adapter(a, c, "expanded").tensors();
  a.target_modules = {ModuleSelector::Kind::all_linear, {}, "ALL-LINEAR"};
  EXPECT_EQ(resolve_adapter(a, c, "all-linear").tensors(), expanded);
}

// The goldens the LoRA implementation is checked against hold one F64 gradient per adapter tensor.
TEST(Peft, GoldenGradientsCoverEveryAdapterTensor) {
  for (const std::string n : {"llama_gqa_untied_lora", "qwen2_dora", "qwen3_rslora_lm_head"}) {
    SCOPED_TRACE(n);
    const SafetensorsFile ad = SafetensorsFile::open(golden_dir(n) + "/adapter_model.safetensors");
    const SafetensorsFile g = SafetensorsFile::open(golden_dir(n) + "/golden.safetensors");
    size_t grads = 0;
    for (const StTensor& t : g.tensors()) {
      if (t.name.rfind("grad.", 0) != 0) continue;
      ++grads;
      const StTensor* w = ad.find(t.name.substr(5));
      ASSERT_TRUE(w) << t.name;
      EXPECT_EQ(t.shape, w->shape) << t.name;
      EXPECT_EQ(t.dtype, DType::f64) << t.name;
    }
    EXPECT_EQ(grads, ad.tensors().size());
    const SafetensorsFile m =
        SafetensorsFile::open(test::source_path("tests/golden/models/" + kBase.at(n) + "/golden.safetensors"));
    ASSERT_TRUE(g.find("input_ids") && m.find("input_ids"));
    EXPECT_EQ(0, std::memcmp(g.find("input_ids")->data, m.find("input_ids")->data, m.find("input_ids")->nbytes));
    const json::Value e = json::parse_file(golden_dir(n) + "/errors.json");
    EXPECT_LT(e.at("f64_selfcheck").as_number(), 1e-12);
    EXPECT_EQ(e.at("load_warnings").size(), 0u);
    EXPECT_EQ(e.at("fp32").size(), 2 + ad.tensors().size());
  }
}

TEST(Peft, KeysMapBothWays) {
  size_t n_keys = 0;
  for (const std::string& n : kGoldens) {
    const SafetensorsFile f = SafetensorsFile::open(golden_dir(n) + "/adapter_model.safetensors");
    for (const StTensor& t : f.tensors()) {
      const AdapterKey k = parse_adapter_key(t.name, n);
      EXPECT_EQ(adapter_key(k), t.name);
      if (k.kind == AdapterKey::Kind::lora) {
        const std::string module = linear_module_full_name(k.layer, k.module);
        EXPECT_EQ(t.name, "base_model.model." + module + (k.part == LoraPart::lora_A   ? ".lora_A.weight"
                                                          : k.part == LoraPart::lora_B ? ".lora_B.weight"
                                                                                       : ".lora_magnitude_vector"));
      }
      ++n_keys;
    }
  }
  EXPECT_GT(n_keys, 100u);
  // The module part of a key is the parameter's name in param_specs, less ".weight".
  const ModelConfig c = ModelConfig::from_file(test::source_path("tests/golden/models/qwen3/config.json"));
  std::set<std::string> params;
  for (const ParamSpec& p : param_specs(c)) params.insert(p.name);
  for (int64_t l = 0; l < c.L; ++l)
    for (LinearModule m : kLinearModules) {
      EXPECT_TRUE(params.count(linear_module_full_name(l, m) + ".weight")) << linear_module_full_name(l, m);
      EXPECT_EQ(linear_module_from_name(linear_module_name(m)), m);
    }
  EXPECT_TRUE(params.count(std::string(saved_module_full_name(SavedModule::embed_tokens)) + ".weight"));
  EXPECT_TRUE(params.count(std::string(saved_module_full_name(SavedModule::lm_head)) + ".weight"));
  EXPECT_EQ(adapter_key(3, LinearModule::down_proj, LoraPart::magnitude),
            "base_model.model.model.layers.3.mlp.down_proj.lora_magnitude_vector");
  EXPECT_EQ(adapter_key(SavedModule::embed_tokens), "base_model.model.model.embed_tokens.weight");
}

TEST(Peft, BadKeysAreNamed) {
  const std::string pre = "base_model.model.model.layers.0.";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {pre + "self_attn.q_proj.lora_A.default.weight", "adapter name \"default\""},
      {pre + "self_attn.q_proj.lora_B.bias", "lora_bias = true"},
      {pre + "self_attn.q_proj.base_layer.bias", "bias = \"all\" or \"lora_only\""},
      {"base_model.model.model.embed_tokens.lora_embedding_A", "LoRA on an embedding"},
      {pre + "self_attn.q_proj.lora_magnitude_vector.weight", "PEFT writes DoRA magnitudes as"},
      {"model.layers.0.self_attn.q_proj.lora_A.weight", "is not a key of a PEFT LoRA adapter"},
      {"base_model.model.model.layers.01.self_attn.q_proj.lora_A.weight", "is not a key"},
      {"base_model.model.model.layers.-1.self_attn.q_proj.lora_A.weight", "is not a key"},
      {"base_model.model.model.layers.99999999999.self_attn.q_proj.lora_A.weight", "is not a key"},
      {pre + "mlp.q_proj.lora_A.weight", "is not a key"},
      {pre + "self_attn.q_proj.lora_C.weight", "is not a key"},
      {pre + "self_attn.q_proj", "is not a key"},
      {"base_model.model.model.norm.weight", "is not a key"},
      {"", "is not a key"},
  };
  for (const auto& [key, want] : cases) {
    const std::string& k = key;  // (a structured binding is not captured by clang before 16)
    const std::string e = error_of([&] { parse_adapter_key(k, "F.safetensors"); });
    EXPECT_NE(e.find(want), std::string::npos) << key << ": " << e;
    EXPECT_NE(e.find("[adapter] F.safetensors: tensor " + json::quote(key)), std::string::npos) << e;
  }
}

TEST(Peft, CheckAdapterTensorsNamesTheKey) {
  const AdapterConfig a = AdapterConfig::from_file(golden_dir("mistral_patterns"));
  const AdapterLayout lay = resolve_adapter(a, base_model_of(a), "patterns");
  const fs::path dir = fs::path(testing::TempDir()) / ("peft_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::vector<float> zeros(1 << 12);
  auto write = [&](const std::vector<std::pair<std::string, std::vector<int64_t>>>& ts, DType dt = DType::f32) {
    std::vector<StWrite> w;
    for (const auto& [k, s] : ts) w.push_back({k, dt, s, zeros.data()});
    const std::string p = (dir / "adapter_model.safetensors").string();
    write_safetensors(p, w);
    return SafetensorsFile::open(p);
  };
  auto ts = lay.tensors();
  EXPECT_NO_THROW(check_adapter_tensors(lay, write(ts)));
  auto missing = ts;
  missing.pop_back();
  EXPECT_NE(error_of([&] { check_adapter_tensors(lay, write(missing)); }).find(json::quote(ts.back().first) + " is missing"),
            std::string::npos);
  auto wrong = ts;
  wrong[0].second = {3, 56};
  EXPECT_NE(error_of([&] { check_adapter_tensors(lay, write(wrong)); }).find("has shape [3, 56], expected [2, 56]"),
            std::string::npos);
  auto extra = ts;
  extra.push_back({adapter_key(0, LinearModule::q_proj, LoraPart::lora_A), {4, 32}});
  EXPECT_NE(error_of([&] { check_adapter_tensors(lay, write(extra)); }).find("is not part of this adapter"),
            std::string::npos);
  auto foreign = ts;
  foreign.push_back({"base_model.model.model.norm.weight", {32}});
  EXPECT_NE(error_of([&] { check_adapter_tensors(lay, write(foreign)); }).find("is not a key of a PEFT LoRA adapter"),
            std::string::npos);
  EXPECT_NE(error_of([&] { check_adapter_tensors(lay, write(ts, DType::i32)); }).find("has dtype I32"), std::string::npos);
  fs::remove_all(dir);
}

// Every field oomless cannot honour is refused, naming the file, the field, the value and what works.
TEST(Peft, BadFieldsAreClearErrors) {
  const std::string g = "llama_gqa_untied_lora";
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"peft_type", R"("PREFIX_TUNING")", R"(peft_type = "PREFIX_TUNING" is not supported (supported: "LORA"))"},
      {"task_type", R"("SEQ_CLS")", R"(task_type = "SEQ_CLS" is not supported (supported: "CAUSAL_LM" or null))"},
      {"r", "0", "r = 0 is not supported (supported: a positive integer)"},
      {"r", "4.5", "r = 4.5 is not supported"},
      {"r", R"("4")", R"(r = "4" is not supported)"},
      {"lora_alpha", R"("8")", R"(lora_alpha = "8" is not supported (supported: a finite number))"},
      {"lora_dropout", "1.0", "lora_dropout = 1.0 is not supported (supported: a probability p, 0 <= p < 1)"},
      {"lora_dropout", "-0.1", "lora_dropout = -0.1 is not supported"},
      {"target_modules", "5", "target_modules = 5 is not supported"},
      {"target_modules", "[\"q_proj\", 3]", "target_modules = [\"q_proj\",3] is not supported"},
      {"target_modules", R"("(q_proj")", R"(target_modules regex "(q_proj" is not a valid regex)"},
      {"exclude_modules", R"("[")", R"(exclude_modules regex "[" is not a valid regex)"},
      {"bias", R"("all")", R"(bias = "all" is not supported (supported: "none")"},
      {"bias", R"("lora_only")", R"(bias = "lora_only" is not supported)"},
      {"fan_in_fan_out", "true", "fan_in_fan_out = true is not supported (supported: false"},
      {"use_dora", R"("yes")", R"(use_dora = "yes" is not supported (supported: true or false))"},
      {"use_rslora", "1", "use_rslora = 1 is not supported"},
      {"ensure_weight_tying", "null", ""},
      {"modules_to_save", R"("lm_head")", R"(modules_to_save = "lm_head" is not supported (supported: null or a list)"},
      {"init_lora_weights", R"("pissa")",
       R"(init_lora_weights = "pissa" is not supported (supported: true, false or "gaussian"))"},
      {"init_lora_weights", R"("olora")", "init_lora_weights = \"olora\" is not supported"},
      {"init_lora_weights", R"("loftq")", "init_lora_weights = \"loftq\" is not supported"},
      {"layers_to_transform", R"("0")", R"(layers_to_transform = "0" is not supported)"},
      {"layers_to_transform", "[-1]", "layers_to_transform = [-1] is not supported (supported: layer indices >= 0)"},
      {"layers_pattern", "3", "layers_pattern = 3 is not supported"},
      {"rank_pattern", R"({"q_proj": 0})", R"(rank_pattern["q_proj"] = 0 is not supported)"},
      {"rank_pattern", R"({"(": 2})", "rank_pattern key \"(\" "},
      {"rank_pattern", "[]", "rank_pattern = [] is not supported"},
      {"alpha_pattern", R"({"q_proj": "x"})", R"(alpha_pattern["q_proj"] = "x" is not supported)"},
      {"alora_invocation_tokens", "[1, 2]", "alora_invocation_tokens = [1,2] is not supported (supported: null; "
                                            "oomless does not implement activated LoRA)"},
      {"arrow_config", "{}", "arrow_config = {} is not supported (supported: null"},
      {"kasa_config", R"({"beta": 1})", "kasa_config = {\"beta\":1} is not supported"},
      {"layer_replication", "[[0, 1]]", "layer_replication = [[0,1]] is not supported"},
      {"lora_bias", "true", "lora_bias = true is not supported (supported: false"},
      {"megatron_config", "{}", "megatron_config = {} is not supported"},
      {"monteclora_config", "{}", "monteclora_config = {} is not supported"},
      {"trainable_token_indices", "[1]", "trainable_token_indices = [1] is not supported"},
      {"use_bdlora", "{}", "use_bdlora = {} is not supported"},
      {"use_qalora", "true",
       "use_qalora = true is not supported (supported: false; oomless does not implement QA-LoRA)"},
      {"velora_config", "{}", "velora_config = {} is not supported"},
      {"target_parameters", R"(["mlp.experts"])", "target_parameters = [\"mlp.experts\"] is not supported"},
      {"qalora_group_size", R"("16")", "qalora_group_size = \"16\" is not supported"},
      {"base_model_name_or_path", "7", "base_model_name_or_path = 7 is not supported (supported: null or a string)"},
      {"inference_mode", "\"no\"", "inference_mode = \"no\" is not supported"},
      {"new_feature", "3", "unknown field \"new_feature\" = 3 (not a PEFT 0.21.2 LoraConfig field"},
      {"new_feature_config", R"({"on": true})", "unknown field \"new_feature_config\""},
  };
  for (const auto& [key, value, want] : cases) {
    const std::string e = parse_error(with_field(g, key, value));
    SCOPED_TRACE(key + " = " + value);
    if (want.empty()) {
      EXPECT_EQ(e, "");
      continue;
    }
    EXPECT_NE(e.find("[adapter] DIR/adapter_config.json: " + want), std::string::npos) << e;
  }
  // A regex target with a layer filter, a layers_pattern without layers_to_transform: PEFT refuses them too.
  json::Value v = with_field(g, "target_modules", R"(".*q_proj")");
  v.set("layers_to_transform", json::parse("[0]"));
  EXPECT_NE(parse_error(v).find("layers_to_transform cannot be used when target_modules is a string"), std::string::npos);
  v = with_field(g, "layers_pattern", R"("layers")");
  EXPECT_NE(parse_error(v).find("layers_pattern needs layers_to_transform"), std::string::npos);
  json::Value no_type = json::Value::object();
  const json::Value golden = json::parse_file(golden_dir(g) + "/adapter_config.json");
  for (const auto& [k, x] : golden.as_object())
    if (k != "peft_type") no_type.set(k, x);
  EXPECT_NE(parse_error(no_type).find("no peft_type"), std::string::npos);
  EXPECT_NE(parse_error(json::parse("[]")).find("must be a JSON object"), std::string::npos);
  EXPECT_NE(error_of([] { AdapterConfig::from_file("/nonexistent/adapter"); }).find("/nonexistent/adapter/adapter_config.json"),
            std::string::npos);
}

// Fields PEFT itself ignores, and unknown fields with an "off" value, are accepted with a warning.
TEST(Peft, IgnoredFieldsWarn) {
  const std::string g = "llama_gqa_untied_lora";
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"loftq_config", R"({"loftq_bits": 4})"},
           {"eva_config", R"({"rho": 2.0})"},
           {"corda_config", R"({"corda_method": "ipm"})"},
           {"runtime_config", R"({"ephemeral_gpu_offload": false})"},
           {"new_feature", "null"},
           {"use_new_feature", "false"},
           {"new_feature_config", "{}"}}) {
    const AdapterConfig a = AdapterConfig::from_json(with_field(g, key, value), "F");
    ASSERT_EQ(a.warnings.size(), 1u) << key;
    EXPECT_NE(a.warnings[0].find(key), std::string::npos) << a.warnings[0];
    EXPECT_EQ(a.to_text(), read_text(golden_dir(g) + "/adapter_config.json")) << key;  // not written back
  }
  // Fields with no effect here, whatever they hold.
  json::Value v = with_field(g, "revision", R"("v1.0")");
  v.set("megatron_core", json::Value::string("my.megatron"));
  v.set("qalora_group_size", json::Value::integer(32));
  v.set("inference_mode", json::Value::boolean(false));
  v.set("auto_mapping", json::parse(R"({"base_model_class": "LlamaForCausalLM", "parent_library": "x"})"));
  v.set("task_type", json::Value());
  v.set("init_lora_weights", json::Value::string("Gaussian"));
  const AdapterConfig a = AdapterConfig::from_json(v, "F");
  EXPECT_TRUE(a.warnings.empty());
  EXPECT_EQ(*a.revision, "v1.0");
  EXPECT_EQ(a.init, LoraInit::gaussian);
  // Only peft_type is required; the rest take LoraConfig's defaults.
  const AdapterConfig d = AdapterConfig::from_json(json::parse(R"({"peft_type": "LORA"})"), "F");
  EXPECT_EQ(d.r, 8);
  EXPECT_EQ(d.lora_alpha, 8.0);
  EXPECT_EQ(d.target_modules.kind, ModuleSelector::Kind::none);
}

AdapterConfig cfg_with(const std::string& golden, const std::vector<std::pair<std::string, std::string>>& fields) {
  json::Value v = json::parse_file(golden_dir(golden) + "/adapter_config.json");
  for (const auto& [k, x] : fields) v.set(k, json::parse(x));
  return AdapterConfig::from_json(v, "A");
}
AdapterConfig cfg_with(const std::string& golden, const std::string& key, const std::string& value) {
  return cfg_with(golden, {{key, value}});
}

std::string resolve_error(const AdapterConfig& a, const std::string& model) {
  const ModelConfig c = ModelConfig::from_file(test::source_path("tests/golden/models/" + model + "/config.json"));
  return error_of([&] { resolve_adapter(a, c, "A"); });
}

std::vector<std::string> resolved_names(const AdapterConfig& a, const std::string& model) {
  const ModelConfig c = ModelConfig::from_file(test::source_path("tests/golden/models/" + model + "/config.json"));
  std::vector<std::string> n;
  for (const LoraTarget& t : resolve_adapter(a, c, "A").targets) n.push_back(t.name());
  return n;
}

TEST(Peft, ResolveFollowsPeftMatching) {
  const std::string g = "mistral_patterns", m = "mistral";
  // An entry equal to a full name bypasses layers_to_transform (PEFT checks `key in target_modules` first;
  // checked against peft 0.21.2).
  EXPECT_EQ(resolved_names(cfg_with(g, "target_modules", R"(["q_proj", "model.layers.0.self_attn.k_proj"])"), m),
            (std::vector<std::string>{"model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.q_proj"}));
  // layers_pattern names the ModuleList; a pattern that is not there leaves nothing.
  AdapterConfig a = cfg_with(g, "layers_pattern", R"(["layers"])");
  EXPECT_EQ(resolved_names(a, m).size(), 3u);
  a = cfg_with(g, "layers_pattern", R"("h")");
  EXPECT_NE(resolve_error(a, m).find("leaves no module to adapt"), std::string::npos);
  // Suffixes match on dots only: "proj" is no suffix of "q_proj".
  EXPECT_NE(resolve_error(cfg_with(g, "target_modules", R"(["proj"])"), m).find("\"proj\" matches no module"),
            std::string::npos);
  EXPECT_EQ(resolved_names(cfg_with(g, "target_modules", R"(["self_attn.o_proj"])"), m),
            std::vector<std::string>{"model.layers.1.self_attn.o_proj"});
  // exclude_modules as names; null target_modules is PEFT's default for these models: q_proj, v_proj.
  a = cfg_with(g, "target_modules", "null");
  a.layers_to_transform.reset();
  a.exclude_modules = {ModuleSelector::Kind::names, {"model.layers.0.self_attn.v_proj"}, ""};
  EXPECT_EQ(resolved_names(a, m), (std::vector<std::string>{"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj",
                                                            "model.layers.1.self_attn.v_proj"}));
  // A regex is a full match: ".*q_proj" takes q_proj, "q_proj" alone matches no module's full name.
  a = cfg_with(g, {{"target_modules", R"(".*q_proj")"}, {"layers_to_transform", "null"}});
  EXPECT_EQ(resolved_names(a, m).size(), 2u);
  a.target_modules.text = "q_proj";
  EXPECT_NE(resolve_error(a, m).find("target_modules \"q_proj\" matches no module of the model"), std::string::npos);
  // rank_pattern keys are suffix regexes, first match wins; a key matching nothing warns.
  a = cfg_with(g, "rank_pattern", R"({"layers\\.1\\..*_proj": 1, "q_proj": 3, "nothing": 2})");
  const ModelConfig c = ModelConfig::from_file(test::source_path("tests/golden/models/mistral/config.json"));
  const AdapterLayout lay = resolve_adapter(a, c, "A");
  for (const LoraTarget& t : lay.targets) EXPECT_EQ(t.r, 1) << t.name();
  ASSERT_EQ(lay.warnings.size(), 2u);
  EXPECT_NE(lay.warnings[0].find("\"q_proj\" matches no adapted module"), std::string::npos);
  // modules_to_save: a plain suffix match, and never a LoRA target.
  a = cfg_with("llama_gqa_untied_lora", "modules_to_save", R"(["head"])");
  const AdapterLayout l2 = resolve_adapter(a, base_model_of(a), "A");
  EXPECT_TRUE(l2.train_lm_head && !l2.train_embed_tokens);
  a = cfg_with("qwen2_dora", "modules_to_save", R"(["embed_tokens"])");
  a.ensure_weight_tying = true;
  const AdapterLayout l3 = resolve_adapter(a, base_model_of(a), "A");
  EXPECT_TRUE(l3.train_lm_head && l3.train_embed_tokens);
  EXPECT_EQ(l3.tensors().size(), 14u * 3 + 2);
}

TEST(Peft, ResolveErrorsNameTheProblem) {
  const std::string g = "llama_gqa_untied_lora", m = "llama_gqa_untied";
  const std::string listing = "the model's linear modules are model.layers.{0..1}.self_attn.{q,k,v,o}_proj";
  std::string e = resolve_error(cfg_with(g, "target_modules", R"(["q_proj", "qkv_proj"])"), m);
  EXPECT_NE(e.find("[adapter] A: target_modules entry \"qkv_proj\" matches no module of the model; " + listing),
            std::string::npos) << e;
  e = resolve_error(cfg_with(g, "target_modules", R"(["input_layernorm"])"), m);
  EXPECT_NE(e.find("selects model.layers.0.input_layernorm, which is not a linear layer"), std::string::npos) << e;
  e = resolve_error(cfg_with(g, "target_modules", R"(["self_attn"])"), m);
  EXPECT_NE(e.find("selects model.layers.0.self_attn, which is not a linear layer"), std::string::npos) << e;
  e = resolve_error(cfg_with(g, "target_modules", R"(["q_proj", "lm_head"])"), m);
  EXPECT_NE(e.find("selects lm_head; LoRA on lm_head is not supported (train it in full with modules_to_save"),
            std::string::npos) << e;
  e = resolve_error(cfg_with(g, "target_modules", R"(".*embed_tokens")"), m);
  EXPECT_NE(e.find("LoRA on embed_tokens is not supported"), std::string::npos) << e;
  e = resolve_error(cfg_with(g, "target_modules", R"("model\\.layers\\.7\\..*")"), m);
  EXPECT_NE(e.find("matches no module of the model"), std::string::npos) << e;
  // r: k_proj and v_proj are (16, 32) in this model.
  e = resolve_error(cfg_with(g, "r", "17"), m);
  EXPECT_NE(e.find("[adapter] A: r = 17 for model.layers.0.self_attn.k_proj exceeds min(in_features 32, out_features 16) = 16"),
            std::string::npos) << e;
  EXPECT_EQ(resolve_error(cfg_with(g, "r", "16"), m), "");
  e = resolve_error(cfg_with(g, "rank_pattern", R"({"model.layers.1.mlp.down_proj": 40})"), m);
  EXPECT_NE(e.find("r = 40 for model.layers.1.mlp.down_proj exceeds min(in_features 56, out_features 32) = 32"),
            std::string::npos) << e;
  AdapterConfig a = cfg_with("mistral_patterns", "layers_to_transform", "[1, 5]");
  e = resolve_error(a, "mistral");
  EXPECT_NE(e.find("layers_to_transform lists layer 5 but the model has 2 layers"), std::string::npos) << e;
  e = resolve_error(cfg_with(g, "exclude_modules", R"(".*")"), m);
  EXPECT_NE(e.find("leaves no module to adapt"), std::string::npos) << e;
  e = resolve_error(cfg_with(g, "modules_to_save", R"(["norm"])"), m);
  EXPECT_NE(e.find("modules_to_save entry \"norm\" selects model.layers.0.input_layernorm, which oomless cannot train "
                   "in full (supported: embed_tokens, lm_head)"),
            std::string::npos) << e;
  e = resolve_error(cfg_with(g, "modules_to_save", R"(["classifier"])"), m);
  EXPECT_NE(e.find("modules_to_save entry \"classifier\" matches no module"), std::string::npos) << e;
  e = resolve_error(cfg_with("qwen2_dora", "modules_to_save", R"(["lm_head"])"), "qwen2");
  EXPECT_NE(e.find("modules_to_save on a model with tied embeddings needs ensure_weight_tying = true"), std::string::npos)
      << e;
}

}  // namespace
}  // namespace oomless
