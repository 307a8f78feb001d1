#!/usr/bin/env bash
# Builds the Debian package of loom (the CPU build: no CUDA backend, whose cuBLASLt is not a
# Debian package) in build-deb/ and prints its path. Install it with
#   apt-get install ./build-deb/loom_<version>_amd64.deb
# which pulls the libraries it links (found by dpkg-shlibdeps) and Open MPI's mpirun.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh deb
cmake -S . -B build-deb -DCMAKE_BUILD_TYPE=Release -DLOOM_TESTS=OFF -DLOOM_CUDA=OFF > /dev/null
cmake --build build-deb -j "$(nproc)" --target loom
(cd build-deb && cpack -G DEB > cpack.log 2>&1) || { cat build-deb/cpack.log; exit 1; }
deb=$(ls build-deb/loom_*.deb)
echo "deb.sh: $deb"
dpkg-deb --field "$deb" Package Version Depends
