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
  std::vector<uint8_t> grads;
  size_t device_acts = 0, host_acts = 0, disk_acts = 0;
};

struct Case {
  std::vector<SavePolicy> layers;
  ComputeDType dtype = ComputeDType::f32;
  DType act_store = DType::f32;
};

// Two forward + backward passes over different tokens, gradients accumulating. tiers: per layer (else
// `offload` for every layer).
Outcome run(const Case& st, Tier offload, std::vector<Tier> tiers = {}) {
  const ModelConfig cfg = five_layers();
  CpuMemory mem(size_t{1} << 30);
  auto ops = make_ops("cpu");
  ParamSet params(cfg, DType::f32, mem.device, Category::weights);
  init_random(*ops, params, 5, 0.2);
  ModelOptions mo{st.dtype, SavePolicy::all, nullptr, st.act_store};
  mo.save_layers = st.layers;
  mo.act_offload = offload;
  mo.act_tiers = tiers;
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
  r.grads = test::tensor_values<uint8_t>(
      Tensor(m.grads().data(), DType::u8, {static_cast<int64_t>(m.grads().bytes())}, Tier::Device));
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

// Per layer (`--act-offload disk:0-1,host:3,none`): the layers kept on Device hold their own sets, the leaving ones
// share the ring in their order (the last two of them stay in it), the same bits; the ledger exactly so.
TEST(ActOffload, PerLayerPlacesGiveTheKeptBitsAndTheirBytes) {
  using P = SavePolicy;
  using T = Tier;
  const Case st{{P::all, P::selective, P::all, P::all, P::all}};
  const Outcome kept = run(st, T::Device);
  const Outcome none = run({{P::none, P::none, P::none, P::none, P::none}}, T::Device);
  const Outcome all_host = run(st, T::Host);
  const size_t per_layer = (run({{P::all, P::all, P::all, P::all, P::all}}, T::Device).device_acts - none.device_acts) / 5;
  const size_t set_all = (run({{P::all, P::all, P::all, P::all, P::all}}, T::Host).device_acts - none.device_acts) / 2;
  const size_t set_sel =
      (run({{P::selective, P::selective, P::selective, P::selective, P::selective}}, T::Host).device_acts -
       none.device_acts) / 2;
  ASSERT_LT(set_sel, set_all);
  (void)all_host;
  // Layers 0 (all) and 1 (selective) to disk, 3 to host, 2 and 4 kept: four leave, the first two go out.
  const std::vector<T> tiers = {T::Disk, T::Disk, T::Device, T::Host, T::Device};
  const Outcome mixed = run(st, T::Device, tiers);
  ASSERT_EQ(mixed.losses.size(), kept.losses.size());
  EXPECT_EQ(std::memcmp(mixed.losses.data(), kept.losses.data(), 8 * kept.losses.size()), 0);
  EXPECT_EQ(std::memcmp(mixed.grads.data(), kept.grads.data(), kept.grads.size()), 0);
  // Leaving layers in order: 0, 1, 3 -> ring sets 0, 1, 0; only layer 0 leaves memory (the last two stay in the
  // ring), to disk, in a slot of the largest set.
  EXPECT_EQ(mixed.host_acts, 0u);
  EXPECT_EQ(mixed.disk_acts, set_all);
  // Device: layers 2 and 4 whole, and the ring: set 0 holds layers 0 and 3 (all), set 1 layer 1 (selective).
  EXPECT_EQ(mixed.device_acts - none.device_acts, 2 * per_layer + set_all + set_sel);
  // Host on layer 0 and disk on 1 with five leaving: layers 0, 1, 2 go out (0 to host, 1 and 2 to disk).
  const Outcome more = run(st, T::Device, {T::Host, T::Disk, T::Disk, T::Host, T::Disk});
  EXPECT_EQ(std::memcmp(more.grads.data(), kept.grads.data(), kept.grads.size()), 0);
  EXPECT_EQ(more.host_acts, set_all);
  EXPECT_EQ(more.disk_acts, 2 * set_all);
  // The list parses as the save policies do; a bad place is named.
  EXPECT_EQ(parse_act_tiers("disk:0-1,host:3,none", 5), tiers);
  EXPECT_EQ(parse_act_tiers("host", 2), (std::vector<T>{T::Host, T::Host}));
  try {
    parse_act_tiers("disk:0-1,ram", 5);
    ADD_FAILURE() << "ram accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'ram' is not a place for saved activations; use none, host or disk"),
              std::string::npos) << e.what();
  }
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
