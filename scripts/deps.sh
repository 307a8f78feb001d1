#!/usr/bin/env bash
# Installs the Debian packages loom builds and tests with (idempotent, non-interactive).
set -euo pipefail
pkgs=(build-essential cmake libdnnl-dev libtomlplusplus-dev nlohmann-json3-dev libgtest-dev
      libbenchmark-dev libpcre2-dev pkg-config python3-torch python3-numpy bible-kjv
      libopenblas0-pthread ocl-icd-opencl-dev libhwy-dev
      libopenmpi-dev openmpi-bin
      # loom tokenize's .gz and .zst inputs; zstd (the command) makes the tests' .zst files
      zlib1g-dev libzstd-dev zstd
      # scripts/fuzz.sh (libFuzzer, ASan, UBSan with clang's OpenMP) and the multi-host drill
      # (tests/drill/: network namespaces, veth, tc, nftables, unshare)
      clang libclang-rt-14-dev libomp-dev iproute2 nftables util-linux)
missing=()
# Node (for the tokenizer parity tests) may come from NodeSource with npm bundled; only install
# Debian's when there is none.
command -v node > /dev/null || pkgs+=(nodejs npm)
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  echo "installing: ${missing[*]}"
  $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get update -q
  $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
