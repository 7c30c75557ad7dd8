// Saved activations offloaded between a layer's forward and its backward (ModelOptions::act_offload,
// `train --act-offload host|disk`): the same loss and gradient bits as keeping them, for every SavePolicy
// (per layer too), fp32 and bf16 compute and narrow (--act-dtype) storage, over two steps; the Device holds
// two layers' sets, the Host arena or the spill file the others.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "memory/arena.h"
#include "model/model.h"
#include "train/trainer.h"
#include "util/chunked_run.h"
#include "util/harness.h"
#include "util/train_fixture.h"

namespace oomless {
namespace {

ModelConfig five_layers() {
  ModelConfig c = test::small_config();
  c.L = 5;
  return c;
}

struct Outcome {
  std::vector<double> losses;
  std::vector<char> grads;
  size_t device_acts = 0, host_acts = 0, disk_acts = 0;
};

struct Case {
  std::vector<SavePolicy> layers;
  ComputeDType dtype = ComputeDType::f32;
  DType act_store = DType::f32;
};

// Two forward + backward passes over different tokens, gradients accumulating.
Outcome run(const Case& st, Tier offload) {
  const ModelConfig cfg = five_layers();
  CpuMemory mem(size_t{1} << 30);
  auto ops = make_ops("cpu");
  ParamSet params(cfg, DType::f32, mem.device, Category::weights);
  init_random(params, 5, 0.2);
  ModelOptions mo{st.dtype, SavePolicy::all, nullptr, st.act_store};
  mo.save_layers = st.layers;
  mo.act_offload = offload;
  mo.act_host = &mem.host;
  mo.spill_dir = std::filesystem::current_path().string();  // the build folder: not tmpfs
  Model m(cfg, *ops, params, mem.device, mo);
  const int64_t T = 29;
  m.reserve(T, true);
  Outcome r;
  std::mt19937_64 rng(3);
  for (int step = 0; step < 2; ++step) {
    std::vector<int32_t> ids, tg;
    for (int64_t t = 0; t < T; ++t) ids.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(cfg.V)));
    for (int64_t t = 0; t < T; ++t) tg.push_back(t + 1 < T ? ids[static_cast<size_t>(t + 1)] : -100);
    const CeResult c = m.forward(Tensor::of(ids.data(), {T}), Tensor::of(tg.data(), {T}), true);
    m.backward(1.0 / static_cast<double>(c.count));
    r.losses.push_back(c.loss_sum);
  }
  r.grads.resize(m.grads().bytes());
  std::memcpy(r.grads.data(), m.grads().data(), r.grads.size());
  r.device_acts = mem.ledger.peak(Tier::Device, Category::activations);
  r.host_acts = mem.ledger.peak(Tier::Host, Category::activations);
  r.disk_acts = mem.ledger.peak(Tier::Disk, Category::activations);
  return r;
}

TEST(ActOffload, HostAndDiskGiveTheKeptBitsWithTwoLayersOnDevice) {
  using P = SavePolicy;
  const std::vector<Case> setups = {
      {{P::all, P::all, P::all, P::all, P::all}},
      {{P::selective, P::selective, P::selective, P::selective, P::selective}, ComputeDType::bf16},
      {{P::all, P::none, P::selective, P::all, P::none}},
      {{P::all, P::all, P::all, P::all, P::all}, ComputeDType::f32, DType::bf16},
      {{P::selective, P::all, P::none, P::all, P::selective}, ComputeDType::bf16, DType::f8_e4m3}};
  for (const Case& st : setups) {
    std::string what;
    for (P p : st.layers) what += std::string(save_policy_name(p)) + " ";
    what += st.dtype == ComputeDType::bf16 ? "bf16" : "fp32";
    what += std::string(", stored ") + dtype_name(st.act_store);
    SCOPED_TRACE(what);
    const Outcome kept = run(st, Tier::Device);
    EXPECT_EQ(kept.host_acts, 0u);
    for (Tier t : {Tier::Host, Tier::Disk}) {
      SCOPED_TRACE(tier_name(t));
      const Outcome off = run(st, t);
      ASSERT_EQ(off.losses.size(), kept.losses.size());
      EXPECT_EQ(std::memcmp(off.losses.data(), kept.losses.data(), 8 * kept.losses.size()), 0);
      ASSERT_EQ(off.grads.size(), kept.grads.size());
      EXPECT_EQ(std::memcmp(off.grads.data(), kept.grads.data(), kept.grads.size()), 0);
      // The three lower layers' sets left the Device: what they keep is Host or Disk bytes now.
      const size_t away = t == Tier::Host ? off.host_acts : off.disk_acts;
      EXPECT_GT(away, 0u);
      EXPECT_LT(off.device_acts, kept.device_acts);
      if (t == Tier::Host) {
        EXPECT_GE(off.device_acts + off.host_acts, kept.device_acts);
      }
    }
  }
}

