#!/usr/bin/env bash
# Prepares a session on the lent GPU machine (scripts/device_check.sh runs there), on this Debian 12
# development machine: builds the CUDA binaries here and collects what travels with the working
# tree into the git-ignored .device/:
#   .device/bin/       the binaries of TARGETS, stripped
#   .device/debs/      the Debian 12 packages of the shared libraries they need (not glibc,
#                      libstdc++, libgcc, libgomp or CUDA: the GPU machine has its own) and Open
#                      MPI's runtime; device_check.sh unpacks them with `dpkg -x` into a private
#                      prefix there (that machine has none of loom's Debian dependencies and no
#                      network)
#   .device/manifest.txt  what was built from what, the packages and why each is there
#   .device/cuda-sonames.txt  the CUDA libraries the binaries need (device_check.sh looks for them)
# and prints the size of what travels (at most 64 MiB may; this fails above LIMIT_MIB).
#
# usage: scripts/device_prepare.sh [BUILD_DIR]     (default build-device; build/, the CPU build,
#        only with LOOM_DEVICE_SKIP_BUILD=1). Idempotent: reconfigures, rebuilds what changed,
#        downloads only the .debs that are missing and deletes those no longer needed.
# Environment: LOOM_DEVICE_TARGETS="loom ..." replaces TARGETS (e.g. while a target does not exist
#        yet); LOOM_DEVICE_SKIP_BUILD=1 collects from an existing BUILD_DIR without building.
# Needs network (apt-get download) but not root, once scripts/deps.sh has installed the build
# dependencies; run it as root on a fresh machine, as scripts/build.sh does.
set -euo pipefail

# The binaries the GPU checks run (CMake targets; each is BUILD_DIR/<target>).
TARGETS=(loom test_kernels_cuda test_ops_cuda test_model_cuda parity_compare)
# Open MPI's runtime: mpirun (openmpi-bin), the MCA components libmpi loads at run time
# (libopenmpi3) and its help texts and default parameters (openmpi-common). Their dependencies are
# resolved below.
MPI_ROOTS=(openmpi-bin libopenmpi3 openmpi-common)
LIMIT_MIB=60

# Packages never carried, by name. A dependency on one of these is taken as met there, and the
# resolution does not descend into it.
# (1) Present with the same sonames in a minimal Ubuntu 24.04 (its docker image: glibc 2.39, and
#     the t64-renamed libraries keep their sonames), or, for libgomp1 and libatomic1, in every image
#     with a compiler; carried copies would only shadow newer ones.
BASE_PKGS=(libc6 libc-bin libgcc-s1 libstdc++6 gcc-12-base libgomp1 libatomic1
           zlib1g libzstd1 liblzma5 libbz2-1.0 liblz4-1 libudev1 libuuid1 libblkid1 libmount1
           libselinux1 libpcre2-8-0 libacl1 libattr1 libaudit1 libaudit-common libcap-ng0 libcap2
           libcrypt1 libmd0 libtinfo6 libncursesw6 libpam0g libpam-modules libpam-modules-bin
           libpam-runtime libsemanage2 libsemanage-common libsepol2 libcom-err2 libdb5.3 libgmp10
           libffi8 libsystemd0 libgcrypt20 libgpg-error0 libseccomp2 libxxhash0)
# (2) Not needed at run time by loom's processes on one host:
#   - dpkg -x runs no maintainer scripts, so the tools they use are never called;
#   - openssh-client: mpirun's remote launcher; every rank runs on the one host (it would bring
#     OpenSSL, Kerberos and libfido2: 3.6 MiB);
#   - libhwloc-plugins: hwloc's optional discovery plugins (PCI, OpenCL, NVML, X11), loaded from a
#     fixed path that a relocated hwloc does not look in; hwloc works without them, and they would
#     bring X11, libxml2 and ICU (11 MiB).
UNNEEDED_PKGS=(debconf cdebconf adduser passwd dpkg install-info tar readline-common perl-base
               login coreutils openssh-client libhwloc-plugins)

