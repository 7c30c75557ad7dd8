// --optim-state device|host|disk: where the optimizer state lives changes the ledger, not one bit of the
// run. On disk the state is a spill file streamed through a window of three tensors' state: checkpoints
// equal to the in-memory run's byte for byte, resumable across tiers, and a state file that does not match
// the optimizer is refused by name with nothing lost.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "io/json.h"
#include "io/safetensors.h"
#include "optim/adamw.h"
#include "optim/disk_state.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "util/harness.h"
#include "util/train_fixture.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;
using test::slurp;
using test::micro;
using test::losses;

struct Opt {
  std::string name;
  int64_t lora = 0;
};

TrainConfig with(TrainConfig c, const Opt& o) {
  c.optim = o.name;
  c.lora = o.lora;
  if (o.name.rfind("galore", 0) == 0) c.galore_rank = 8, c.galore_gap = 2;
  return c;
}

// Every tier gives the host run's weights, optimizer file and losses, for every optimizer.
TEST(OptimState, EveryTierTrainsBitForBitTheSame) {
  for (const Opt& o : {Opt{"adamw"}, Opt{"adamw8bit"}, Opt{"galore"}, Opt{"galore8bit"}, Opt{"adamw8bit", 4}}) {
    SCOPED_TRACE(o.name + " lora " + std::to_string(o.lora));
    const std::string host = testing::TempDir() + "/oomless_ostate_host";
    ASSERT_EQ(run_training(with(micro(host), o)), 0);
    const char* weights = o.lora ? "adapter_model.safetensors" : "model.safetensors";
    for (const char* tier : {"device", "disk"}) {
      SCOPED_TRACE(tier);
      const std::string out = testing::TempDir() + "/oomless_ostate_" + tier;
      TrainConfig c = with(micro(out), o);
      c.optim_state = tier;
      ASSERT_EQ(run_training(c), 0);
      for (const char* ck : {"checkpoint-2", "checkpoint-4"}) {
        EXPECT_TRUE(slurp(host + "/" + ck + "/" + weights) == slurp(out + "/" + ck + "/" + weights)) << ck;
        EXPECT_TRUE(slurp(host + "/" + ck + "/optimizer.safetensors") == slurp(out + "/" + ck + "/optimizer.safetensors"))
            << ck;
      }
      EXPECT_EQ(losses(host), losses(out));
    }
  }
}

// A run saved with its state in memory resumes with it on disk and the other way round, bit-exactly; and
// --step-in-backward streams each layer's state as backward reaches it.
TEST(OptimState, ResumesAcrossTiersAndStepsInBackward) {
  const std::string whole = testing::TempDir() + "/oomless_ostate_whole", split = testing::TempDir() + "/oomless_ostate_split";
  TrainConfig w = micro(whole);
  w.optim = "adamw8bit";
  ASSERT_EQ(run_training(w), 0);
  for (const char* first : {"host", "disk"}) {
    SCOPED_TRACE(first);
    TrainConfig a = micro(split);
    a.optim = "adamw8bit";
    a.optim_state = first;
    ASSERT_EQ(run_training(a), 0);
    fs::remove_all(split + "/checkpoint-4");
    a.resume = true;
    a.optim_state = std::string(first) == "host" ? "disk" : "host";
    ASSERT_EQ(run_training(a), 0);
    EXPECT_TRUE(slurp(whole + "/checkpoint-4/model.safetensors") == slurp(split + "/checkpoint-4/model.safetensors"));
    EXPECT_TRUE(slurp(whole + "/checkpoint-4/optimizer.safetensors") == slurp(split + "/checkpoint-4/optimizer.safetensors"));
  }
  const std::string plain = testing::TempDir() + "/oomless_ostate_sib_host", disk = testing::TempDir() + "/oomless_ostate_sib_disk";
  TrainConfig p = micro(plain);
  p.batch = 1;
  p.clip = 0;
  p.step_in_backward = true;
  ASSERT_EQ(run_training(p), 0);
  TrainConfig d = p;
  d.out = disk;
  fs::remove_all(disk);
  d.optim_state = "disk";
  ASSERT_EQ(run_training(d), 0);
  EXPECT_TRUE(slurp(plain + "/checkpoint-4/model.safetensors") == slurp(disk + "/checkpoint-4/model.safetensors"));
  EXPECT_EQ(losses(plain), losses(disk));
}

