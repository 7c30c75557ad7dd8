// The trainer end to end on preset:micro and the bundled eval text: loss normalisation across
// batch/accumulation, bit-exact resume, and settings a resume may not change.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "data/chat.h"
#include "data/dataset.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "model/load.h"
#include "model/config.h"
#include "train/trainer.h"
#include "util/harness.h"
#include "util/train_fixture.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;
using test::slurp;
using test::micro;
using test::losses;
using test::run_interrupted;
using test::expect_same_run;

TEST(Train, BatchTwoEqualsTwoAccumulatedMicroBatches) {
  const std::string a = testing::TempDir() + "/oomless_train_b2", b = testing::TempDir() + "/oomless_train_a2";
  TrainConfig ca = micro(a), cb = micro(b);
  ca.steps = cb.steps = 1;
  cb.batch = 1, cb.grad_accum = 2;
  ASSERT_EQ(run_training(ca), 0);
  ASSERT_EQ(run_training(cb), 0);
  // Same sequences, the same N, the same gradients: bitwise the same weights after the step.
  EXPECT_TRUE(slurp(a + "/checkpoint-1/model.safetensors") == slurp(b + "/checkpoint-1/model.safetensors"));
  EXPECT_EQ(losses(a), losses(b));
}

TEST(Train, ResumeIsBitExact) {
  const std::string whole = testing::TempDir() + "/oomless_train_whole", split = testing::TempDir() + "/oomless_train_split";
  TrainConfig cw = micro(whole);
  ASSERT_EQ(run_training(cw), 0);
  // The same run stopped after its step-2 checkpoint (as if killed there), then resumed: --steps is the
  // run's total, so the schedule is the same.
  run_interrupted(cw, split);
  expect_same_run(whole, split);
  EXPECT_EQ(losses(whole).size(), 4u);
}

// AdamW8bit's state (u8 codes and block scales) goes into checkpoints and a resume continues bit for bit;
// --optim is fixed on resume.
TEST(Train, AdamW8bitResumesBitExactAndOptimIsFixed) {
  const std::string whole = testing::TempDir() + "/oomless_train8_whole", split = testing::TempDir() + "/oomless_train8_split";
  TrainConfig cw = micro(whole);
  cw.optim = "adamw8bit";
  ASSERT_EQ(run_training(cw), 0);
  const TrainConfig c1 = run_interrupted(cw, split);
  expect_same_run(whole, split);
  // the 8-bit codes are in the file, and the run differs from fp32 AdamW's
  const SafetensorsFile f = SafetensorsFile::open(whole + "/checkpoint-4/optimizer.safetensors");
  bool codes = false;
  for (const StTensor& t : f.tensors()) codes |= t.dtype == DType::u8 && t.name.rfind("m.", 0) == 0;
  EXPECT_TRUE(codes);
  const std::string plain = testing::TempDir() + "/oomless_train8_plain";
  TrainConfig cp = micro(plain);
  ASSERT_EQ(run_training(cp), 0);
  EXPECT_NE(losses(plain).back(), losses(whole).back());
  EXPECT_LT(slurp(whole + "/checkpoint-4/optimizer.safetensors").size(),
            slurp(plain + "/checkpoint-4/optimizer.safetensors").size() / 2);
  // a resume may not change the optimizer
  fs::remove_all(split + "/checkpoint-4");
  TrainConfig c3 = c1;
  c3.optim = "adamw";
  try {
    run_training(c3);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--optim"), std::string::npos) << e.what();
  }
}

