#!/bin/bash
# One GPU session's checks, run from the repository root by the device tool (OUT=where results go):
# environment, C probes built in place, gpu_check,
# then the tiny step's cost in one process (step_cost.py) with the C++ bucket timer built there.
export PYTHONPATH=$PWD
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch,sys,os;print('torch',torch.__version__,'py',sys.version.split()[0],'cpus',os.cpu_count())"
python3 -c "import click, plotly, numpy, pynvml; print('deps ok')" || echo "deps missing"
el build _fast
gcc -O2 -shared -fPIC -Werror=implicit-function-declaration -I$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])") \
  ddpdoctor/probes/_fast*.c \
  -o ddpdoctor/probes/_fast$(python3 -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))") && echo fast built
python3 -c "from ddpdoctor.probes import fastpath; print('fast module', fastpath.module() is not None)"
export DDPDOCTOR_CACHE=/tmp/ddpcache
( s=$(date +%s); python3 -m ddpdoctor native --build > $OUT/native_build.json 2>&1; echo "native build rc=$? in $(( $(date +%s) - s ))s" >> $OUT/native_build.json ) &
BUILD=$!
el gpu_check
timeout 330 python3 benchmarks/gpu_check.py --trials 1 --out /tmp/gpu_check > $OUT/gpu_check.json 2> $OUT/gpu_check.err
echo "gpu_check rc=$?"
cat $OUT/gpu_check.json; tail -5 $OUT/gpu_check.err
el wait native build; wait $BUILD; tail -3 $OUT/native_build.json
el step_cost
timeout 120 python3 benchmarks/step_cost.py --rounds 20 > $OUT/step_cost.txt 2>&1; echo "step_cost rc=$?"
cat $OUT/step_cost.txt | tail -12
el done