cd "$(dirname "$0")/.."
build_dir=${1:-build-device}
dev=.device
# build/ is the CPU build (scripts/build.sh): never reconfigured here, only read from.
if [ "${build_dir%/}" = build ] && [ "${LOOM_DEVICE_SKIP_BUILD:-0}" != 1 ]; then
  echo "device_prepare: build/ is the CPU build; use another BUILD_DIR (or LOOM_DEVICE_SKIP_BUILD=1)" >&2
  exit 2
fi
if [ -n "${LOOM_DEVICE_TARGETS:-}" ]; then
  read -r -a TARGETS <<< "$LOOM_DEVICE_TARGETS"
fi

log() { echo "device_prepare: $*"; }
in_list() {  # in_list WORD LIST...: whether WORD is one of LIST
  local w=$1 x
  shift
  for x in "$@"; do [ "$x" = "$w" ] && return 0; done
  return 1
}

# ---- (a) configure and build -------------------------------------------------------------------
if [ "${LOOM_DEVICE_SKIP_BUILD:-0}" != 1 ]; then
  scripts/deps.sh
  # nvcc is usually not on a fresh PATH; CMake's check_language(CUDA) reads CUDACXX.
  if ! command -v nvcc > /dev/null && [ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
  fi
  log "configuring $build_dir (LOOM_CUDA=ON, Release)"
  mkdir -p "$build_dir"
  cmake -S . -B "$build_dir" -DLOOM_CUDA=ON -DCMAKE_BUILD_TYPE=Release > "$build_dir/configure.log" 2>&1 || {
    tail -n 40 "$build_dir/configure.log" >&2
    log "configure failed (the end of $build_dir/configure.log above)" >&2
    exit 1
  }
  # A target that is not defined yet fails here with its name rather than as make's "No rule".
  known=$(cmake --build "$build_dir" --target help 2>/dev/null | sed -n 's/^\.\.\. \([^ ]*\).*/\1/p' || true)
  if [ -n "$known" ]; then
    for t in "${TARGETS[@]}"; do
      if ! grep -qx -- "$t" <<< "$known"; then
        log "target '$t' is not defined in $build_dir (LOOM_DEVICE_TARGETS=\"...\" overrides the list)" >&2
        exit 1
      fi
    done
  fi
  # Two cores, and another build may be running beside this one.
  log "building ${TARGETS[*]}"
  cmake --build "$build_dir" -j 2 --target "${TARGETS[@]}"
fi

# ---- (b1) the binaries --------------------------------------------------------------------------
mkdir -p "$dev/bin" "$dev/debs"
# Only this run's binaries travel: a stale one would be tested as if it were current.
find "$dev/bin" -mindepth 1 -delete
bins=()
for t in "${TARGETS[@]}"; do
  src="$build_dir/$t"
  [ -x "$src" ] || { log "no binary $src" >&2; exit 1; }
  # Stripped (the host symbol tables, about 1 MiB a binary in Release, many more with -g): there is
  # no gdb there, and compute-sanitizer names the kernels from the device code's own symbols,
  # which strip leaves; only its host backtraces lose the names of non-exported functions.
  strip --strip-all -o "$dev/bin/$t" "$src"
  bins+=("$dev/bin/$t")
done

# ---- (b2) the packages of the shared libraries they need ----------------------------------------
# Never carried: glibc (its parts by soname, and whatever libc6 owns), the compiler's runtime, and
# CUDA's libraries (the GPU machine's own must serve: the driver matches them).
is_cuda_soname() {
  case "$1" in
    libcuda.so* | libcudart.so* | libcublas.so* | libcublasLt.so* | libcudnn*.so* | libnccl.so* | \
      libnvrtc*.so* | libnvJitLink.so* | libcufft*.so* | libcurand.so* | libcusparse*.so* | \
      libcusolver*.so* | libcupti.so* | libnvToolsExt.so* | libnvidia-*.so* | libnvperf*.so*)
      return 0 ;;
  esac
  return 1
}
is_runtime_soname() {
  case "$1" in
    linux-vdso.so.* | ld-linux*.so.* | libc.so.* | libm.so.* | libmvec.so.* | libpthread.so.* | \
      libdl.so.* | librt.so.* | libresolv.so.* | libutil.so.* | libanl.so.* | \
      libstdc++.so.* | libgcc_s.so.* | libgomp.so.*)
      return 0 ;;
  esac
  return 1
}
# The package that owns a library path. ldd prints the path the loader found, which on merged-/usr
# Debian 12 may be /lib/... for a file the package installed as /usr/lib/... (or the other way),
# or a symlink whose target is the packaged file.
owner_of() {
  local p=$1 cand c out
  # dpkg -S takes a pattern: anything but an absolute path would match by substring.
  [ "${p:0:1}" = / ] || return 1
  cand=("$p" "$(readlink -f "$p")")
  case "$p" in
    /usr/*) cand+=("${p#/usr}") ;;
    *) cand+=("/usr$p") ;;
  esac
  for c in "${cand[@]}"; do
    if out=$(dpkg -S "$c" 2>/dev/null); then
      # "pkg:arch: path" (or "pkg1, pkg2: path" for a shared directory; never for a library).
      echo "${out%%: *}" | sed 's/:.*//; s/,.*//'
      return 0
    fi
  done
  return 1
}