// --kv-dtype fp8 in a chunk-recurrent run: each step's metrics count the stored keys and values, the
// report draws them, and a resumed run (the amax history restored from trainer_state.json) is bit-exact.
TEST(Train, Fp8KeyValueRunCountsAndResumesBitExact) {
  const std::string whole = testing::TempDir() + "/oomless_train_fp8_whole", split = testing::TempDir() + "/oomless_train_fp8_split";
  TrainConfig c = micro(whole);
  c.chunk = 16;
  c.kv_dtype = "fp8";
  ASSERT_EQ(run_training(c), 0);
  run_interrupted(c, split);
  expect_same_run(whole, split);
  std::ifstream f(whole + "/metrics.jsonl");
  int counted = 0;
  for (std::string line; std::getline(f, line);) {
    const json::Value o = json::parse(line);
    if (!o.find("kv_fp8")) continue;
    // 3 earlier chunks of 16 per sequence, 2 sequences, 2 layers, Hkv 2 x D 16 values each
    EXPECT_EQ(o.at("kv_fp8").at("k").at("values").as_int(), 3 * 16 * 2 * 2 * 2 * 16);
    ++counted;
  }
  EXPECT_EQ(counted, 4);
  EXPECT_NE(slurp(whole + "/report.html").find("FP8 keys and values"), std::string::npos);
  // and the run differs from fp32's
  TrainConfig p = micro(testing::TempDir() + "/oomless_train_fp8_plain");
  p.chunk = 16;
  ASSERT_EQ(run_training(p), 0);
  EXPECT_NE(losses(p.out).back(), losses(whole).back());
}

// --act-dtype fp8: each step's metrics count the narrowed saved activations per kind, the report draws
// them, a resumed run (their amax history restored from trainer_state.json) is bit-exact, and the run
// differs from fp32's. --act-dtype with --save-policy none and no --chunk narrows nothing: refused.
TEST(Train, Fp8ActivationRunCountsAndResumesBitExact) {
  const std::string whole = testing::TempDir() + "/oomless_train_act8_whole", split = testing::TempDir() + "/oomless_train_act8_split";
  TrainConfig c = micro(whole);
  c.act_dtype = "fp8";
  ASSERT_EQ(run_training(c), 0);
  run_interrupted(c, split);
  expect_same_run(whole, split);
  std::ifstream f(whole + "/metrics.jsonl");
  int counted = 0;
  for (std::string line; std::getline(f, line);) {
    const json::Value o = json::parse(line);
    if (!o.find("act_fp8")) continue;
    const json::Value& a = o.at("act_fp8");
    int64_t sum = 0;
    for (const auto& [k, v] : a.as_object())
      if (k != "all") sum += v.at("values").as_int();
    EXPECT_EQ(a.at("all").at("values").as_int(), sum);
    EXPECT_GT(a.at("gate").at("values").as_int(), 0);
    ++counted;
  }
  EXPECT_EQ(counted, 4);
  EXPECT_NE(slurp(whole + "/report.html").find("FP8 saved activations"), std::string::npos);
  TrainConfig p = micro(testing::TempDir() + "/oomless_train_act8_plain");
  ASSERT_EQ(run_training(p), 0);
  EXPECT_NE(losses(p.out).back(), losses(whole).back());
  TrainConfig none = micro(testing::TempDir() + "/oomless_train_act8_none");
  none.act_dtype = "bf16";
  none.save_policy = "none";
  test::expect_refused(none, "--save-policy none");
  none.act_dtype = "int4";
  none.save_policy = "all";
  test::expect_refused(none, "fp32, bf16 or fp8");
}

// --save-policy per layer: a run that keeps layer 0 whole and recomputes layer 1 trains bit for bit as one
// that keeps everything; a list naming a layer the model lacks is refused at setup, naming the flag.
TEST(Train, PerLayerSavePolicyTrainsTheSameRun) {
  TrainConfig all = micro(testing::TempDir() + "/oomless_train_spl_all");
  ASSERT_EQ(run_training(all), 0);
  TrainConfig mixed = micro(testing::TempDir() + "/oomless_train_spl_mixed");
  mixed.save_policy = "all:0,none";
  mixed.act_dtype = "bf16";  // layer 0 keeps activations to narrow
  ASSERT_EQ(run_training(mixed), 0);
  mixed.act_dtype = "fp32";
  mixed.out = testing::TempDir() + "/oomless_train_spl_mixed32";
  fs::remove_all(mixed.out);
  ASSERT_EQ(run_training(mixed), 0);
  test::expect_same_run(all.out, mixed.out);
  TrainConfig bad = micro(testing::TempDir() + "/oomless_train_spl_bad");
  bad.save_policy = "all:0-2";
  test::expect_refused(bad, "--save-policy all:0-2: layer 2 is past the model's last layer, 1");
  bad.save_policy = "none:0,none";
  bad.act_dtype = "bf16";
  test::expect_refused(bad, "keeps nothing to narrow");
}

