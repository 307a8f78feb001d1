# Sourced by the parity scripts: `parity_setup NAME FILE...` makes a scratch directory $work
# (removed on exit), sets single-threaded passive OpenMP for oversubscribed ranks, the mpirun
# command array `mpi` (needs $mpiexec), and tokenizes FILE... into $work/data with a 512-token
# vocabulary (needs $loom).
parity_setup() {
  local name=$1
  shift
  work=$(mktemp -d "${TMPDIR:-/tmp}/loom_${name}.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
  mpi=("$mpiexec" --oversubscribe --allow-run-as-root)
  cat "$@" >"$work/corpus.txt"
  "$loom" tokenize --input "$work/corpus.txt" --output "$work/data" --train-vocab 512 \
    --save-tokenizer "$work/tok.json" >/dev/null
}