// The ledger, exactly: with every layer kept whole, the Device holds two sets and the Host (or the spill file)
// the other three.
TEST(ActOffload, TheLedgerHoldsTwoSetsOnDeviceAndTheRestOnHost) {
  using P = SavePolicy;
  const Case st{{P::all, P::all, P::all, P::all, P::all}};
  const Outcome kept = run(st, Tier::Device), none = run({{P::none, P::none, P::none, P::none, P::none}}, Tier::Device);
  const Outcome host = run(st, Tier::Host), disk = run(st, Tier::Disk);
  const size_t per_layer = (kept.device_acts - none.device_acts) / 5;
  ASSERT_EQ(kept.device_acts - none.device_acts, 5 * per_layer);
  // An offloaded set is its tensors laid out in one buffer, each 64-byte aligned: a layer's bytes plus padding.
  const size_t set = (host.device_acts - none.device_acts) / 2;
  ASSERT_EQ(host.device_acts - none.device_acts, 2 * set);
  EXPECT_GE(set, per_layer);
  EXPECT_LE(set, per_layer + 64 * 20);
  EXPECT_EQ(host.host_acts, 3 * set);
  EXPECT_EQ(disk.device_acts, host.device_acts);
  EXPECT_EQ(disk.disk_acts, 3 * set);
}

// `train --act-offload host|disk`: the same run, checkpoint for checkpoint; bad combinations are refused.
TEST(ActOffload, TrainRunsTheSameAndRefusesWhatItCannotDo) {
  TrainConfig base = test::micro(testing::TempDir() + "/oomless_actoff_none");
  base.model = "preset:tiny";  // six layers: four leave the Device
  base.seq = 32;
  base.batch = 1;
  base.steps = 4;
  base.save_every = 2;
  ASSERT_EQ(run_training(base), 0);
  for (const char* where : {"host", "disk"}) {
    TrainConfig c = test::micro(testing::TempDir() + "/oomless_actoff_" + where);
    c.model = base.model, c.seq = base.seq, c.batch = base.batch, c.steps = base.steps;
    c.act_offload = where;
    if (std::string(where) == "disk") c.spill_dir = std::filesystem::current_path().string();
    ASSERT_EQ(run_training(c), 0);
    test::expect_same_run(base.out, c.out);
  }
  const std::pair<std::string, std::string> bad[] = {{"ram", "use none, host or disk"}, {"chunk", "with --chunk"},
                                                     {"none-policy", "no layer keeps activations"}};
  for (const auto& [which, message] : bad) {
    SCOPED_TRACE(which);
    TrainConfig c = test::micro(testing::TempDir() + "/oomless_actoff_bad");
    c.act_offload = which == "ram" ? "ram" : "host";
    if (which == "chunk") c.chunk = 32;
    if (which == "none-policy") c.save_policy = "none";
    test::expect_refused(c, message);
  }
}

}  // namespace
}  // namespace oomless
