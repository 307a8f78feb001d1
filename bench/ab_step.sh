#!/bin/bash
# Two loom binaries on the same `loom bench step` cases, alternating run by run, so that a shared
# host's slow and fast phases (single runs of one binary move by 10% within minutes here) meet
# both alike. Prints every run, then per case the median step time and MFU of each binary and
# their ratio. The binaries' own GEMM-peak measurement is in every run's MFU; compare step times.
#   bench/ab_step.sh OLD_LOOM NEW_LOOM [ROUNDS=4] [CASE...]
# A CASE is a bench config name and its extra flags in one word, commas for spaces, e.g.
# "small,--training.mixed_precision_param=bfloat16" (default: tiny and small, in bf16); "N:" in
# front runs it under `mpirun -np N` with one OpenMP thread per rank, e.g.
# "2:tiny,--parallelism.dp_shard=2" (rank 0's step time, peak and bytes per step).
# Each run's peak allocated MiB (rank 0) and bytes per step are printed too: a change that should
# not move memory or traffic shows the same figures on both sides.
# Each run takes the shared benchmark lock (/tmp/loom-bench.lock), as every benchmark here does.
# Build the old binary from a worktree: git worktree add /tmp/old REV && cmake -S /tmp/old -B
# /tmp/old/build -DCMAKE_BUILD_TYPE=Release && cmake --build /tmp/old/build --target loom.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -lt 2 ]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
old=$1 new=$2 rounds=${3:-4}
shift $(($# < 3 ? $# : 3))
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=("tiny,--training.mixed_precision_param=bfloat16"
  "small,--training.mixed_precision_param=bfloat16")
for b in "$old" "$new"; do
  [ -x "$b" ] || { echo "ab_step: $b is not an executable loom binary" >&2; exit 2; }
done
case $rounds in '' | *[!0-9]* | 0) echo "ab_step: ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2 ;; esac

results=$(mktemp)
trap 'rm -f "$results"' EXIT
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((r = 1; r <= rounds; ++r)); do
  for c in "${cases[@]}"; do
    np=1 spec=$c
    if [[ $spec =~ ^([0-9]+):(.*)$ ]]; then np=${BASH_REMATCH[1]} spec=${BASH_REMATCH[2]}; fi
    IFS=, read -r -a words <<< "$spec"
    config=$src/configs/bench-${words[0]}.toml
    [ -f "$config" ] || { echo "ab_step: no $config (case '$c')" >&2; exit 2; }
    for side in old new; do
      bin=$old
      [ $side = new ] && bin=$new
      run=("$bin")
      [ "$np" -gt 1 ] && run=(env OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive mpirun --oversubscribe
        --allow-run-as-root -np "$np" "$bin")
      out=$(flock /tmp/loom-bench.lock "${run[@]}" bench step --config "$config" "${words[@]:1}" \
        2>&1 < /dev/null) || {
        echo "$out" | tail -5 >&2
        echo "ab_step: $side binary failed on case '$c'" >&2
        exit 1
      }
      if [ "$np" -gt 1 ]; then
        # Rank 0's row: | peak expected ratio | bytes/step expected ok | step ms wait ms tokens/s
        read -r peak bytes ms < <(awk -F'|' '$1 ~ /^ *0 *$/ && NF == 4 {
          split($2, p, " "); split($3, b, " "); split($4, t, " "); print p[1], b[1], t[1]; exit }' <<< "$out")
        mfu=-
      else
        ms=$(awk '/step time \(median\)/ {print $4}' <<< "$out")
        mfu=$(awk '$1 == "MFU" {sub("%", "", $2); print $2}' <<< "$out")
        peak=$(awk '$1 == "peak" && $2 == "allocated" {print $3}' <<< "$out")
        bytes=0
      fi
      printf '%d %-4s %-60s %9s ms  MFU %s%%  peak %s MiB  %s bytes/step\n' "$r" "$side" "$c" \
        "$ms" "$mfu" "$peak" "$bytes"
      echo "$c $side $ms $mfu" >> "$results"
    done
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
printf '%-60s %12s %12s %8s %10s %10s\n' case "old ms" "new ms" new/old "old MFU" "new MFU"
for c in "${cases[@]}"; do
  awk -v c="$c" '
    function median(a, n,   i, j, t) {
      for (i = 1; i <= n; ++i) for (j = i + 1; j <= n; ++j) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
      return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    $1 == c && $2 == "old" { om[++no] = $3; of[no] = $4 }
    $1 == c && $2 == "new" { nm[++nn] = $3; nf[nn] = $4 }
    END {
      o = median(om, no); n = median(nm, nn)
      printf "%-60s %12.2f %12.2f %8.3f %9.1f%% %9.1f%%\n", c, o, n, n / o, median(of, no), median(nf, nn)
    }' "$results"
done
