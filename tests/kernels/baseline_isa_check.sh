#!/usr/bin/env bash
# The portable part of a binary never uses AVX: only code in Highway's per-target namespaces
# (N_AVX2::, N_AVX3::; reached through the run-time dispatch of kernels/cpu/cpu_isa.hpp) may.
# Disassembles BINARY and fails naming each other function that uses an AVX/AVX-512 register
# (ymm, zmm, k0-k7), a VEX/EVEX-encoded instruction (v-prefixed: vmovups, vfmadd..., vzeroupper,
# also on xmm) or a BMI1/BMI2 instruction: any of these would die of SIGILL on an x86-64 CPU
# without them. The usual culprit is an inline function or template instantiated inside a
# per-target region (HWY_BEFORE_NAMESPACE) but outside its namespace: the linker keeps one copy,
# possibly the AVX one, for every caller (an ODR violation).
#
# Usage: baseline_isa_check.sh BINARY [ALLOW_REGEX]
#   ALLOW_REGEX: demangled names that may use AVX besides the per-target namespaces (code that
#   checks the CPU itself before using it, e.g. a statically linked library's own dispatch).
set -euo pipefail
bin=${1:?usage: baseline_isa_check.sh BINARY [ALLOW_REGEX]}
allow=${2:-'^$'}
command -v objdump >/dev/null || { echo "baseline_isa_check: objdump not found (binutils)"; exit 2; }

objdump -d --no-show-raw-insn -C "$bin" | awk -v allow="$allow" '
  # A function header: "0000000000401000 <name>:"
  /^[0-9a-f]+ <.*>:$/ {
    fn = substr($0, index($0, "<") + 1); fn = substr(fn, 1, length(fn) - 2); next
  }
  /^ +[0-9a-f]+:\t/ {
    n = split($0, f, "\t"); insn = f[n]
    mnem = insn; sub(/[ \t].*/, "", mnem)
    bad = 0
    if (insn ~ /%[yz]mm[0-9]/ || insn ~ /%k[0-7]([^0-9]|$)/) bad = 1
    else if (mnem ~ /^v/ && mnem !~ /^(verr|verw|vmcall|vmlaunch|vmresume|vmxoff|vmxon|vmread|vmwrite|vmptrld|vmptrst|vmclear|vmfunc)$/) bad = 1
    else if (mnem ~ /^(andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx)$/) bad = 1
    if (!bad) next
    if (fn ~ /N_AVX2::|N_AVX3::|N_AVX3_DL::/ || fn ~ allow) next
    if (!(fn in seen)) { seen[fn] = insn; order[++count] = fn }
  }
  END {
    if (count == 0) { print "baseline_isa_check: no AVX outside the per-target code"; exit 0 }
    printf "baseline_isa_check: %d function(s) outside the per-target namespaces use AVX/BMI " \
           "instructions (SIGILL on an older x86-64 CPU):\n", count
    for (i = 1; i <= count; ++i) printf "  %s\n      first: %s\n", order[i], seen[order[i]]
    exit 1
  }'