// GaLore's scale defaults to 1 (galore_torch's GaLoreProjector): the default gives what an explicit 1 gives
// and is what the run saves; a run saved with another scale resumes with it when the flag is left out.
TEST(OptimState, GaLoreScaleDefaultsToOneAndAResumeKeepsTheSavedOne) {
  const std::string dir = testing::TempDir() + "/oomless_gscale_";
  TrainConfig one = with(micro(dir + "one"), Opt{"galore"});
  one.galore_scale = 1.0;
  ASSERT_EQ(run_training(one), 0);
  TrainConfig dflt = with(micro(dir + "default"), Opt{"galore"});
  ASSERT_LT(dflt.galore_scale, 0);
  ASSERT_EQ(run_training(dflt), 0);
  test::expect_same_run(dir + "one", dir + "default");
  const json::Value st = json::parse(slurp(dir + "default/checkpoint-4/trainer_state.json"));
  EXPECT_EQ(st.at("config").at("galore-scale").as_number(), 1.0);
  TrainConfig quarter = with(micro(dir + "quarter"), Opt{"galore"});
  quarter.galore_scale = 0.25;
  ASSERT_EQ(run_training(quarter), 0);
  EXPECT_FALSE(slurp(dir + "quarter/checkpoint-4/model.safetensors") == slurp(dir + "one/checkpoint-4/model.safetensors"));
  TrainConfig split = quarter;
  split.out = dir + "split";
  fs::remove_all(split.out);
  ASSERT_EQ(run_training(split), 0);
  fs::remove_all(split.out + "/checkpoint-4");
  split.resume = true;
  split.galore_scale = TrainConfig{}.galore_scale;  // left out on resume
  ASSERT_EQ(run_training(split), 0);
  test::expect_same_run(dir + "quarter", dir + "split");
}

// The ledger: on disk the whole state is Disk bytes, memory holds the window (three pieces' state: preset
// tiny's embedding, 3M elements, streams as three pieces of 1M), and nothing of it is Host. The split
// embedding's 8-bit blocks and GaLore's whole matrices beside it train bit for bit as in memory.
TEST(OptimState, TheLedgerShowsDiskBytesAndAWindowOfPieces) {
  TrainConfig c = micro(testing::TempDir() + "/oomless_ostate_ledger");
  c.model = "preset:tiny";
  c.seq = 32;
  c.batch = 1;
  c.data.clear();
  Trainer host(c, c.out);
  const Ledger& lh = host.engine().mem->ledger;
  const size_t state = lh.peak(Tier::Host, Category::optimizer);
  const ModelConfig& cfg = host.engine().src.cfg;
  EXPECT_EQ(state, static_cast<size_t>(8 * cfg.param_count()));
  EXPECT_EQ(lh.peak(Tier::Device, Category::optimizer), 0u);
  TrainConfig d = c;
  d.optim_state = "disk";
  Trainer disk(d, d.out);
  const Ledger& ld = disk.engine().mem->ledger;
  EXPECT_EQ(ld.peak(Tier::Disk, Category::optimizer), state);
  EXPECT_EQ(ld.peak(Tier::Host, Category::optimizer), 0u);
  ASSERT_EQ(cfg.V * cfg.E, 3 << 20);
  const size_t piece = 8u << 20;  // m and v of 1M elements
  EXPECT_GE(ld.peak(Tier::Device, Category::optimizer), 3 * piece);
  EXPECT_LE(ld.peak(Tier::Device, Category::optimizer), 3 * (piece + 4096));
  TrainConfig v = c;
  v.optim_state = "device";
  Trainer dev(v, v.out);
  EXPECT_EQ(dev.engine().mem->ledger.peak(Tier::Device, Category::optimizer), state);
  EXPECT_EQ(dev.engine().mem->ledger.peak(Tier::Host, Category::optimizer), 0u);
  for (const Opt& o : {Opt{"adamw8bit"}, Opt{"galore8bit"}}) {
    SCOPED_TRACE(o.name);
    TrainConfig a = with(micro(testing::TempDir() + "/oomless_ostate_tiny_host"), o);
    a.model = "preset:tiny";
    a.seq = 32;
    a.batch = 1;
    a.steps = 2;
    if (o.name == "galore8bit") a.galore_rank = 16;
    ASSERT_EQ(run_training(a), 0);
    TrainConfig b = a;
    b.out = testing::TempDir() + "/oomless_ostate_tiny_disk";
    fs::remove_all(b.out);
    b.optim_state = "disk";
    ASSERT_EQ(run_training(b), 0);
    EXPECT_TRUE(slurp(a.out + "/checkpoint-2/model.safetensors") == slurp(b.out + "/checkpoint-2/model.safetensors"));
    EXPECT_TRUE(slurp(a.out + "/checkpoint-2/optimizer.safetensors") ==
                slurp(b.out + "/checkpoint-2/optimizer.safetensors"));
  }
}

