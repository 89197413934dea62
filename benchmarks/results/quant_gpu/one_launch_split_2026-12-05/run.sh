#!/bin/bash
# K split summed in the launch against a second launch: per projection (A/B in one
# process), the 8B-shape decode step both ways, Nsight Compute on the 4-bit one-row
# kernel, then the CUDA tests of the GEMMs.
D=benchmarks/results/quant_gpu/one_launch_split_2026-12-05
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD
T0=$(date +%s)
timeout 170 python $D/split_sum_ab.py $OUT/split_sum_ab.json > $OUT/split_sum_ab.log 2>&1
tail -2 $OUT/split_sum_ab.log; echo "ab done at $(( $(date +%s) - T0 )) s"
decode() {  # label one_launch(True/False)
  timeout 110 python -c "
import runpy, sys
from specserve.kernels import quant_matmul
quant_matmul.ONE_LAUNCH_SUM = $2
sys.argv = ['quant_gpu.py', '--sections', 'decode', '--reps', '20', '--json', '$OUT/decode_$1.json']
runpy.run_path('benchmarks/quant_gpu.py', run_name='__main__')" > $OUT/decode_$1.log 2>&1
  grep '"decode"' $OUT/decode_$1.log | python -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l[l.index('{'):])
    print('$1', r['scheme'], r['step_ms'], r['floor_ms'], r['vs_floor'], r['verify_1_plus_4_ms'])"
  echo "$1 done at $(( $(date +%s) - T0 )) s"
}
decode one1 True
decode two1 False
timeout 60 ncu --clock-control none -k regex:_int4_row_kernel -c 2 --section SpeedOfLight --section WarpStateStats \
  --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  python $D/profile_int4_row.py > $OUT/ncu_int4_row.txt 2>&1
grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Issue Slots|Stall" $OUT/ncu_int4_row.txt | head -30
echo "ncu done at $(( $(date +%s) - T0 )) s"
timeout $(( 560 - ($(date +%s) - T0) )) python -m pytest -q -x -p no:cacheprovider tests/test_checkpoint_quant.py \
  -k "gemm or row_does or one_launch or captured_before" > $OUT/pytest_gpu.log 2>&1
tail -3 $OUT/pytest_gpu.log; echo "tests done at $(( $(date +%s) - T0 )) s"