declare -A reason=()   # package -> why it travels
lib_pkgs=()
cuda_sonames=()
for b in "${bins[@]}"; do
  while read -r soname path; do
    if is_cuda_soname "$soname"; then
      in_list "$soname" "${cuda_sonames[@]}" || cuda_sonames+=("$soname")
      continue
    fi
    is_runtime_soname "$soname" && continue
    [ "$path" = "-" ] && continue  # the vDSO, and the loader (glibc's)
    if [ "$path" = "not" ]; then
      log "$b needs $soname, which is not found here" >&2
      exit 1
    fi
    pkg=$(owner_of "$path") || { log "$soname ($path, needed by $b) belongs to no Debian package" >&2; exit 1; }
    in_list "$pkg" libc6 libstdc++6 libgcc-s1 libgomp1 && continue
    if [ -z "${reason[$pkg]:-}" ]; then
      lib_pkgs+=("$pkg")
      reason[$pkg]="$soname (needed by ${b##*/})"
    fi
  done < <(ldd "$b" | awk '$2 == "=>" { print $1, $3; next } { n = $1; sub(/.*\//, "", n); print n, "-" }')
done

# The closure of the roots' Depends and Pre-Depends, pruned at BASE_PKGS and UNNEEDED_PKGS: for
# each dependency (a group of alternatives, virtual packages expanded to their providers) that no
# excluded package meets, its first real alternative. ldd already gave the libraries' closure;
# this adds what packages need besides libraries (openmpi-common's help texts and parameters) and
# what Open MPI loads at run time (its MCA components' libraries: UCX, libfabric, PSM, verbs...).
dep_groups() {  # one line per dependency group of $1: its alternatives
  apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
    --no-enhances "$1" | awk '
      function flush() { if (cur != "") print cur; cur = "" }
      /^ [ |](Pre)?Depends: / {
        if (!cont) flush()
        name = $2; sub(/:(any|amd64|i386|all)$/, "", name)
        cur = cur (cur == "" ? "" : " ") name
        cont = ($0 ~ /^ \|/); prov = (name ~ /^</); next }
      /^    [^ ]/ { if (prov) cur = cur " " $1; next }
      { prov = 0; if (!cont) flush() }
      END { flush() }'
}
excluded() { in_list "$1" "${BASE_PKGS[@]}" "${UNNEEDED_PKGS[@]}"; }