// Puts `file`'s new size and SHA-256 into its checkpoint's manifest, as a save would have written them (a
// state file that verifies but holds another optimizer's state, e.g. from another build).
void resign(const std::string& dir, const std::string& name) {
  json::Value m = json::parse_file(dir + "/manifest.json");
  json::Value e = json::Value::object();
  e.set("bytes", json::Value::integer(static_cast<int64_t>(fs::file_size(dir + "/" + name))));
  e.set("sha256", json::Value::string(sha256_file_hex(dir + "/" + name)));
  json::Value files = m.at("files");
  files.set(name, e);
  m.set("files", files);
  std::ofstream(dir + "/manifest.json") << json::dump(m, 2) << "\n";
}

// A checkpoint whose optimizer file does not hold this optimizer's state: refused by name, before any
// state is changed, and the checkpoint is left as it was.
TEST(OptimState, AMismatchedStateFileIsRefusedAndKept) {
  const std::string out = testing::TempDir() + "/oomless_ostate_mismatch";
  TrainConfig c = micro(out);
  c.steps = 2;
  ASSERT_EQ(run_training(c), 0);
  const std::string file = out + "/checkpoint-2/optimizer.safetensors";
  // The same state under one wrong name, then with one tensor of another size.
  const SafetensorsFile f = SafetensorsFile::open(file);
  std::vector<std::vector<char>> copies;
  auto rewrite = [&](const std::string& dst, const std::string& rename, bool shrink) {
    std::vector<StWrite> w;
    for (const StTensor& t : f.tensors()) {
      std::vector<int64_t> shape = t.shape;
      if (shrink && t.name == rename) shape = {1};
      w.push_back({!shrink && t.name == rename ? t.name + ".x" : t.name, *t.dtype, shape, t.data});
    }
    write_safetensors(dst, w);
  };
  const std::string name = f.tensors()[0].name;
  for (bool shrink : {false, true}) {
    for (const char* tier : {"host", "disk"}) {
      SCOPED_TRACE(std::string(tier) + (shrink ? " size" : " name"));
      const std::string bad = testing::TempDir() + "/oomless_ostate_bad.safetensors";
      rewrite(bad, name, shrink);
      const std::string kept = slurp(out + "/checkpoint-2/model.safetensors");
      const std::string manifest = slurp(out + "/checkpoint-2/manifest.json");
      fs::copy_file(file, testing::TempDir() + "/oomless_ostate_orig", fs::copy_options::overwrite_existing);
      fs::copy_file(bad, file, fs::copy_options::overwrite_existing);
      resign(out + "/checkpoint-2", "optimizer.safetensors");
      const std::string planted = slurp(file);
      TrainConfig r = c;
      r.resume = true;
      r.steps = 4;
      r.optim_state = tier;
      try {
        run_training(r);
        ADD_FAILURE() << "no error";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("start a new run"), std::string::npos) << e.what();
      }
      EXPECT_TRUE(slurp(file) == planted);
      EXPECT_TRUE(slurp(out + "/checkpoint-2/model.safetensors") == kept);
      EXPECT_FALSE(fs::exists(out + "/checkpoint-4"));
      fs::copy_file(testing::TempDir() + "/oomless_ostate_orig", file, fs::copy_options::overwrite_existing);
      std::ofstream(out + "/checkpoint-2/manifest.json") << manifest;
    }
  }
}

TEST(OptimState, BadSettingsAreRefused) {
  TrainConfig c = micro(testing::TempDir() + "/oomless_ostate_bad");
  c.optim_state = "nvme";
  try {
    run_training(c);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--optim-state nvme"), std::string::npos) << e.what();
  }
  c.optim_state = "disk";
  c.spill_dir = "/nonexistent/oomless/spill";
  EXPECT_THROW(run_training(c), Error);
  // tmpfs saves no memory: refused (SpillFile's check), as for --kv-offload disk
  if (fs::exists("/dev/shm")) {
    c.spill_dir = "/dev/shm";
    try {
      run_training(c);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--spill-dir"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace oomless
