# Shared by the parity error scripts (cp_errors.sh, tp_errors.sh): `expect NP PATTERN ARGS...`
# (the run must fail and name PATTERN) and `works NP ARGS...` (the run must train). They read
# $loom, $work, the arrays mpi and common, and set status=1 on a failed check.
status=0
expect() {  # expect NP PATTERN ARGS...: the run fails and its output names PATTERN
  local np=$1 pat=$2
  shift 2
  local rc=0
  "${mpi[@]}" -np "$np" "$loom" train "${common[@]}" "$@" >"$work/out.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ] && grep -q -- "$pat" "$work/out.log"; then
    echo "ok: np $np $* -> $(grep -m1 -o -- "$pat.*" "$work/out.log" | cut -c1-150)"
  else
    echo "FAILED: np $np $* (exit $rc), expected an error naming '$pat':"
    tail -5 "$work/out.log"
    status=1
  fi
}
works() {
  local np=$1
  shift
  if "${mpi[@]}" -np "$np" "$loom" train "${common[@]}" "$@" >"$work/out.log" 2>&1; then
    echo "ok: np $np $* trains"
  else
    echo "FAILED: np $np $* should train:"
    tail -5 "$work/out.log"
    status=1
  fi
}
