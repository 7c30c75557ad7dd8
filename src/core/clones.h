#pragma once
// OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default"): a function built once per named target, the
// clone chosen at load time by the CPU's features (GCC's target_clones, ifunc). Clang 14 reads "arch=x86-64-vN"
// in a clone's resolver as a CPU model's name, which no CPU reports, and runs the default clone everywhere
// (measured: no fused multiply-adds where GCC's build has them, so other bits than the kernels written with
// intrinsics). Under clang (the sanitizer tree) the function is built once, for x86-64-v3 (AVX2 + FMA): the
// clone GCC's build runs on a CPU without AVX-512, with the same bits as its AVX-512 one; such a build needs an
// AVX2 + FMA CPU. The Release build is GCC's.
#if defined(__clang__)
#define OOMLESS_CLONES(...) __attribute__((target("arch=x86-64-v3")))
#else
#define OOMLESS_CLONES(...) __attribute__((target_clones(__VA_ARGS__)))
#endif
