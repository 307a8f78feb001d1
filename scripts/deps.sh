#!/usr/bin/env bash
# Installs the Debian packages loom needs (idempotent, non-interactive), printing what is missing
# and why:
#   scripts/deps.sh build   what building the loom binary and training need (the quick start)
#   scripts/deps.sh deb     that and what cpack needs to make the Debian package (scripts/deb.sh)
#   scripts/deps.sh [test]  that and what the test suite needs (scripts/test.sh, CI)
set -euo pipefail
set_name=${1:-test}
case "$set_name" in
  build | deb | test) ;;
  *) echo "usage: scripts/deps.sh [build|deb|test]" >&2; exit 2 ;;
esac
# "package: why", one per line.
build_pkgs=(
  "build-essential: the C++20 compiler (g++ 12) and make"
  "cmake: the build"
  "pkg-config: finds PCRE2"
  "libdnnl-dev: oneDNN, the CPU GEMMs"
  "ocl-icd-opencl-dev: oneDNN's CMake config asks for OpenCL (libdnnl-dev only recommends it)"
  "libhwy-dev: Highway, the vectorized kernels of each CPU tier"
  "libtomlplusplus-dev: the TOML job configs"
  "nlohmann-json3-dev: model configs, safetensors headers, tokenizer.json"
  "libpcre2-dev: the tokenizers' split patterns"
  "libxxhash-dev: the XXH3 checksums of checkpoint files (model/checksum.cpp)"
  "libopenmpi-dev: several processes (mpirun) and their collectives"
  "openmpi-bin: mpirun"
  "bible-kjv: the quick start's corpus (the King James Bible)"
  "libprotobuf-dev: TensorBoard's event files ([metrics] tensorboard), protobuf's C++ runtime"
  "protobuf-compiler: protoc, which generates the C++ of train/tensorboard_event.proto"
  "libisal-dev: ISA-L's CRC-32C, the checksums of TensorBoard's event records"
  "zlib1g-dev: loom tokenize's .gz inputs"
  "libzstd-dev: loom tokenize's .zst inputs"
  "libcairo2-dev: loom plot's figures (antialiased lines and text; PNG, SVG and PDF)"
)
test_pkgs=(
  "libgtest-dev: the unit tests (GoogleTest)"
  "python3-torch: the PyTorch parity tests and benchmarks"
  "python3-numpy: PyTorch's parity scripts"
  "libopenblas0-pthread: an optimized BLAS for PyTorch (Debian's default is the reference BLAS)"
  "clang: scripts/fuzz.sh (libFuzzer, ASan, UBSan)"
  "libclang-rt-14-dev: clang's sanitizer and fuzzer runtimes"
  "libomp-dev: OpenMP for the clang build of scripts/fuzz.sh"
  "iproute2: the multi-host drill's network namespaces and links (tests/drill/), ss for the Slurm drill's free ports"
  "nftables: the multi-host drill's cut links"
  "util-linux: unshare and setpriv for the drill and the permission tests"
  "python3-protobuf: tests/train/tensorboard.sh's independent decoder of the event files"
  "python3-crc32c: the same decoder's check of the event records' CRC-32C"
  "zstd: the tokenize tests make their .zst inputs with it"
  "slurmctld: tests/drill/slurm.sh runs a private one-node Slurm (Debian's 22.05): its controller"
  "slurmd: the same Slurm's node daemon (with slurm-wlm-basic-plugins: mpi_pmix, for srun --mpi=pmix)"
  "slurm-client: sbatch, srun, scontrol, squeue and sinfo, for the same test"
  "munge: the same Slurm's authentication (the test starts its own munged, with its own key)"
)
# Node (the tokenizer parity tests against the npm tokenizers) may come from NodeSource with npm
# bundled; only Debian's is installed when there is none.
command -v node > /dev/null ||
  test_pkgs+=("nodejs: the tokenizer parity tests (npm's reference tokenizers)" "npm: the same")
wanted=("${build_pkgs[@]}")
[ "$set_name" = deb ] && wanted+=("file: cpack's dependency step (dpkg-shlibdeps) inspects the binary with it")
[ "$set_name" = test ] && wanted+=("${test_pkgs[@]}")
missing=()
for entry in "${wanted[@]}"; do
  p=${entry%%:*}
  if ! dpkg-query -W -f='${Status}' "$p" 2> /dev/null | grep -q "install ok installed"; then
    missing+=("$p")
    echo "deps.sh: installing $entry"
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get update -q
  $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