TEST(Train, ResumeRefusesChangedSettings) {
  const std::string out = testing::TempDir() + "/oomless_train_changed";
  TrainConfig c = micro(out);
  c.steps = 1;
  ASSERT_EQ(run_training(c), 0);
  c.resume = true;
  c.steps = 2;
  c.lr = 1e-2;
  try {
    run_training(c);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--lr"), std::string::npos) << e.what();
  }
}

// --rope-theta and --rope-scaling change what is trained and are written into every checkpoint's config.json
// (so the saved model is the one that was trained); a resume may not change them.
TEST(Train, RopeOverridesAreTrainedAndSaved) {
  const std::string plain = testing::TempDir() + "/oomless_train_rope_plain",
                    out = testing::TempDir() + "/oomless_train_rope_yarn";
  TrainConfig p = micro(plain), c = micro(out);
  p.steps = c.steps = 1;
  c.rope_theta = 50000.0;
  c.rope_scaling = "yarn:4";
  ASSERT_EQ(run_training(p), 0);
  ASSERT_EQ(run_training(c), 0);
  EXPECT_NE(losses(plain), losses(out));
  const ModelConfig native = preset_config("micro");
  const ModelConfig saved = ModelConfig::from_file(out + "/checkpoint-1/config.json");
  EXPECT_EQ(saved.rope.scaling, RopeScaling::yarn);
  EXPECT_DOUBLE_EQ(saved.rope.theta, 50000.0);
  EXPECT_DOUBLE_EQ(saved.rope.factor, 4.0);
  EXPECT_DOUBLE_EQ(saved.rope.original_max_position, static_cast<double>(native.max_position));
  EXPECT_EQ(saved.max_position, 4 * native.max_position);
  c.resume = true;
  c.steps = 2;
  c.rope_scaling = "linear:4";
  try {
    run_training(c);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--rope-scaling"), std::string::npos) << e.what();
  }
}

// A new run never writes over an earlier one in the same folder.
TEST(Train, ANewRunRefusesAFolderThatHoldsARun) {
  const std::string out = testing::TempDir() + "/oomless_train_twice";
  TrainConfig c = micro(out);
  c.steps = 1;
  ASSERT_EQ(run_training(c), 0);
  const std::string before = slurp(out + "/checkpoint-1/model.safetensors");
  try {
    run_training(c);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already holds a run"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(before == slurp(out + "/checkpoint-1/model.safetensors"));
}

// Non-finite steps are skipped (not applied) and counted; more than --max-nonfinite in a row stops the run
// with an explanation.
TEST(Train, NonFiniteStepsAreSkippedThenTheRunStops) {
  const std::string out = testing::TempDir() + "/oomless_train_nonfinite";
  TrainConfig c = micro(out);
  c.steps = 10;
  c.lr = 1e30;  // the first update sends the weights to ~1e30: every later loss overflows
  c.warmup = 0;
  c.clip = 0;
  c.max_nonfinite = 2;
  try {
    run_training(c);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("non-finite"), std::string::npos) << w;
    EXPECT_NE(w.find("--max-nonfinite 2"), std::string::npos) << w;
  }
  std::ifstream f(out + "/metrics.jsonl");
  int skipped = 0, lines = 0;
  for (std::string line; std::getline(f, line); ++lines) skipped += json::parse(line).at("skipped").as_bool();
  EXPECT_EQ(skipped, 3);  // steps 2, 3, 4; the run stops at the third in a row
  EXPECT_EQ(lines, 4);
}

