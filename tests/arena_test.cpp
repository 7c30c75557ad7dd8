// Arenas, budgets and the ledger: the accounting every memory claim rests on.
#include <sys/mman.h>

#include <fstream>
#include <sstream>
#include <string>

#include "backend/cpu/cpu_ops.h"
#include "memory/arena.h"
#include "util/harness.h"

namespace oomless::test {
namespace {

TEST(Arena, LedgerTracksCurrentAndPeakPerCategory) {
  Ledger ledger;
  Arena dev(Tier::Device, 1 << 20, ledger);
  {
    Buffer w = dev.alloc(1000, Category::weights, "w");
    Buffer a = dev.alloc(5000, Category::activations, "a");
    EXPECT_EQ(ledger.current(Tier::Device, Category::weights), 1000u);
    EXPECT_EQ(ledger.current(Tier::Device, Category::activations), 5000u);
    EXPECT_EQ(ledger.current_total(Tier::Device), 6000u);
    { Buffer tmp = dev.alloc(300000, Category::workspace, "big"); }  // mapped pages
    EXPECT_EQ(ledger.current(Tier::Device, Category::workspace), 0u);
    EXPECT_EQ(ledger.peak(Tier::Device, Category::workspace), 300000u);
    EXPECT_EQ(ledger.peak_total(Tier::Device), 306000u);
    EXPECT_EQ(ledger.peak_static(), 1000u);
    EXPECT_EQ(ledger.peak_dynamic(), 305000u);
    Buffer moved = std::move(a);
    EXPECT_EQ(ledger.current(Tier::Device, Category::activations), 5000u);
    EXPECT_FALSE(a);  // NOLINT: moved-from is empty by contract
  }
  EXPECT_EQ(ledger.current_total(Tier::Device), 0u);
  EXPECT_EQ(dev.used(), 0u);
  EXPECT_EQ(ledger.peak_all(), 306000u);
  ledger.reset_peaks();
  EXPECT_EQ(ledger.peak_all(), 0u);
}

TEST(Arena, OverBudgetIsAnErrorThatNamesEverything) {
  Ledger ledger;
  Arena dev(Tier::Device, 10000, ledger);
  Buffer w = dev.alloc(6000, Category::weights, "embed");
  try {
    Buffer x = dev.alloc(5000, Category::activations, "attention.lse");
    FAIL() << "allocation past the budget succeeded";
  } catch (const OutOfBudget& e) {
    std::string m = e.what();
    EXPECT_EQ(m.rfind("[arena]", 0), 0u) << m;
    EXPECT_NE(m.find("activations"), std::string::npos) << m;   // category
    EXPECT_NE(m.find("attention.lse"), std::string::npos) << m; // what
    EXPECT_NE(m.find("4.88 KiB"), std::string::npos) << m;      // request
    EXPECT_NE(m.find("weights 5.86 KiB"), std::string::npos) << m;  // held, by category
    EXPECT_NE(m.find("9.77 KiB"), std::string::npos) << m;      // budget
  }
  // Nothing was charged by the failed request; the rest of the budget is still usable.
  EXPECT_EQ(dev.used(), 6000u);
  Buffer ok = dev.alloc(4000, Category::activations);
  EXPECT_EQ(dev.used(), 10000u);
}

TEST(Arena, SharedBudgetCapsDeviceAndHostTogether) {
  CpuMemory mem(10000);
  Buffer a = mem.device.alloc(6000, Category::weights);
  EXPECT_THROW(mem.host.alloc(5000, Category::optimizer), OutOfBudget);
  Buffer b = mem.host.alloc(4000, Category::optimizer);
  EXPECT_EQ(mem.ledger.current_total(Tier::Device), 6000u);
  EXPECT_EQ(mem.ledger.current_total(Tier::Host), 4000u);
  a.reset();
  Buffer c = mem.host.alloc(6000, Category::grads);
  EXPECT_EQ(mem.ledger.peak_all(), 10000u);
}

TEST(Arena, BuffersAreAlignedAndViewsChecked) {
  Ledger ledger;
  Arena host(Tier::Host, size_t(1) << 30, ledger);
  for (size_t n : {1, 3, 64, 1000, 300000}) {
    Buffer b = host.alloc(n, Category::workspace);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u) << n;
  }
  Buffer b = host.alloc(4 * 12, Category::activations);
  Tensor t = b.view(DType::f32, {3, 4});
  EXPECT_EQ(t.tier, Tier::Host);
  EXPECT_THROW(b.view(DType::f32, {4, 4}), Error);
  EXPECT_FALSE(host.alloc(0, Category::workspace));
}

TEST(Arena, LedgerReportsAsTableAndJson) {
  Ledger ledger;
  Arena dev(Tier::Device, 1 << 20, ledger);
  Buffer w = dev.alloc(2048, Category::weights);
  std::string table = ledger.table(), json = ledger.json();
  EXPECT_NE(table.find("weights"), std::string::npos);
  EXPECT_NE(table.find("2.00 KiB"), std::string::npos) << table;
  EXPECT_NE(json.find("\"device\": {\"weights\": {\"current\": 2048, \"peak\": 2048}"), std::string::npos) << json;
  EXPECT_NE(json.find("\"static\": {\"current\": 2048, \"peak\": 2048}"), std::string::npos) << json;
}

TEST(Arena, ParseSizeTakesBinaryAndDecimalUnits) {
  EXPECT_EQ(parse_size("24GiB"), size_t(24) << 30);
  EXPECT_EQ(parse_size("24GB"), size_t(24000000000));
  EXPECT_EQ(parse_size("512MiB"), size_t(512) << 20);
  EXPECT_EQ(parse_size("1.5G"), size_t(3) << 29);
  EXPECT_EQ(parse_size("1000"), size_t(1000));
  EXPECT_EQ(parse_size("2kb"), size_t(2000));
  for (const char* bad : {"", "GiB", "12 parsecs", "-1GiB", "1..2G"}) EXPECT_THROW(parse_size(bad), Error) << bad;
}

// The ledger must not drift from what the process really holds: run a workload whose every byte comes
// from arenas (oneDNN scratchpads included) and compare the peak RSS growth with the ledger's peak.
size_t status_kib(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stoull(line.substr(std::string(key).size()));
  return 0;
}

TEST(Arena, PeakRssFollowsTheLedger) {
  auto ops_warm = make_ops("cpu");  // load libraries and thread pools before the idle reading
  {
    HostTensor a(DType::f32, {64, 64}), c(DType::f32, {64, 64});
    ops_warm->matmul(c, a, a, false, false, false);
  }
  ops_warm.reset();
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";  // reset VmHWM to the current RSS
  }
  size_t idle = status_kib("VmRSS:") * 1024;
  CpuMemory mem(size_t(8) << 30);
  auto ops = make_ops("cpu", &mem.device);
  const int64_t T = 2048, E = 1024, F = 2816;
  Buffer w1 = mem.device.alloc(sizeof(float) * E * F, Category::weights, "w1");
  Buffer w2 = mem.device.alloc(sizeof(float) * F * E, Category::weights, "w2");
  Buffer x = mem.device.alloc(sizeof(float) * T * E, Category::activations, "x");
  Buffer h = mem.device.alloc(sizeof(float) * T * F, Category::activations, "h");
  Buffer y = mem.device.alloc(sizeof(float) * T * E, Category::activations, "y");
  Tensor tw1 = w1.view(DType::f32, {E, F}), tw2 = w2.view(DType::f32, {F, E});
  Tensor tx = x.view(DType::f32, {T, E}), th = h.view(DType::f32, {T, F}), ty = y.view(DType::f32, {T, E});
  ops->fill(tw1, 0.01);
  ops->fill(tw2, 0.01);
  ops->fill(tx, 1.0);
  ops->matmul(th, tx, tw1, false, false, false);
  ops->swiglu_forward(th, th, th);
  ops->matmul(ty, th, tw2, false, false, false);
  ops->matmul(tw2, th, ty, true, false, true);  // a weight-gradient-shaped product
  size_t peak_rss = status_kib("VmHWM:") * 1024;
  size_t grown = peak_rss > idle ? peak_rss - idle : 0;
  size_t ledger_peak = mem.ledger.peak_all();
  double slack = 0.10 * ledger_peak + 64.0 * 1048576;
  EXPECT_LE(std::fabs(static_cast<double>(grown) - static_cast<double>(ledger_peak)), slack)
      << "peak RSS grew by " << format_bytes(grown) << ", ledger peak " << format_bytes(ledger_peak) << "\n"
      << mem.ledger.table();
  EXPECT_GE(ledger_peak, size_t(sizeof(float) * (2 * E * F + 2 * T * E + T * F)));
}

// Zeroed memory from the heap's mappings is resident and writable before first use: a read of a page never
// touched maps the shared zero page, and the write after it (an optimizer moment, an accumulated gradient)
// must copy it and interrupt the other threads to flush their TLBs.
TEST(Arena, ZeroedMappingsAreResidentAndZero) {
  CpuMemory mem(size_t(1) << 30);
  const size_t bytes = size_t(8) << 20;
  Buffer z = mem.host.alloc_zeroed(bytes, Category::optimizer, "m");
  const long page = sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  ASSERT_EQ(mincore(z.data(), bytes, resident.data()), 0);
  size_t in = 0;
  for (unsigned char r : resident) in += r & 1;
  EXPECT_EQ(in, resident.size()) << "pages resident after alloc_zeroed";
  const unsigned char* b = z.as<unsigned char>();
  size_t nonzero = 0;
  for (size_t i = 0; i < bytes; ++i) nonzero += b[i] != 0;
  EXPECT_EQ(nonzero, 0u);
}

}  // namespace
}  // namespace oomless::test
