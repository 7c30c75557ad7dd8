#!/usr/bin/env bash
# Installs the Debian packages the build needs, when any is missing. Idempotent and quiet when
# everything is present. Needs root (or sudo) only when something must be installed.
set -euo pipefail

# ocl-icd-opencl-dev: Debian's oneDNN CMake config looks for OpenCL (only recommended, so not pulled in).
# python3: the benchmark drivers (bench/peers, bench/long_context), which `make test` runs at a smoke size.
# libopenblas-openmp-dev: LAPACK (GaLore's SVD), OpenBLAS built on the same OpenMP runtime.
# libglpk-dev: GLPK, the mixed-integer solver of `oomless plan`.
# libopenmpi-dev, openmpi-bin: MPI for runs over several processes (`mpirun -np N oomless train ...`).
packages=(g++ cmake make pkg-config libdnnl-dev ocl-icd-opencl-dev libgtest-dev libpcre2-dev libutf8proc-dev liburing-dev time
          python3 libopenblas-openmp-dev libglpk-dev libopenmpi-dev openmpi-bin)
# `scripts/setup.sh fuzz`: also what the libFuzzer build needs.
if [ "${1:-}" = fuzz ]; then packages+=(clang libomp-14-dev libclang-rt-14-dev); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "oomless setup: installing ${missing[*]}" >&2
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "oomless setup: need root to install ${missing[*]} (apt-get)" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq >&2
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
