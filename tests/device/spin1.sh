#!/bin/bash
# Issue 19's device run: one rank (VLLM::Worker_TP0, one-rank NCCL group, Flight Recorder on) does real work, then
# spins a kernel on its own GPU and waits on it, watched by the real `watchdog run`. Runs on the device machine
# (kind nvidia-h200) from the repo root; needs .whl/ with py-spy, setproctitle, tenacity (tests/device/README.md).
# Everything comes back as one tar under $OUT.
set -u
OUT=${OUT:-/tmp/spin1-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# systemd-python has no wheel (an sdist needing libsystemd's headers): outside systemd its notify() sends nothing and
# returns False, which this stand-in does too (for this run only; the product needs the real package)
python3 -c 'from systemd import daemon' 2>/dev/null || { mkdir -p /tmp/site/systemd && touch /tmp/site/systemd/__init__.py &&
    printf 'def notify(status, unset_environment=False, pid=0, fds=None):\n    return False\n' >/tmp/site/systemd/daemon.py; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=/tmp/spin1-run && rm -rf $W && mkdir -p $W
{ date -u; nvidia-smi; python3 -c 'import torch, pynvml; print(torch.__version__, torch.cuda.nccl.version(), torch.cuda.device_count(), pynvml.__file__)'; /tmp/site/bin/py-spy --version; } >$W/env.txt 2>&1
timeout -k 10 300 python3 tests/device/tp2_run.py --out $W --pyspy /tmp/site/bin/py-spy --ranks 1 --only ${ONLY:-wedge0} 2>&1 | tee $W/run.log
find $W -type p -delete
tar czf "$OUT"/spin1-run.tar.gz -C /tmp spin1-run
ls -la "$OUT"
