// The oomless command line.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <unistd.h>

#include "backend/cpu/gemm.h"
#include "cli/commands.h"
#include "core/cpu_info.h"
#include "core/error.h"
#include "dist/comm.h"

namespace {

const char* kUsage =
    "oomless - train and fine-tune Llama-family models inside a hard memory budget\n"
    "\n"
    "usage: oomless <command> [options]\n"
    "\n"
    "commands:\n"
    "  train      train or fine-tune a model (full parameters or LoRA/QLoRA/DoRA, crash-safe checkpoints)\n"
    "  estimate   what a train run will hold per tier and category, before it runs; what makes it fit --budget\n"
    "  plan       the fastest schedule of a train run that fits --budget (a mixed-integer program)\n"
    "  eval       loss and perplexity of a model on text, .ids or chat .jsonl data (and its gradient)\n"
    "  generate   continue a prompt (greedy or sampled) with a KV cache, or chat (--chat)\n"
    "  tokenize   text -> token ids, or ids -> text\n"
    "  convert    write a model (preset, GGUF or HF folder) as a Hugging Face folder or a GGUF file\n"
    "  merge      fold a LoRA adapter into its base model and write a Hugging Face folder\n"
    "  probe      measure this machine: CPU, ISA, GEMM and attention GFLOP/s, memory bandwidth\n"
    "\n"
    "Run `oomless <command> --help` for a command's options, `oomless --version` for the build.\n"
    "OOMLESS_ISA=generic|avx2|avx512|amx runs the CPU kernels on a lower path than the best this CPU has;\n"
    "OOMLESS_BF16_GEMM=pairs|widened, bf16 products on the avx512 path in vdpbf16ps pairs or widened to f32\n"
    "(default: whichever this CPU runs faster, measured at start).\n";

// OpenMP's waiting threads: libgomp's default (spin a while, then sleep) is the fastest on an idle machine
// but runs about 3x slower beside one busy process, while sleeping at once (passive) keeps its speed there
// and costs 30-40% on an idle machine (bench/threads/wait_policy.sh; docs/BENCHMARKS.md). libgomp reads its
// policy when it loads, so when other work keeps the CPUs busy at the start of a compute command and neither
// OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set, oomless sets OMP_WAIT_POLICY=passive and starts itself again
// (OOMLESS_WAIT_CHOSEN records the busy CPUs it saw). Load that begins later is not followed.
void choose_wait_policy(const std::string& cmd, char** argv) {
  if (cmd != "train" && cmd != "eval" && cmd != "generate" && cmd != "plan") return;
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT") || std::getenv("OOMLESS_WAIT_CHOSEN")) return;
  const double busy = oomless::busy_cpus(0.1);
  if (busy < 0.3) return;
  char seen[32];
  std::snprintf(seen, sizeof seen, "%.1f", busy);
  setenv("OOMLESS_WAIT_CHOSEN", seen, 1);
  setenv("OMP_WAIT_POLICY", "passive", 1);
  execv("/proc/self/exe", argv);  // only returns on failure: go on with the default policy, and say nothing
  unsetenv("OMP_WAIT_POLICY");
  unsetenv("OOMLESS_WAIT_CHOSEN");
}

int run(const std::string& cmd, const std::vector<std::string>& args) {
  if (cmd == "probe") return oomless::cli::probe(args);
  if (cmd == "train") return oomless::cli::train(args);
  if (cmd == "estimate") return oomless::cli::estimate(args);
  if (cmd == "plan") return oomless::cli::plan(args);
  if (cmd == "eval") return oomless::cli::eval(args);
  if (cmd == "generate") return oomless::cli::generate(args);
  if (cmd == "tokenize") return oomless::cli::tokenize(args);
  if (cmd == "convert") return oomless::cli::convert(args);
  if (cmd == "merge") return oomless::cli::merge(args);
  std::fprintf(stderr, "oomless: unknown command '%s'\n\n%s", cmd.c_str(), kUsage);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "help")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version") || !std::strcmp(argv[1], "version")) {
    std::printf("oomless %s (%s build, %s; CUDA backend %s; MPI %s)\nthis CPU: %s, %s\n", OOMLESS_VERSION,
                OOMLESS_BUILD_TYPE, OOMLESS_COMPILER, OOMLESS_HAS_CUDA ? "compiled in" : "not built",
                oomless::dist::built_with_mpi() ? "compiled in" : "not built", oomless::detect_cpu().model.c_str(),
                oomless::detect_cpu().isa_summary().c_str());
    try {
      std::printf("gemm path: %s\n", oomless::gemm_path().c_str());
    } catch (const oomless::Error& e) {
      std::printf("gemm path: %s\n", e.what());
    }
    return 0;
  }
  std::string cmd = argv[1];
  choose_wait_policy(cmd, argv);
  std::vector<std::string> args(argv + 2, argv + argc);
  int rc = 1;
  try {
    oomless::gemm_isa();  // OOMLESS_ISA, if set, must name a path this CPU has
    oomless::gemm_bf16_pairs();  // and OOMLESS_BF16_GEMM a choice it can run
    // Launched by mpirun / srun: join the other ranks (only train runs over several).
    if (oomless::dist::init(&argc, &argv) && oomless::dist::distributed() && cmd != "train")
      oomless::fail("only `train` runs over several ranks (", oomless::dist::size(), " here); run `", cmd,
                    "` without mpirun / srun");
    rc = run(cmd, args);
  } catch (const oomless::Error& e) {
    std::fprintf(stderr, "oomless %s: %s%s\n", cmd.c_str(), oomless::dist::rank_prefix().c_str(), e.what());
    oomless::dist::abort(1);  // the other ranks would wait on this one
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oomless %s: %sinternal error: %s\n", cmd.c_str(), oomless::dist::rank_prefix().c_str(), e.what());
    oomless::dist::abort(1);
    return 1;
  }
  oomless::dist::finalize();
  return rc;
}