// Runs `c` under each budget (MiB): every run either fails at setup (before step 1: no metrics line, no
// checkpoint) with the ledger's figures, or completes all its steps; some of each.
void expect_budget_sweep(TrainConfig c, const std::vector<double>& budgets_mib) {
  int failed = 0, completed = 0;
  const std::string out = c.out;
  c.steps = 2;
  c.save_every = 0;
  for (double mib : budgets_mib) {
    fs::remove_all(out);
    c.budget = std::to_string(static_cast<int64_t>(mib * 1024 * 1024));
    try {
      ASSERT_EQ(run_training(c), 0);
      EXPECT_TRUE(fs::exists(out + "/checkpoint-2")) << mib << " MiB";
      ++completed;
    } catch (const Error& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find("budget"), std::string::npos) << w;
      EXPECT_EQ(w.find("at step"), std::string::npos) << mib << " MiB failed mid-run: " << w;
      // Nothing was trained: the failure came before step 1.
      EXPECT_TRUE(losses(out).empty()) << mib << " MiB failed after training started: " << w;
      EXPECT_FALSE(fs::exists(out + "/checkpoint-1")) << mib << " MiB";
      ++failed;
    }
  }
  EXPECT_GT(failed, 0);
  EXPECT_GT(completed, 0);
}

TEST(Train, BudgetSweepFailsAtSetupOrCompletes) {
  expect_budget_sweep(micro(testing::TempDir() + "/oomless_train_budget"),
                      {0.5, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0, 48.0});
}

// Chunk-recurrent runs take their workspaces in a dry step over two chunks only; a longer sequence (here
// five chunks, the last one partial) must not need more, whatever the offload mode.
TEST(Train, ChunkedBudgetSweepFailsAtSetupOrCompletes) {
  for (const char* mode : {"none", "host", "disk"}) {
    SCOPED_TRACE(mode);
    TrainConfig c = micro(testing::TempDir() + "/oomless_train_budget_chunked");
    c.seq = 4 * 96 + 40;
    c.batch = 1;
    c.chunk = 96;
    c.page = 32;
    c.kv_offload = mode;
    // Setup needs about 12.5 MiB here: fine steps around it, coarse ones away from it.
    expect_budget_sweep(c, {10.0, 11.0, 12.0, 12.25, 12.5, 12.75, 13.0, 14.0, 16.0});
  }
}

// The Trainer as benches and tests drive it: a step on batches the caller supplies is the step the run
// takes on the same sequences drawn from its data (same loss bits, same weights after), and it needs no
// --data.
TEST(Trainer, CallerBatchesStepAsTheDataDrivenRunDoes) {
  for (int lora : {0, 4}) {
    SCOPED_TRACE(lora);
    TrainConfig with = micro(testing::TempDir() + "/oomless_trainer_data");
    with.lora = lora;
    TrainConfig without = with;
    without.data.clear();
    Trainer a(with, with.out), b(without, "");
    for (int s = 0; s < 3; ++s) {
      const StepBatch batch = a.next_batch();
      const StepResult ra = a.step(batch), rb = b.step(batch);
      EXPECT_EQ(ra.step, s + 1);
      EXPECT_EQ(rb.step, s + 1);
      EXPECT_EQ(ra.loss, rb.loss);
      EXPECT_EQ(ra.grad_norm, rb.grad_norm);
      EXPECT_EQ(ra.lr, rb.lr);
      EXPECT_GT(ra.targets, 0);
    }
    const ParamSet& pa = a.engine().adapters ? a.engine().adapters->tensors() : *a.engine().params;
    const ParamSet& pb = b.engine().adapters ? b.engine().adapters->tensors() : *b.engine().params;
    ASSERT_EQ(pa.bytes(), pb.bytes());
    auto bytes = [](const ParamSet& p) {
      return test::tensor_values<uint8_t>(Tensor(p.data(), DType::u8, {static_cast<int64_t>(p.bytes())}, Tier::Device));
    };
    EXPECT_EQ(bytes(pa), bytes(pb));
    // With --lora the base is frozen: a trainable set of adapter tensors only.
    if (lora) EXPECT_LT(a.trainable_params(), a.frozen_params() / 10);
    else EXPECT_EQ(a.frozen_params(), 0);
  }
}