queue=("${MPI_ROOTS[@]}" "${lib_pkgs[@]}")
for r in "${MPI_ROOTS[@]}"; do
  [ -n "${reason[$r]:-}" ] || reason[$r]="Open MPI runtime (mpirun, MCA components, help texts)"
done
carried=()
while [ ${#queue[@]} -gt 0 ]; do
  pkg=${queue[0]}
  queue=("${queue[@]:1}")
  in_list "$pkg" "${carried[@]}" && continue
  carried+=("$pkg")
  while read -r -a alts; do
    met=0
    for a in "${alts[@]}"; do excluded "${a#<}" && met=1; done
    [ $met = 1 ] && continue
    pick=""
    for a in "${alts[@]}"; do
      case "$a" in "<"*) continue ;; esac
      pick=$a
      break
    done
    [ -n "$pick" ] || { log "no installable alternative among: ${alts[*]} (dependency of $pkg)" >&2; exit 1; }
    if ! in_list "$pick" "${carried[@]}" && ! in_list "$pick" "${queue[@]}"; then
      queue+=("$pick")
      [ -n "${reason[$pick]:-}" ] || reason[$pick]="dependency of $pkg"
    fi
  done < <(dep_groups "$pkg")
done

# Download what is missing: the version installed here (the binaries were built against it), else
# the candidate. apt-get download needs no root and writes NAME_VERSION_ARCH.deb, ':' as %3a.
wanted=()
for pkg in "${carried[@]}"; do
  ver=$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null || true)
  [ -n "$ver" ] || ver=$(apt-cache policy "$pkg" | awk '/Candidate:/ { print $2 }')
  if [ -z "$ver" ] || [ "$ver" = "(none)" ]; then
    log "no version of $pkg to download" >&2
    exit 1
  fi
  enc=${ver//:/%3a}
  have=$(find "$dev/debs" -maxdepth 1 -name "${pkg}_${enc}_*.deb" -print -quit)
  if [ -z "$have" ]; then
    log "downloading $pkg=$ver"
    # As root, apt hands the download to its sandbox user _apt, who may not write here.
    sandbox=()
    [ "$(id -u)" -eq 0 ] && sandbox=(-o APT::Sandbox::User=root)
    (cd "$dev/debs" && apt-get download -q "${sandbox[@]}" "$pkg=$ver" > /dev/null)
    have=$(find "$dev/debs" -maxdepth 1 -name "${pkg}_${enc}_*.deb" -print -quit)
    [ -n "$have" ] || { log "apt-get download $pkg=$ver wrote no ${pkg}_${enc}_*.deb" >&2; exit 1; }
  fi
  wanted+=("${have##*/}")
done
for f in "$dev"/debs/*.deb; do
  [ -e "$f" ] || continue
  in_list "${f##*/}" "${wanted[@]}" || { log "removing ${f##*/} (no longer needed)"; rm -f "$f"; }
done

# ---- (b3) check the closure: every ELF file the packages carry needs only sonames that the
# packages themselves, glibc and the compiler runtime, the BASE_PKGS or CUDA provide. A
# component that needs more would fail to load there (Open MPI then prints a warning and skips
# it); listed, not fatal.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for f in "$dev"/debs/*.deb; do dpkg -x "$f" "$tmp/root"; done
# A library counts by its file names and its SONAME: libpsm-infinipath1 ships only
# libpsm_infinipath.so.1.16 in a folder of its own (its soname link is an alternative that a
# maintainer script makes; device_check.sh makes it with ldconfig -n).
find "$tmp/root" \( -type f -o -type l \) -name 'lib*.so*' -printf '%f\n' > "$tmp/provided"
find "$tmp/root" -type f -name 'lib*.so*' -exec readelf -d {} + 2>/dev/null |
  sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p' >> "$tmp/provided"
for p in "${BASE_PKGS[@]}"; do
  dpkg -L "$p" 2>/dev/null | sed -n 's|.*/\(lib[^/]*\.so[^/]*\)$|\1|p'
done >> "$tmp/provided"
missing_report=""
while IFS= read -r -d '' f; do
  [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] || continue
  while read -r need; do
    is_runtime_soname "$need" || is_cuda_soname "$need" || grep -qxF -- "$need" "$tmp/provided" ||
      missing_report+="  ${f#"$tmp"/root} needs $need"$'\n'
  done < <(readelf -d "$f" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
done < <(find "$tmp/root" -type f -print0)
if [ -n "$missing_report" ]; then
  log "carried files that need a library nothing carried or listed as present provides:"
  printf '%s' "$missing_report"
fi

# ---- the step parity runs' corpus, tokenized here (the GPU machine has no bible-kjv) ------------------
rm -rf "$dev/parity-data"
# shellcheck source=tests/parity/setup.sh
source tests/parity/setup.sh
parity_corpus "$dev/parity-corpus.txt"
"$build_dir/loom" tokenize --input "$dev/parity-corpus.txt" --output "$dev/parity-data" \
  --train-vocab 512 --save-tokenizer "$dev/parity-tokenizer.json" > /dev/null
rm -f "$dev/parity-corpus.txt" "$dev/parity-tokenizer.json"

# ---- manifest ------------------------------------------------------------------------------------
printf '%s\n' "${cuda_sonames[@]}" > "$dev/cuda-sonames.txt"
{
  echo "prepared   $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname) ($(sed -n 's/^PRETTY_NAME="\(.*\)"/\1/p' /etc/os-release))"
  echo "commit     $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' + uncommitted changes')"
  echo "build      $build_dir, $(sed -n 's/^CMAKE_BUILD_TYPE:[^=]*=//p' "$build_dir/CMakeCache.txt" 2>/dev/null)," \
       "nvcc $(cat "$build_dir"/CMakeFiles/*/CMakeCUDACompiler.cmake 2>/dev/null |
         sed -n 's/^set(CMAKE_CUDA_COMPILER_VERSION "\(.*\)")/\1/p' | head -1)"
  echo "cuda libs  ${cuda_sonames[*]:-none}"
  echo "binaries"
  for b in "${bins[@]}"; do
    echo "  ${b##*/}  $(stat -c %s "$b") bytes  sha256 $(sha256sum "$b" | cut -c1-16)"
  done
  echo "packages (dpkg -x into the prefix by device_check.sh)"
  for pkg in "${carried[@]}"; do
    printf '  %-28s %-28s %s\n' "$pkg" "$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null ||
      apt-cache policy "$pkg" | awk '/Candidate:/ { print $2 }')" "${reason[$pkg]}"
  done
  if [ -n "$missing_report" ]; then
    echo "needed by carried files, provided by nothing carried"
    printf '%s' "$missing_report"
  fi
} > "$dev/manifest.txt"

# ---- (c) the size of what travels: the working tree git sees (tracked, and untracked files that
# are not ignored) plus .device.
# (a tracked file deleted in the tree makes stat fail: it does not travel, and does not count)
tree_bytes=$( { git ls-files -z --cached --others --exclude-standard |
  xargs -0 stat -c %s -- 2>/dev/null || true; } | awk '{ s += $1 } END { print s + 0 }')
dev_bytes=$(find "$dev" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
debs_bytes=$(find "$dev/debs" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
bin_bytes=$(find "$dev/bin" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
total=$((tree_bytes + dev_bytes))
echo
echo "carried: ${#carried[@]} packages, $(mib "$debs_bytes"); binaries ${TARGETS[*]}, $(mib "$bin_bytes") (see $dev/manifest.txt)"
echo "travels: working tree $(mib "$tree_bytes") + $dev $(mib "$dev_bytes") = $(mib "$total") (limit $LIMIT_MIB MiB; the tool takes 64)"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  log "over $LIMIT_MIB MiB: too much to travel" >&2
  exit 1
fi
