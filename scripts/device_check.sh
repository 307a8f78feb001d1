#!/usr/bin/env bash
# The checks of a session on the lent GPU machine, run there in the repository root:
#     bash scripts/device_check.sh "$OUT"        (with .device carried; scripts/device_prepare.sh
#                                                 made it on the development machine)
# That machine has the CUDA libraries, the driver, compute-sanitizer and PyTorch, but none of
# loom's Debian dependencies and no network: the binaries in .device/bin run against the Debian
# 12 packages of .device/debs, unpacked into a private prefix, and the machine's CUDA libraries.
#
# Steps, each under a time limit, none of them stopping the others (a failure is recorded and the
# run goes on): unpack, CUDA libraries, ldd, environment (OUTDIR/env.txt), `loom info`, mpirun,
# test_kernels_cuda, test_ops_cuda and test_model_cuda (LOOM_REQUIRE_GPU=1), the step parity runs,
# compute-sanitizer memcheck, benchmarks; then a summary
# table, printed last and written to OUTDIR/summary.txt. It never changes GPU settings.
# What comes back is at most 8 files of 16 MiB: summary.txt, env.txt, log.txt (every step's output
# but the kernel tests', the ops tests' and parity runs' included), loom-info.json,
# test_kernels_cuda.json, test_kernels_cuda.log, memcheck.log.
# Without a GPU (the development machine) it runs too, and reports the GPU steps failed or skipped.
set -uo pipefail

# ---- settings --------------------------------------------------------------------------------------
# The tests compute-sanitizer runs (--gtest_filter); memcheck slows kernels 10-100x, so narrow this
# when the whole suite does not fit MEMCHECK_S.
MEMCHECK_FILTER='*'
# Benchmarks, the last step: each a command line (no shell syntax); a leading `loom` is
# .device/bin/loom. `loom info` measures the bf16 GEMM peak and the device copy bandwidth; `loom
# bench attention` times the flash kernels at head dims 64 and 128, seq 2k-8k (PyTorch's SDPA
# beside it: bench/compare_attention_gpu.py, a call of its own).
BENCH=("loom info" "loom bench attention")
# The multi-process check of the carried Open MPI: two ranks, on the CPU (cheap, no GPU needed;
# keep it there: NCCL refuses two ranks on one GPU).
MPI_CHECK=(loom bench step --config configs/bench-tiny.toml --parallelism.dp_shard=2
           --bench.warmup_steps=1 --bench.steps=2)
# Time limits in seconds. BUDGET_S bounds the whole run (6 minutes are allowed; summary and
# slack need the rest): each step's limit is cut to what is left of it.
BUDGET_S=330
UNPACK_S=60 CUDALIB_S=30 LDD_S=30 ENV_S=20 INFO_S=60 MPI_S=60 TEST_S=90 OPS_S=60 PARITY_S=100
MEMCHECK_S=90 BENCH_S=60
# The step parity runs (tests/parity/gpu_step_parity.sh NAME TOLERANCE [overrides]): 20 steps on
# the GPU against the CPU, and checkpoints resumed across the two.
PARITY=("llama_f32 1e-5" "llama_bf16 1e-2 --training.mixed_precision_param=bfloat16"
        "gla_f32 1e-5 --model.config=tests/parity/gla_debug.json"
        "moe_f32 1e-5 --model.config=tests/parity/moe_debug.json")
PREFIX=/tmp/loom-prefix