// save() then a Trainer resumed from that folder continues bit for bit (full training and adapters).
TEST(Trainer, SaveThenResumeContinuesBitExactly) {
  for (int lora : {0, 4}) {
    SCOPED_TRACE(lora);
    const std::string out = testing::TempDir() + "/oomless_trainer_resume";
    TrainConfig c = micro(out);
    c.lora = lora;
    std::vector<double> whole;
    {
      Trainer t(c, out);
      for (int s = 0; s < 4; ++s) whole.push_back(t.step().loss);
    }
    fs::remove_all(out);
    std::vector<double> split;
    {
      Trainer t(c, out);
      for (int s = 0; s < 2; ++s) split.push_back(t.step().loss);
      t.save();
    }
    TrainConfig r = c;
    r.resume = true;
    Trainer t(r, out);
    EXPECT_EQ(t.steps_done(), 2);
    for (int s = 0; s < 2; ++s) split.push_back(t.step().loss);
    EXPECT_EQ(whole, split);
  }
}

// Defaults by situation: a pretrained model fine-tunes (lr 2e-5, 2e-4 with adapters, no weight decay,
// warmup 3% of the run), a random init trains as before (1e-3, 0.1, 20); min-lr is 0.1 lr; given values stay.
TEST(Trainer, DefaultsDependOnWhetherTheModelIsPretrained) {
  struct Case {
    std::string model, data;
    int64_t lora;
    double lr, wd;
    int64_t warmup;
  };
  const std::string hf = test::source_path("tests/golden/models/llama_mha_tied");
  const std::string ids = test::source_path("tests/data/llama_mha_tied.ids");
  for (const Case& k : {Case{hf, ids, 0, 2e-5, 0.0, 3}, Case{hf, ids, 4, 2e-4, 0.0, 3},
                        Case{"preset:micro", test::source_path("data/kjv/eval.txt"), 0, 1e-3, 0.1, 20}}) {
    SCOPED_TRACE(k.model + " lora " + std::to_string(k.lora));
    TrainConfig c;
    c.model = k.model, c.data = k.data, c.lora = k.lora;
    c.seq = 16, c.batch = 1, c.steps = 100;
    Trainer t(c, "");
    EXPECT_EQ(t.config().lr, k.lr);
    EXPECT_EQ(t.config().min_lr, 0.1 * k.lr);
    EXPECT_EQ(t.config().weight_decay, k.wd);
    EXPECT_EQ(t.config().warmup, k.warmup);
    // Given values are kept.
    c.lr = 5e-5, c.min_lr = 0, c.weight_decay = 0.01, c.warmup = 7;
    Trainer g(c, "");
    EXPECT_EQ(g.config().lr, 5e-5);
    EXPECT_EQ(g.config().min_lr, 0.0);
    EXPECT_EQ(g.config().weight_decay, 0.01);
    EXPECT_EQ(g.config().warmup, 7);
  }
}

// --eval-data x.jsonl: chats are rendered with the template and scored on the assistant targets only,
// as training scores them (not as raw JSON text).
TEST(Trainer, ChatEvalDataIsScoredOnTheAssistantTargets) {
  const std::string dir = testing::TempDir() + "/oomless_trainer_chat_eval";
  fs::create_directories(dir);
  const std::string chat = dir + "/chat.jsonl";
  std::ofstream(chat) << "{\"messages\": [{\"role\": \"user\", \"content\": \"Who made the light?\"}, "
                         "{\"role\": \"assistant\", \"content\": \"God said, Let there be light.\"}]}\n"
                         "{\"messages\": [{\"role\": \"user\", \"content\": \"And then?\"}, "
                         "{\"role\": \"assistant\", \"content\": \"And there was light.\"}]}\n";
  TrainConfig c = micro(dir + "/run");
  c.seq = 32;
  c.eval_data = chat;
  Trainer t(c, c.out);
  const std::optional<EvalResult> r = t.evaluate();
  ASSERT_TRUE(r.has_value());
  DatasetOptions o;
  o.paths = {chat};
  o.T = 32;
  o.eos_id = *t.engine().src.cfg.eos_id;
  o.vocab = t.engine().src.cfg.V;
  const Sequences s = document_sequences(o, &*t.engine().src.tokenizer, t.engine().src.tokenizer_config, 32);
  int64_t supervised = 0;
  double loss_sum = 0;
  Model& m = *t.engine().model;
  for (size_t w = 0; w < s.ids.size(); ++w) {
    for (int32_t x : s.targets[w]) supervised += x >= 0;
    const CeResult ce = m.forward(Tensor(const_cast<int32_t*>(s.ids[w].data()), DType::i32, {32}),
                                  Tensor(const_cast<int32_t*>(s.targets[w].data()), DType::i32, {32}), false);
    loss_sum += ce.loss_sum;
  }
  EXPECT_EQ(r->predictions, supervised);
  EXPECT_LT(r->predictions, r->tokens / 2);  // user turns, headers and system text are not scored
  EXPECT_GT(r->predictions, 10);
  EXPECT_EQ(r->loss_sum, loss_sum);
}

