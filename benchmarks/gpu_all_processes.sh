#!/usr/bin/env bash
# `pagoda bench gpu all`'s stages in groups, one process a group, so that a stage which leaves
# memory on the card (reported in its record's `left_on_device`) cannot starve the next group's
# engines. Usage: benchmarks/gpu_all_processes.sh OUT_DIR GROUP_BUDGET_S... where each budget goes,
# in order, to the groups below (a budget of 0 skips its group). Each group writes
# OUT_DIR/<group>.json and .log; the exit status is the worst group's. $GPU_ALL_ARGS is passed on
# (e.g. --dry-run, to walk through the groups on CPU).
set -uo pipefail
out="$1"; shift
groups=(
  "smoke-rooflines:smoke,roofline-qwen3-0.6b-bf16,roofline-llama3-8b-bf16,sync-watch"
  "kernels:mla-decode,skinny-gemm,decode-splits,decode-kernels,host-profile,fp8-gemms"
  "fp8-roofline:roofline-llama3-8b-fp8"
  "fp8-batch32:fp8-w8a8-llama3-8b-batch32,fp8-kernels"
  "graphs-async:moe-graphs,lora-graphs,async-scheduling"
  "attention-throughput:attention,qkv-prepare,throughput,throughput-hf"
)
status=0
for i in "${!groups[@]}"; do
  budget="${1:-0}"; shift || true
  name="${groups[$i]%%:*}"; stages="${groups[$i]#*:}"
  [ "${budget%.*}" -gt 0 ] 2>/dev/null || continue
  python3 -m pagoda.entrypoints.cli bench gpu all --stages "$stages" --budget-s "$budget" \
      --json "$out/$name.json" ${GPU_ALL_ARGS:-} > "$out/$name.log" 2>&1
  rc=$?; [ $rc -gt $status ] && status=$rc
  grep '^\[gpu all\]' "$out/$name.log" | grep -v ' device: '
done
exit $status