if [ $# -ne 1 ]; then
  echo "usage: bash scripts/device_check.sh OUTDIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
# The files this run writes (the tool brings back 8 at most); a rerun overwrites them.
LOG=$OUT/log.txt ENV_TXT=$OUT/env.txt SUMMARY=$OUT/summary.txt
TEST_LOG=$OUT/test_kernels_cuda.log TEST_JSON=$OUT/test_kernels_cuda.json
MEMCHECK_LOG=$OUT/memcheck.log INFO_JSON=$OUT/loom-info.json
rm -f "$LOG" "$ENV_TXT" "$SUMMARY" "$TEST_LOG" "$TEST_JSON" "$MEMCHECK_LOG" "$INFO_JSON"
BIN=$ROOT/.device/bin
START=$SECONDS
# In case the copy lost the modes.
chmod +x "$BIN"/* 2> /dev/null

# ---- helpers ---------------------------------------------------------------------------------------
step_names=() step_status=() step_secs=() step_keys=()
record() {  # record NAME STATUS SECONDS KEY
  local key=$4
  [ "$2" = TIMEOUT ] && key="stopped at its time limit; $key"
  step_names+=("$1") step_status+=("$2") step_secs+=("$3") step_keys+=("$key")
  printf 'device_check: %-12s %-10s %4ss  %s\n' "$1" "$2" "$3" "$key"
}
# The limit of a step: its own, cut to what is left of the budget (0: no time left).
limit() {
  local left=$((BUDGET_S - (SECONDS - START) - 5))
  if [ "$left" -lt 5 ]; then echo 0; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
# The status of a command from its exit code (timeout's: 124, or 137 after the KILL).
status_of() {
  case "$1" in
    0) echo ok ;;
    124 | 137) echo TIMEOUT ;;
    *) echo "FAIL($1)" ;;
  esac
}
section() { printf '\n==== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)" >> "$LOG"; }
first_line() { head -n 1 | cut -c1-70; }

# loom's processes, and only they, see the carried libraries: LD_LIBRARY_PATH with the prefix's
# library folders and the CUDA folders found below, ahead of whatever the image had (its driver
# folder may be there). Never exported: the image's python/torch and tools must not load the
# older carried libraries. The image's own MPI settings (an NGC image sets OPAL_PREFIX and
# OMPI_MCA_* for HPC-X) would steer the carried Open MPI wrong: dropped for these processes.
PREFIX_LIB_DIRS=("$PREFIX/usr/lib/x86_64-linux-gnu" "$PREFIX/lib/x86_64-linux-gnu"
                 "$PREFIX/usr/lib/libpsm1")
CUDA_DIRS=()
loom_ld_path() {
  local p="" d
  for d in "${PREFIX_LIB_DIRS[@]}" "${CUDA_DIRS[@]}"; do [ -d "$d" ] && p+="${p:+:}$d"; done
  echo "$p${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
loom_env() {
  local unset=() v
  for v in $(compgen -e | grep -E '^(OMPI_MCA_|PMIX_MCA_|OPAL_|PMIX_PREFIX|PMIX_INSTALL_PREFIX)'); do
    unset+=(-u "$v")
  done
  # Open MPI relocated: OPAL_PREFIX moves what it installed under /usr (components, help texts,
  # orted); its parameter file (Debian's choices: no UCX or OFI) and default hostfile live in
  # /etc, which OPAL_PREFIX does not move. PMIx (a library of its own) looks for its components
  # where Debian put them unless told (else mpirun warns that its help text is missing); the
  # silence is for what is left of that warning.
  env "${unset[@]}" LD_LIBRARY_PATH="$(loom_ld_path)" \
    OPAL_PREFIX="$PREFIX/usr" \
    OMPI_MCA_mca_base_param_files="$PREFIX/etc/openmpi/openmpi-mca-params.conf" \
    OMPI_MCA_orte_default_hostfile="$PREFIX/etc/openmpi/openmpi-default-hostfile" \
    PMIX_MCA_mca_base_component_path="$PREFIX/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix" \
    PMIX_MCA_pcompress_base_silence_warning=1 \
    LOOM_SOURCE_DIR="$ROOT" LOOM_BIN="$BIN/loom" "$@"
}

{
  echo "device_check $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(cat /proc/sys/kernel/hostname), in $ROOT"
  echo "the manifest of what travelled (.device/manifest.txt):"
  sed 's/^/  /' .device/manifest.txt 2>/dev/null || echo "  none: run scripts/device_prepare.sh and carry .device"
} > "$LOG"

# ---- (a) unpack the carried packages into the prefix -----------------------------------------------
unpack_step() {
  local t0=$SECONDS n=0 bad=0 f lim
  section "unpack .device/debs into $PREFIX"
  # dpkg -x never runs maintainer scripts; it writes only under the prefix, never into /.
  case "$PREFIX" in /tmp/?*) ;; *) record unpack FAIL 0 "refusing PREFIX=$PREFIX (not under /tmp)"; return ;; esac
  rm -rf "$PREFIX" && mkdir -p "$PREFIX"
  for f in .device/debs/*.deb; do
    [ -e "$f" ] || continue
    lim=$(limit "$UNPACK_S")
    [ "$lim" -gt 0 ] || { bad=$((bad + 1)); break; }
    if timeout -k 5 "$lim" dpkg -x "$f" "$PREFIX" >> "$LOG" 2>&1; then
      n=$((n + 1))
    else
      bad=$((bad + 1))
      echo "dpkg -x $f failed" >> "$LOG"
    fi
  done
  # The soname link of libpsm_infinipath is an alternative that a maintainer script makes:
  # ldconfig -n makes the links in that one folder, and touches no cache.
  [ -d "$PREFIX/usr/lib/libpsm1" ] && ldconfig -n "$PREFIX/usr/lib/libpsm1" >> "$LOG" 2>&1
  local size
  size=$(du -sm "$PREFIX" 2>/dev/null | cut -f1)
  echo "$n packages unpacked, $bad failed, ${size:-?} MiB" >> "$LOG"
  if [ "$n" -eq 0 ]; then
    record unpack FAIL $((SECONDS - t0)) "no .device/debs/*.deb (run scripts/device_prepare.sh, carry .device)"
  elif [ "$bad" -gt 0 ]; then
    record unpack FAIL $((SECONDS - t0)) "$n unpacked, $bad failed"
  else
    record unpack ok $((SECONDS - t0)) "$n packages, ${size:-?} MiB in $PREFIX"
  fi
}

# ---- (b) the CUDA libraries the binaries need ------------------------------------------------------
# cuBLASLt now, cuDNN and NCCL later (.device/cuda-sonames.txt: what ldd found on the development
# machine). In the toolkit's folders first (what loom was compiled against, one release), then
# PyTorch's wheels (site-packages/nvidia/*/lib, e.g. nvidia/cu13/lib), then the system's.
CUDA_FOUND=()     # "soname path" of each found
CUDA_VERSIONS=()  # "soname version (where)" of each found
cudalib_step() {
  local t0=$SECONDS lim sps=() sp d s found missing=() key="" wanted=() cands=()
  section "CUDA libraries"
  lim=$(limit "$CUDALIB_S")
  if [ "$lim" -gt 0 ] && command -v python3 > /dev/null; then
    mapfile -t sps < <(timeout -k 5 "$lim" python3 -c '
import site, sysconfig
paths = site.getsitepackages() + [site.getusersitepackages()]
paths += [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
try:  # where the nvidia-* wheels are, without importing torch
    import nvidia
    paths += [p[: -len("/nvidia")] for p in nvidia.__path__ if p.endswith("/nvidia")]
except Exception:
    pass
print("\n".join(dict.fromkeys(paths)))' 2>> "$LOG")
  fi
  echo "python3 site-packages: ${sps[*]:-none}" >> "$LOG"
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib /usr/local/cuda-*/lib64 \
           /usr/local/cuda-*/targets/*/lib; do
    [ -d "$d" ] && cands+=("$d")
  done
  for sp in "${sps[@]}"; do
    for d in "$sp"/nvidia/*/lib "$sp"/nvidia/*/lib64; do [ -d "$d" ] && cands+=("$d"); done
  done
  mapfile -t wanted < <(cat .device/cuda-sonames.txt 2>/dev/null; printf '%s\n' libcublasLt.so.13 libcudnn.so.9 libnccl.so.2)
  mapfile -t wanted < <(printf '%s\n' "${wanted[@]}" | awk 'NF && !seen[$0]++')
  for s in "${wanted[@]}"; do
    found=""
    for d in "${cands[@]}"; do
      if [ -e "$d/$s" ]; then found="$d/$s"; break; fi
    done
    if [ -n "$found" ]; then
      case " ${CUDA_DIRS[*]} " in *" ${found%/*} "*) ;; *) CUDA_DIRS+=("${found%/*}") ;; esac
    else
      # The system's (an apt-installed cuDNN or NCCL): the loader finds it without help.
      found=$(ldconfig -p 2>/dev/null | awk -v s="$s" '$1 == s { print $NF; exit }')
    fi
    if [ -n "$found" ]; then
      CUDA_FOUND+=("$s $found")
      echo "$s: $found -> $(readlink -f "$found")" >> "$LOG"
    else
      echo "$s: not found" >> "$LOG"
      grep -qxF "$s" .device/cuda-sonames.txt 2>/dev/null && missing+=("$s")
    fi
  done
  echo "CUDA folders for loom's processes: ${CUDA_DIRS[*]:-none}" >> "$LOG"
  # Their versions: the wheels' and the toolkit's file names carry none, so each library is asked
  # (loaded alone into a python3 of its own; its GetVersion needs no GPU).
  lim=$(limit "$CUDALIB_S")
  if [ ${#CUDA_FOUND[@]} -gt 0 ] && [ "$lim" -gt 0 ] && command -v python3 > /dev/null; then
    mapfile -t CUDA_VERSIONS < <(timeout -k 5 "$lim" python3 -c '
import ctypes, sys
calls = {"libcublasLt": "cublasLtGetVersion", "libcudnn": "cudnnGetVersion", "libnccl": "ncclGetVersion"}
for arg in sys.argv[1:]:
    soname, path = arg.split(" ", 1)
    where = ("pip" if "-packages/" in path else "toolkit" if path.startswith("/usr/local/cuda")
             else "system")
    v = "?"
    try:
        lib, fn = ctypes.CDLL(path), calls.get(soname.split(".")[0])
        if fn == "ncclGetVersion":
            n = ctypes.c_int()
            getattr(lib, fn)(ctypes.byref(n))
            n = n.value
        elif fn:
            f = getattr(lib, fn)
            f.restype = ctypes.c_size_t
            n = f()
        if fn:
            v = "%d.%d.%d" % (n // 10000, n % 10000 // 100, n % 100)
    except Exception as e:
        v = "? (%s)" % e
    print("%s %s (%s)" % (soname, v, where))' "${CUDA_FOUND[@]}" 2>> "$LOG")
  fi
  [ ${#CUDA_VERSIONS[@]} -eq 0 ] || printf '%s\n' "${CUDA_VERSIONS[@]}" >> "$LOG"
  for s in "${CUDA_VERSIONS[@]}"; do key+="${key:+, }$s"; done
  if [ ${#missing[@]} -gt 0 ]; then
    record cuda-libs FAIL $((SECONDS - t0)) "needed, not found: ${missing[*]}"
  else
    record cuda-libs ok $((SECONDS - t0)) "${key:-none found (none needed)}"
  fi
}

# ---- (c) ldd of each binary under loom_env -----------------------------------------------------------
ldd_step() {
  local t0=$SECONDS b out lim nf=0 np=0 nc=0 ns=0 other=() line lib path d
  section "ldd under loom_env (LD_LIBRARY_PATH=$(loom_ld_path))"
  for b in "$BIN"/*; do
    [ -f "$b" ] || continue
    lim=$(limit "$LDD_S")
    [ "$lim" -gt 0 ] || break
    out=$(loom_env timeout -k 5 "$lim" ldd "$b" 2>&1)
    printf -- '-- %s\n%s\n' "${b##*/}" "$out" >> "$LOG"
    while read -r line; do
      case "$line" in
        *"not found"*) nf=$((nf + 1)); other+=("${line%% *}:NOT-FOUND") ;;
        *" => /"*)
          lib=${line%% *} path=${line#* => } path=${path%% (*}
          case "$path" in
            "$PREFIX"/*) np=$((np + 1)) ;;
            *)
              local is_cuda=0
              for d in "${CUDA_DIRS[@]}"; do [ "${path%/*}" = "$d" ] && is_cuda=1; done
              case "$lib" in libcuda.so* | libcublas* | libcudnn* | libnccl* | libnvrtc* | libnvJitLink*) is_cuda=1 ;; esac
              if [ $is_cuda = 1 ]; then
                nc=$((nc + 1))
              else
                ns=$((ns + 1))
                # From the image: only glibc and the compiler's runtime are meant to be.
                case "$lib" in
                  libc.so.* | libm.so.* | libmvec.so.* | libpthread.so.* | libdl.so.* | librt.so.* | \
                    libstdc++.so.* | libgcc_s.so.* | libgomp.so.*) ;;
                  *) other+=("$lib:$path") ;;
                esac
              fi ;;
          esac ;;
      esac
    done <<< "$out"
  done
  if [ ${#other[@]} -gt 0 ]; then
    echo "not found, or from the image though not glibc/libstdc++/libgcc/libgomp: ${other[*]}" >> "$LOG"
  fi
  local key="$np from prefix, $nc CUDA, $ns image"
  if [ "$np$nc$ns" = 000 ] && [ "$nf" -eq 0 ]; then
    record ldd FAIL $((SECONDS - t0)) "no binaries in .device/bin"
  elif [ "$nf" -gt 0 ]; then
    record ldd FAIL $((SECONDS - t0)) "$nf not found: $(printf '%s ' "${other[@]}" | tr ' ' '\n' | grep NOT-FOUND | sed 's/:NOT-FOUND//' | sort -u | tr '\n' ' ')"
  elif [ ${#other[@]} -gt 0 ]; then
    record ldd ok $((SECONDS - t0)) "$key; from the image: ${other[*]%%:*}"
  else
    record ldd ok $((SECONDS - t0)) "$key; 0 not found"
  fi
}

# ---- (d) the environment into env.txt --------------------------------------------------------------------
# run_env TITLE CMD...: one command's output (or why there is none) under a header.
run_env() {
  local title=$1 lim rc
  shift
  printf '\n## %s\n' "$title" >> "$ENV_TXT"
  if ! command -v "$1" > /dev/null 2>&1; then
    echo "(no $1)" >> "$ENV_TXT"
    return 127
  fi
  lim=$(limit "$ENV_S")
  [ "$lim" -gt 0 ] || { echo "(no time left)" >> "$ENV_TXT"; return 124; }
  timeout -k 5 "$lim" "$@" >> "$ENV_TXT" 2>&1
  rc=$?
  [ $rc -eq 0 ] || echo "(exit $rc)" >> "$ENV_TXT"
  return $rc
}
NVCC="" SANITIZER="" GPU_LINE=""
find_tool() {  # the first of PATH's and the toolkits' copies of $1
  local c
  c=$(command -v "$1" 2>/dev/null) && { echo "$c"; return; }
  for c in /usr/local/cuda/bin/"$1" /usr/local/cuda-*/bin/"$1" /usr/local/cuda*/"$1"/"$1"; do
    [ -x "$c" ] && { echo "$c"; return; }
  done
}
env_step() {
  local t0=$SECONDS e
  section "environment (env.txt)"
  NVCC=$(find_tool nvcc) SANITIZER=$(find_tool compute-sanitizer)
  {
    echo "# device_check environment, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "date: $(date)"
    echo "host: $(cat /proc/sys/kernel/hostname), $(nproc) cores, uname -r $(uname -r)"
    echo "memory: $(free -g 2>/dev/null | awk '/^Mem:/ { print $2 " GiB, " $7 " GiB available" }')"
    echo "user: $(id -un 2>/dev/null || id -u)"
  } > "$ENV_TXT"
  run_env "/etc/os-release" cat /etc/os-release
  run_env "nvidia-smi" nvidia-smi
  run_env "nvidia-smi --query-gpu" nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv &&
    GPU_LINE=$(timeout -k 5 15 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
      --format=csv,noheader 2>/dev/null | head -n 1)
  if [ -n "$NVCC" ]; then run_env "nvcc --version ($NVCC)" "$NVCC" --version; else run_env "nvcc --version" nvcc --version; fi
  run_env "g++ --version" g++ --version
  printf '\n## CUDA libraries (for loom: LD_LIBRARY_PATH=%s)\n' "$(loom_ld_path)" >> "$ENV_TXT"
  for e in "${CUDA_FOUND[@]}"; do
    echo "${e%% *}: ${e#* } -> $(readlink -f "${e#* }")" >> "$ENV_TXT"
  done
  [ ${#CUDA_VERSIONS[@]} -eq 0 ] || printf 'version: %s\n' "${CUDA_VERSIONS[@]}" >> "$ENV_TXT"
  echo "libcuda.so.1 (driver): $(ldconfig -p 2>/dev/null | awk '$1 == "libcuda.so.1" { print $NF; exit }')" >> "$ENV_TXT"
  run_env "python3: torch" python3 -c '
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())
print("cuda available:", torch.cuda.is_available(),
      "NCCL", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")'
  run_env "python3 -m pip list (nvidia, torch, triton)" sh -c 'python3 -m pip list 2>/dev/null | grep -iE "^(nvidia|torch|triton)"'
  if [ -n "$SANITIZER" ]; then run_env "compute-sanitizer --version ($SANITIZER)" "$SANITIZER" --version
  else run_env "compute-sanitizer --version" compute-sanitizer --version; fi
  {
    printf '\n## environment variables (GPU, MPI, libraries)\n'
    env | grep -E '^(CUDA|NVIDIA|NCCL|LD_LIBRARY_PATH|PATH=|OMPI|OPAL|PMIX|UCX|HPCX|OMP_)' | sort
    printf '\n## .device/manifest.txt\n'
    cat .device/manifest.txt 2>&1
  } >> "$ENV_TXT"
  record env ok $((SECONDS - t0)) "${GPU_LINE:-no GPU (nvidia-smi: $(command -v nvidia-smi > /dev/null && echo failed || echo none))}"
}

# ---- (e) loom info -----------------------------------------------------------------------------------------
info_step() {
  local t0=$SECONDS lim rc rc2 out key
  section "loom info"
  [ -x "$BIN/loom" ] || { record "loom info" MISSING 0 "no .device/bin/loom"; return; }
  lim=$(limit "$INFO_S")
  [ "$lim" -gt 0 ] || { record "loom info" SKIP 0 "no time left"; return; }
  out=$(loom_env timeout -k 5 "$lim" "$BIN/loom" info 2>&1)
  rc=$?
  echo "$out" >> "$LOG"
  lim=$(limit "$INFO_S")
  if [ "$lim" -gt 0 ]; then
    loom_env timeout -k 5 "$lim" "$BIN/loom" info --json > "$INFO_JSON" 2>> "$LOG"
    rc2=$?
  else
    rc2=124
  fi
  # Its GPU: the first GPU's line, or why there is none.
  key=$(grep -E '^  gpu  ' <<< "$out" | sed 's/^  gpu  *//' | first_line)
  [ -n "$key" ] || key=$(grep -m1 'gpu' <<< "$out" | sed 's/^ *//' | first_line)
  [ -n "$key" ] || key=$(first_line <<< "$out")  # a loom without the GPU lines: its version
  [ $rc -ne 0 ] && key="$(tail -n 1 <<< "$out" | first_line)"
  [ $rc -eq 0 ] && [ $rc2 -ne 0 ] && rc=$rc2 && key="--json: exit $rc2"
  record "loom info" "$(status_of $rc)" $((SECONDS - t0)) "${key:-?}"
}

# ---- mpirun: two ranks of loom under the carried Open MPI ------------------------------------------------
mpi_step() {
  local t0=$SECONDS lim rc out mpirun=$PREFIX/usr/bin/mpirun.openmpi root=() argv=("${MPI_CHECK[@]}")
  section "mpirun -np 2 ${MPI_CHECK[*]}"
  [ -x "$mpirun" ] || { record mpirun MISSING 0 "no $mpirun (Open MPI not unpacked)"; return; }
  [ -x "$BIN/loom" ] || { record mpirun MISSING 0 "no .device/bin/loom"; return; }
  lim=$(limit "$MPI_S")
  [ "$lim" -gt 0 ] || { record mpirun SKIP 0 "no time left"; return; }
  [ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
  [ "${argv[0]}" = loom ] && argv[0]=$BIN/loom
  # The ranks share the cores with nothing else: a few OpenMP threads each.
  out=$(loom_env OMP_NUM_THREADS=4 OMP_WAIT_POLICY=passive timeout -k 5 "$lim" \
    "$mpirun" "${root[@]}" --oversubscribe -np 2 "${argv[@]}" 2>&1)
  rc=$?
  echo "$out" >> "$LOG"
  local key
  key=$(grep -m1 -E '^ *job tokens/s' <<< "$out" | sed 's/^ *//' | first_line)
  [ $rc -ne 0 ] && key=$(grep -v '^ *$' <<< "$out" | tail -n 1 | first_line)
  record mpirun "$(status_of $rc)" $((SECONDS - t0)) "${key:-no output}"
}

# ---- (f) test_kernels_cuda ----------------------------------------------------------------------------------
# gtest's counts from its log: "P passed, F failed, S skipped of N (T ms)".
gtest_counts() {
  awk '/^\[==========\] [0-9]+ tests? from .* ran\./ { ran = $2; ms = $(NF-2); sub(/\(/, "", ms) }
       /^\[  PASSED  \] [0-9]+/ { p = $4 }
       /^\[  SKIPPED \] [0-9]+/ { s = $4 }
       /^\[  FAILED  \] [0-9]+ tests?, listed below/ { f = $4 }
       END { if (ran == "") exit 1
             if (f == "") f = ran - p - s  # --gtest_brief prints no list of the failed
             printf "%d passed, %d failed, %d skipped of %d (%s ms)", p, f, s, ran, ms }' "$1"
}
HAVE_GPU=0
test_step() {
  local t0=$SECONDS lim rc key
  [ -x "$BIN/test_kernels_cuda" ] || { record tests MISSING 0 "no .device/bin/test_kernels_cuda"; return; }
  lim=$(limit "$TEST_S")
  [ "$lim" -gt 0 ] || { record tests SKIP 0 "no time left"; return; }
  loom_env LOOM_REQUIRE_GPU=1 OMP_WAIT_POLICY=passive timeout -k 5 "$lim" \
    "$BIN/test_kernels_cuda" --gtest_output="json:$TEST_JSON" > "$TEST_LOG" 2>&1
  rc=$?
  key=$(gtest_counts "$TEST_LOG") || key=$(grep -v '^ *$' "$TEST_LOG" | tail -n 1 | first_line)
  [ $HAVE_GPU = 1 ] || key="no GPU; $key"
  record tests "$(status_of $rc)" $((SECONDS - t0)) "$key"
}

# ---- the ops on cuda tensors against the cpu ones (test_ops_cuda) and generation on the GPU against
# the CPU (test_model_cuda), into log.txt -----------------------------------------------------------------
ops_test_step() {  # ops_test_step BINARY NAME
  local t0=$SECONDS lim rc key tmp bin=$1 name=$2
  [ -x "$BIN/$bin" ] || { record "$name" MISSING 0 "no .device/bin/$bin"; return; }
  lim=$(limit "$OPS_S")
  [ "$lim" -gt 0 ] || { record "$name" SKIP 0 "no time left"; return; }
  section "$bin"
  tmp=$(mktemp)
  loom_env LOOM_REQUIRE_GPU=1 OMP_WAIT_POLICY=passive timeout -k 5 "$lim" \
    "$BIN/$bin" > "$tmp" 2>&1
  rc=$?
  cat "$tmp" >> "$LOG"
  key=$(gtest_counts "$tmp") || key=$(grep -v '^ *$' "$tmp" | tail -n 1 | first_line)
  rm -f "$tmp"
  record "$name" "$(status_of $rc)" $((SECONDS - t0)) "$key"
}

# ---- step parity: training on the GPU against the CPU (tests/parity/gpu_step_parity.sh) ------------
parity_step() {
  local t0 lim rc key tmp run argv
  for run in "${PARITY[@]}"; do
    t0=$SECONDS
    read -r -a argv <<< "$run"
    [ -x "$BIN/parity_compare" ] || { record parity MISSING 0 "no .device/bin/parity_compare"; return; }
    [ $HAVE_GPU = 1 ] || { record parity SKIP 0 "${argv[0]}: no GPU"; continue; }
    lim=$(limit "$PARITY_S")
    [ "$lim" -gt 0 ] || { record parity SKIP 0 "${argv[0]}: no time left"; continue; }
    section "parity ${run}"
    tmp=$(mktemp)
    loom_env LOOM_REQUIRE_GPU=1 LOOM_PARITY_DATA="$ROOT/.device/parity-data" OMP_NUM_THREADS=8 \
      timeout -k 5 "$lim" bash tests/parity/gpu_step_parity.sh "$BIN/loom" "$BIN/parity_compare" \
      "$ROOT" "${argv[@]}" > "$tmp" 2>&1
    rc=$?
    cat "$tmp" >> "$LOG"
    # parity_compare's verdict line, or the last line of a failure.
    key=$(grep -m1 'steps: worst loss' "$tmp" | sed 's/relative difference/rel/g' | cut -c1-100)
    [ -n "$key" ] && [ $rc -eq 0 ] || key=$(grep -v '^ *$' "$tmp" | tail -n 1 | first_line)
    rm -f "$tmp"
    record parity "$(status_of $rc)" $((SECONDS - t0)) "${argv[0]}: $key"
  done
}

# ---- (g) compute-sanitizer memcheck on test_kernels_cuda ------------------------------------------------------
memcheck_step() {
  local t0=$SECONDS lim rc key errs
  [ -x "$BIN/test_kernels_cuda" ] || { record memcheck MISSING 0 "no .device/bin/test_kernels_cuda"; return; }
  [ -n "$SANITIZER" ] || { record memcheck SKIP 0 "no compute-sanitizer"; return; }
  [ $HAVE_GPU = 1 ] || { record memcheck SKIP 0 "no GPU"; return; }
  lim=$(limit "$MEMCHECK_S")
  [ "$lim" -gt 0 ] || { record memcheck SKIP 0 "no time left"; return; }
  # --error-exitcode tells its findings from the tests' own failures; --gtest_brief keeps the log
  # to the failures.
  loom_env LOOM_REQUIRE_GPU=1 OMP_WAIT_POLICY=passive timeout -k 10 "$lim" \
    "$SANITIZER" --tool memcheck --error-exitcode 99 --print-limit 50 --target-processes all \
    "$BIN/test_kernels_cuda" --gtest_filter="$MEMCHECK_FILTER" --gtest_brief=1 > "$MEMCHECK_LOG" 2>&1
  rc=$?
  errs=$(grep -m1 -o 'ERROR SUMMARY: [0-9]* errors\?' "$MEMCHECK_LOG")
  key="${errs:-no ERROR SUMMARY}; $(gtest_counts "$MEMCHECK_LOG" || echo "tests did not finish")"
  case $rc in
    99) record memcheck "FAIL(errors)" $((SECONDS - t0)) "$key" ;;
    *) record memcheck "$(status_of $rc)" $((SECONDS - t0)) "filter '$MEMCHECK_FILTER': $key" ;;
  esac
}

# ---- (h) benchmarks --------------------------------------------------------------------------------------------
bench_step() {
  local t0 lim rc out key cmd argv
  for cmd in "${BENCH[@]}"; do
    t0=$SECONDS
    read -r -a argv <<< "$cmd"
    [ "${argv[0]}" = loom ] && argv[0]=$BIN/loom
    section "bench: $cmd"
    [ -x "${argv[0]}" ] || command -v "${argv[0]}" > /dev/null || { record "bench" MISSING 0 "$cmd: no ${argv[0]}"; continue; }
    lim=$(limit "$BENCH_S")
    [ "$lim" -gt 0 ] || { record "bench" SKIP 0 "$cmd: no time left"; continue; }
    out=$(loom_env timeout -k 5 "$lim" "${argv[@]}" 2>&1)
    rc=$?
    echo "$out" >> "$LOG"
    # The figures: the GPU's measured ceilings, else the CPU GEMM peak.
    key=$(grep -m1 'gpu peak' <<< "$out" | sed 's/^ *gpu peak *//; s/ (measured.*//; s/ read + write//')
    # bench attention: its last row (D 128, T 8192: forward and backward ms and TFLOP/s).
    [[ $cmd == *"bench attention"* ]] && key=$(grep -v '^ *$' <<< "$out" | tail -n 1 | tr -s ' ')
    [ -n "$key" ] || key="cpu $(grep -m1 'GEMM peak' <<< "$out" | sed 's/^ *GEMM peak *//; s/ (measured)//')"
    [ $rc -ne 0 ] && key=$(grep -v '^ *$' <<< "$out" | tail -n 1)
    record "bench" "$(status_of $rc)" $((SECONDS - t0)) "$cmd: $key"
  done
}

# ---- run ----------------------------------------------------------------------------------------------------------
unpack_step
cudalib_step
ldd_step
env_step
# A GPU that the driver lists; without one, the GPU steps report and skip.
if command -v nvidia-smi > /dev/null && timeout 15 nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  HAVE_GPU=1
fi
info_step
mpi_step
test_step
ops_test_step test_ops_cuda ops-tests
ops_test_step test_model_cuda model-tests
parity_step
memcheck_step
bench_step

# ---- (i) the summary: what comes back must stay within 8 files of 16 MiB --------------------------------------
cap() {  # keeps the head and the tail of a file over 15 MiB
  local f=$1 max=$((15 * 1048576))
  if [ ! -f "$f" ] || [ "$(stat -c %s "$f")" -le $max ]; then return 0; fi
  { head -c $((8 * 1048576)) "$f"; printf '\n[... cut by device_check: over 15 MiB ...]\n'; tail -c $((6 * 1048576)) "$f"; } > "$f.cut"
  mv "$f.cut" "$f"
}
for f in "$LOG" "$ENV_TXT" "$TEST_LOG" "$TEST_JSON" "$MEMCHECK_LOG" "$INFO_JSON"; do cap "$f"; done
{
  echo "device_check summary, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $((SECONDS - START)) s in all"
  echo "gpu: ${GPU_LINE:-none}; built from $(sed -n 's/^commit *//p' .device/manifest.txt 2>/dev/null | sed -E 's/^([0-9a-f]{12})[0-9a-f]*/\1/')"
  printf '%-10s %-12s %5s  %s\n' step status sec "key figure"
  for i in "${!step_names[@]}"; do
    printf '%-10s %-12s %5s  %s\n' "${step_names[$i]}" "${step_status[$i]}" "${step_secs[$i]}" \
      "$(printf '%s' "${step_keys[$i]}" | cut -c1-110)"
  done
  # (this file, made by the redirection, included)
  n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
  [ "$n" -le 8 ] || echo "warning: $n files in $OUT; only 8 come back"
} > "$SUMMARY"
echo
cat "$SUMMARY"
