// LoRA against PEFT: tests/golden/peft/NAME holds an adapter PEFT saved for a tiny transformers model and
// PEFT's float64 loss, logits and adapter gradients for the model golden's ids (tools/golden/make_peft.py; a
// variant with dropout ran PEFT's training forward with the masks oomless draws for dropout seed 1234).
// oomless loads the same folder with --adapter's loader and must give, per tensor in relative L2:
//   fp32 (cpu)     <= max(3 x torch fp32's error, 1e-6)   (the model goldens' bound)
//   bf16 (cpu)     <= 1.5 x torch bf16-autocast's error, a gradient's taken as at least the variant's median;
//                     the loss (one scalar) <= 2 x the largest torch bf16 loss error of the model goldens
//   float64 (ref)  <= 1e-9
// The folders oomless cannot load yet (per-layer patterns) must say so by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>

#include "io/json.h"
#include "io/safetensors.h"
#include "memory/arena.h"
#include "model/adapter_io.h"
#include "model/load.h"
#include "model/model.h"
#include "model/quant_base.h"
#include "util/golden_compare.h"
#include "util/harness.h"

namespace oomless {
namespace {

using test::read_f64;
using test::rel_err;
using test::to_f64;

enum class Mode { fp32, bf16, f64 };

// The loss is one signed sample of the bf16 error: bounded, as in the model goldens, by 2 x the largest
// torch bf16 loss error over the model variants.
double max_torch_bf16_loss_error() {
  double m = 0;
  for (const auto& e : std::filesystem::directory_iterator(test::source_path("tests/golden/models")))
    if (std::filesystem::exists(e.path() / "errors.json"))
      m = std::max(m, json::parse_file((e.path() / "errors.json").string()).at("bf16").at("loss").as_number());
  return m;
}

// base: a model under tests/golden/models, or a path from the repository root (a bitsandbytes 4-bit folder,
// read as the NF4 base `--lora` trains on: fp32 and bf16 only).
void check_variant(const std::string& name, const std::string& base, Mode mode) {
  SCOPED_TRACE(name + (mode == Mode::bf16 ? " bf16" : mode == Mode::f64 ? " f64" : " fp32"));
  const std::string dir = test::source_path("tests/golden/peft/" + name);
  SafetensorsFile g = SafetensorsFile::open(dir + "/golden.safetensors");
  const json::Value errs = json::parse_file(dir + "/errors.json");
  const json::Value& torch_err = errs.at(mode == Mode::bf16 ? "bf16" : "fp32");
  const StTensor* idt = g.find("input_ids");
  ASSERT_TRUE(idt);
  const int64_t T = idt->numel();
  std::vector<int32_t> ids(static_cast<size_t>(T)), targets(static_cast<size_t>(T));
  std::memcpy(ids.data(), idt->data, static_cast<size_t>(T) * 4);
  for (int64_t t = 0; t < T; ++t) targets[static_cast<size_t>(t)] = t + 1 < T ? ids[static_cast<size_t>(t + 1)] : -100;

  ModelSource src = open_model(test::source_path(base.find('/') == std::string::npos ? "tests/golden/models/" + base : base));
  Ledger ledger;
  Arena arena(Tier::Host, size_t{1} << 30, ledger);
  auto ops = make_ops(mode == Mode::f64 ? "ref" : "cpu");
  BaseWeights quantised;
  std::optional<ParamSet> full;
  if (src.bnb4) {
    ASSERT_NE(mode, Mode::f64) << "a 4-bit base runs on the cpu backend";
    quantised = load_base(src, *ops, arena, true);
    ASSERT_TRUE(quantised.quant && quantised.quant->matrices() > 0);
  } else {
    full.emplace(src.cfg, ops->act_dtype(), arena, Category::weights);
    src.load_weights(*ops, *full);
  }
  ParamSet& params = src.bnb4 ? *quantised.params : *full;
  AdapterSet ad(src.cfg, read_adapter_settings(dir, src.cfg), ops->act_dtype(), arena, Category::adapter);
  load_adapter(*ops, dir, src.cfg, ad, params);
  Model m(src.cfg, *ops, params, arena, {mode == Mode::bf16 ? ComputeDType::bf16 : ComputeDType::f32, SavePolicy::all, &ad});
  m.reserve(T, true);
  m.set_dropout_seed(1234);  // make_peft.py's DROPOUT_SEED: a variant with dropout applied these masks in PEFT
  const CeResult r = m.forward(Tensor(ids.data(), DType::i32, {T}), Tensor(targets.data(), DType::i32, {T}), true);
  m.backward(1.0 / static_cast<double>(r.count));

  std::vector<double> grad_errs;
  for (const auto& kv : torch_err.as_object())
    if (kv.first.rfind("grad.", 0) == 0) grad_errs.push_back(kv.second.as_number());
  std::sort(grad_errs.begin(), grad_errs.end());
  const double median = grad_errs.empty() ? 0.0 : grad_errs[grad_errs.size() / 2];
  auto bound = [&](const std::string& key) {
    if (mode == Mode::f64) return 1e-9;
    if (mode == Mode::bf16 && key == "loss") return 2 * max_torch_bf16_loss_error();
    double e = torch_err.at(key).as_number(key);
    if (mode == Mode::bf16 && key.rfind("grad.", 0) == 0) e = std::max(e, median);
    return mode == Mode::fp32 ? std::max(3 * e, 1e-6) : 1.5 * e;
  };
  auto check = [&](const std::string& key, double err) {
    EXPECT_LE(err, bound(key)) << key;
    if (mode != Mode::f64)
      std::printf("[ peft     ] %-22s %-5s %-66s %.3e (torch %.3e)\n", name.c_str(), mode == Mode::bf16 ? "bf16" : "fp32",
                  key.c_str(), err, torch_err.at(key).as_number());
  };
  const double gold_loss = read_f64(g, "loss")[0];
  check("loss", std::abs(r.loss_sum / static_cast<double>(r.count) - gold_loss) / std::abs(gold_loss));
  const int64_t V = src.cfg.V;
  std::vector<double> lg(static_cast<size_t>(T * V));
  if (mode == Mode::f64) {
    m.logits(Tensor(lg.data(), DType::f64, {T, V}));
  } else {
    std::vector<float> lf(lg.size());
    m.logits(Tensor(lf.data(), DType::f32, {T, V}));
    std::copy(lf.begin(), lf.end(), lg.begin());
  }
  check("logits", rel_err(lg, read_f64(g, "logits")));
  size_t n = 0;
  for (const Trainable& t : m.trainable()) {
    const std::string key = "grad." + t.name;
    ASSERT_TRUE(g.find(key)) << key << " missing from the golden";
    check(key, rel_err(to_f64(t.grad), read_f64(g, key)));
    ++n;
  }
  size_t golden_grads = 0;
  for (const StTensor& t : g.tensors()) golden_grads += t.name.rfind("grad.", 0) == 0;
  EXPECT_EQ(golden_grads, n) << "every adapter gradient PEFT computed is compared";
}

TEST(LoraPeft, MatchesPeftInFloat64) { check_variant("llama_gqa_untied_lora", "llama_gqa_untied", Mode::f64); }
TEST(LoraPeft, Fp32WithinThreeTimesTorchFp32) { check_variant("llama_gqa_untied_lora", "llama_gqa_untied", Mode::fp32); }
TEST(LoraPeft, Bf16WithinTorchAutocast) { check_variant("llama_gqa_untied_lora", "llama_gqa_untied", Mode::bf16); }
// rsLoRA with lm_head trained in full (modules_to_save), on Qwen3 (q/k norms).
TEST(LoraPeft, RsLoraAndModulesToSaveMatchPeft) {
  for (Mode m : {Mode::f64, Mode::fp32, Mode::bf16}) check_variant("qwen3_rslora_lm_head", "qwen3", m);
}

// DoRA on Qwen2 (q/k/v biases: DoRA adds the bias after the magnitude's scale), its magnitudes' gradients too.
TEST(LoraPeft, DoraMatchesPeft) {
  for (Mode m : {Mode::f64, Mode::fp32, Mode::bf16}) check_variant("qwen2_dora", "qwen2", m);
}

// merge (oomless merge) gives PEFT's merge_and_unload weights: W + s B A, with DoRA then scaled per row
// by m / ||W + s B A||; float64 against PEFT's float64 merge of layer 0's q_proj.
// DoRA with lora_dropout 0.3 in training: PEFT's form (the base on x, (g - 1) W and the adapter on dropout(x)),
// PEFT run with the masks oomless draws.
TEST(LoraPeft, DoraWithDropoutMatchesPeft) {
  for (Mode m : {Mode::f64, Mode::fp32, Mode::bf16}) check_variant("qwen2_dora_dropout", "qwen2", m);
}

TEST(LoraPeft, MergeMatchesPeftMergeAndUnload) {
  for (const auto& [name, base] : {std::pair<std::string, std::string>{"llama_gqa_untied_lora", "llama_gqa_untied"},
                                   {"qwen2_dora", "qwen2"}}) {
    SCOPED_TRACE(name);
    const std::string dir = test::source_path("tests/golden/peft/" + name);
    ModelSource src = open_model(test::source_path("tests/golden/models/" + base));
    Ledger ledger;
    Arena arena(Tier::Host, size_t{1} << 30, ledger);
    auto ops = make_ops("ref");
    ParamSet params(src.cfg, DType::f64, arena, Category::weights);
    src.load_weights(*ops, params);
    AdapterSet ad(src.cfg, read_adapter_settings(dir, src.cfg), DType::f64, arena, Category::adapter);
    load_adapter(*ops, dir, src.cfg, ad, params);
    const std::string key = "model.layers.0.self_attn.q_proj.weight";
    const std::vector<double> before = to_f64(*params.find(key));
    merge_lora(*ops, params, ad, arena);
    SafetensorsFile g = SafetensorsFile::open(dir + "/golden.safetensors");
    const std::vector<double> gold = read_f64(g, "merged." + key);
    EXPECT_LT(rel_err(to_f64(*params.find(key)), gold), 1e-13);
    EXPECT_GT(rel_err(before, gold), 1e-4) << "the merge must change the weight for this test to mean anything";
  }
}

// QLoRA: PEFT's LoRA and DoRA on a bitsandbytes 4-bit (nf4, double-quantised) model saved by transformers,
// against the float64 adapted model with bitsandbytes' dequantised weights (tools/golden/make_qlora_peft.py);
// the torch error is PEFT + bitsandbytes's own on CPU in float32.
TEST(LoraPeft, QloraOnABitsandbytes4bitBaseMatchesPeft) {
  for (const char* v : {"bnb4_llama_gqa_untied_lora", "bnb4_llama_gqa_untied_dora"})
    check_variant(v, "tests/golden/bnb4/llama_gqa_untied", Mode::fp32);
}

TEST(LoraPeft, FoldersWithFeaturesNotYetSupportedSayWhich) {
  auto message = [](const std::string& name, const std::string& base) {
    ModelSource src = open_model(test::source_path("tests/golden/models/" + base));
    try {
      read_adapter_settings(test::source_path("tests/golden/peft/" + name), src.cfg);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message("mistral_patterns", "mistral").find("differ between layers"), std::string::npos);
}

}  // namespace
}  // namespace oomless
