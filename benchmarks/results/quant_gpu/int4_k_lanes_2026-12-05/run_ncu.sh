#!/bin/bash
# Nsight Compute on gate_up at one row: the shipped kernel, _lanes, _lanes with the nibble trick.
nvidia-smi --query-gpu=name --format=csv,noheader
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD
D=benchmarks/results/quant_gpu/int4_k_lanes_2026-12-05
timeout 200 ncu --clock-control none -k regex:"_int4_row_kernel|_lanes" --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
  --section InstructionStats --section ComputeWorkloadAnalysis \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,smsp__inst_executed.sum,launch__registers_per_thread" \
  python $D/ncu_profile.py > $OUT/ncu_shipped.txt 2>&1
# -k with launch-skip applies per kernel name: profile each name's second launch; _lanes has two configs.
timeout 200 ncu --clock-control none -k regex:"_lanes" --launch-skip 1 --launch-count 3 \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
  --section InstructionStats --section ComputeWorkloadAnalysis \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,smsp__inst_executed.sum,launch__registers_per_thread" \
  python $D/ncu_profile.py > $OUT/ncu_lanes.txt 2>&1
for f in $OUT/ncu_shipped.txt $OUT/ncu_lanes.txt; do
  grep -E "^  _|Duration|DRAM Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|Theoretical Occ|inst_executed.sum|stalled_(long|short|wait|math|mio|lg|not_sel|barrier|dispatch|no_inst)[a-z_]*_per_issue_active|pipe_(alu|fma|fmaheavy|xu|lsu)[a-z_]*\.avg" $f | awk '{$1=$1; print}' | grep -v " 0$" | head -60
done