// A model folder saved by current transformers keeps its template in chat_template.jinja; it is the
// template when tokenizer_config.json holds none.
TEST(Trainer, ChatTemplateJinjaBesideTheTokenizerConfigIsRead) {
  const fs::path dir = fs::path(testing::TempDir()) / "oomless_chat_template_jinja";
  fs::remove_all(dir);
  fs::copy(test::source_path("tests/golden/models/llama_mha_tied"), dir, fs::copy_options::recursive);
  fs::copy_file(test::source_path("data/tokenizer/tokenizer.json"), dir / "tokenizer.json");
  json::Value tc = json::parse_file(test::source_path("data/tokenizer/tokenizer_config.json"));
  const std::string tmpl = tc.at("chat_template").as_string();
  json::Value without = json::Value::object();
  for (const auto& [k, v] : tc.as_object())
    if (k != "chat_template") without.set(k, v);
  std::ofstream(dir / "tokenizer_config.json") << json::dump(without);
  {
    const ModelSource none = open_model(dir.string());
    EXPECT_EQ(ChatTemplate::from_config(none.tokenizer_config).kind(), ChatTemplate::Kind::none);
  }
  std::ofstream(dir / "chat_template.jinja") << tmpl;
  const ModelSource m = open_model(dir.string());
  ASSERT_TRUE(m.tokenizer_config.find("chat_template"));
  EXPECT_EQ(m.tokenizer_config.at("chat_template").as_string(), tmpl);
  EXPECT_EQ(ChatTemplate::from_config(m.tokenizer_config).kind(), ChatTemplate::Kind::chatml);
}

// --save-dtype bf16 halves the weights in checkpoints (a resume continues from the rounded weights, and
// says so); --save-optimizer no writes the weights only, and resuming such a checkpoint is refused.
TEST(Trainer, CheckpointsInBf16OrWithoutOptimizerState) {
  const std::string out = testing::TempDir() + "/oomless_trainer_save_dtype";
  TrainConfig c = micro(out);
  c.steps = 2;
  c.save_dtype = "bf16";
  ASSERT_EQ(run_training(c), 0);
  const SafetensorsFile m = SafetensorsFile::open(out + "/checkpoint-2/model.safetensors");
  for (const StTensor& t : m.tensors()) EXPECT_EQ(t.dtype, DType::bf16) << t.name;
  EXPECT_TRUE(fs::exists(out + "/checkpoint-2/generation_config.json"));
  const json::Value g = json::parse_file(out + "/checkpoint-2/generation_config.json");
  EXPECT_EQ(g.at("eos_token_id").as_int(), *preset_config("micro").eos_id);
  TrainConfig r = c;
  r.resume = true;
  r.steps = 3;
  ASSERT_EQ(run_training(r), 0);  // resumed from the bf16 weights

  const std::string out2 = testing::TempDir() + "/oomless_trainer_no_optimizer";
  TrainConfig w = micro(out2);
  w.steps = 1;
  w.save_optimizer = "no";
  ASSERT_EQ(run_training(w), 0);
  EXPECT_FALSE(fs::exists(out2 + "/checkpoint-1/optimizer.safetensors"));
  EXPECT_TRUE(fs::exists(out2 + "/checkpoint-1/model.safetensors"));
  w.resume = true;
  w.steps = 2;
  try {
    run_training(w);
    ADD_FAILURE() << "resumed a checkpoint without optimizer state";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds no optimizer state (it was saved with --save-optimizer no)"),
              std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace oomless
