#!/bin/sh
# Tern's GPU checks, made to end within their budget whatever happens: every check runs under
# a timeout (a hang prints "FAIL name (timeout after N s)" and the next check runs), and the
# whole run stops starting checks once its budget is spent. One line per check; each check's
# log, the probes' output and logs/summary.txt (the header and every check's line) under logs/.
# Exit status 0 only when every check passed.
#
#   TERN_BUNDLE_BUDGET   seconds for the whole run (default 290)
#   PYTHON               the Python with PyTorch (default python3)
#   TERN_CUDA_DRIVER     the libcuda.so.1 to load, when the loader does not find it
#   TERN_BUNDLE_STANDIN  (cargo xtask test only) run against this stand-in driver, no GPU
#   TERN_BUNDLE_SELFTEST (cargo xtask test only) add a check that outlives its timeout
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE" || exit 1
START=$(date +%s)
BUDGET=${TERN_BUNDLE_BUDGET:-290}
PYTHON=${PYTHON:-python3}
rm -rf logs site
mkdir -p logs
SUMMARY=logs/summary.txt
: >"$SUMMARY"
failed=0

say() {
  echo "$*"
  echo "$*" >>"$SUMMARY"
}

left() {
  echo $((START + BUDGET - $(date +%s)))
}

# check NAME LIMIT COMMAND...: runs COMMAND under a timeout of LIMIT seconds (less if the
# budget has less left), its output in logs/NAME.log.
check() {
  name=$1
  limit=$2
  shift 2
  room=$(($(left) - 5))
  if [ "$room" -le 0 ]; then
    say "SKIP  $name (the run's ${BUDGET} s are spent)"
    failed=1
    return
  fi
  [ "$limit" -gt "$room" ] && limit=$room
  began=$(date +%s)
  timeout -k 5 "$limit" "$@" >"logs/$name.log" 2>&1
  code=$?
  took=$(($(date +%s) - began))
  if [ "$code" -eq 0 ]; then
    say "ok    $name ($took s)"
  elif [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
    say "FAIL  $name (timeout after $limit s): see logs/$name.log"
    tail -n 5 "logs/$name.log" | sed 's/^/      /'
    failed=1
  else
    say "FAIL  $name (exit $code, $took s): see logs/$name.log"
    tail -n 5 "logs/$name.log" | sed 's/^/      /'
    failed=1
  fi
}

if [ -n "$TERN_BUNDLE_STANDIN" ]; then
  export TERN_CUDA_DRIVER="$TERN_BUNDLE_STANDIN"
  say "gpu   none: the stand-in driver $TERN_BUNDLE_STANDIN (cargo xtask test's run of this script)"
elif ! { [ -e /dev/nvidia0 ] || command -v nvidia-smi >/dev/null 2>&1; }; then
  echo "no NVIDIA GPU on this machine (no /dev/nvidia0, no nvidia-smi): nothing to check"
  exit 2
else
  say "gpu   $(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1)"
fi
# Tern's streams and a caller's gates each need a hardware queue of their own: with the
# default 8 the driver maps streams onto shared queues, whose work then waits on unrelated
# work (CUDA C++ Programming Guide, "Implicit Synchronization").
export CUDA_DEVICE_MAX_CONNECTIONS=32

# Which libcuda.so.1 the loader finds; where it does not, the first of the driver's usual
# places that has it, named in TERN_CUDA_DRIVER for every check.
probe_driver() {
  timeout 30 "$PYTHON" - "$1" <<'EOF'
import ctypes, sys
name = sys.argv[1]
lib = ctypes.CDLL(name)
version = ctypes.c_int()
code = lib.cuDriverGetVersion(ctypes.byref(version))
path = next((l.split()[-1] for l in open("/proc/self/maps") if "libcuda" in l or "standin" in l), name)
print(f"{path} (CUDA {version.value // 1000}.{version.value % 1000 // 10}, cuDriverGetVersion {code})")
EOF
}
if [ -z "$TERN_CUDA_DRIVER" ] && ! found=$(probe_driver libcuda.so.1 2>logs/driver-probe.log); then
  for dir in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda/compat; do
    if [ -e "$dir/libcuda.so.1" ]; then
      export TERN_CUDA_DRIVER="$dir/libcuda.so.1"
      break
    fi
  done
fi
if [ -n "$TERN_CUDA_DRIVER" ]; then
  found=$(probe_driver "$TERN_CUDA_DRIVER" 2>>logs/driver-probe.log) || found="$TERN_CUDA_DRIVER does not load (logs/driver-probe.log)"
  say "cuda  $found; TERN_CUDA_DRIVER=$TERN_CUDA_DRIVER"
else
  say "cuda  ${found:-libcuda.so.1 not found (logs/driver-probe.log)}"
fi
say "glibc $(getconf GNU_LIBC_VERSION 2>&1)"
say "python $(timeout 20 "$PYTHON" -c 'import sys; print(sys.version.split()[0], sys.executable, "venv" if sys.prefix != sys.base_prefix else "no venv", "prefix", sys.prefix)' 2>&1)"
torch_line=$(timeout 60 "$PYTHON" -c '
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "devices", torch.cuda.device_count() if torch.cuda.is_available() else "none")
' 2>logs/torch.log) || torch_line="torch none: $(tail -n 1 logs/torch.log)"
say "$torch_line"
numpy_line=$(timeout 20 "$PYTHON" -c 'import numpy; print("numpy", numpy.__version__)' 2>/dev/null) || numpy_line="numpy none"
say "$numpy_line"

# The Rust checks: the device-memory tests on this driver.
export TERN_GPU=1 RUST_BACKTRACE=1
for test in bin/*; do
  check "rust-$(basename "$test")" 60 "$test" --test-threads=1
done
if [ -n "$TERN_BUNDLE_SELFTEST" ]; then
  check selftest-sleep 2 sleep 30
  check selftest-after 5 true
fi

# Python: the wheel and pytest installed beside the interpreter's own packages, not in a
# venv made from it (a venv of a venv does not see the first one's packages, and needs
# ensurepip): pip install --target, then PYTHONPATH (setup-python.sh).
export PYTHON
check python-setup 60 sh setup-python.sh
wheel=$(cat site/wheel 2>/dev/null)
if [ -z "$wheel" ]; then
  say "SKIP  python checks (no wheel installed: logs/python-setup.log)"
  failed=1
elif ! timeout 60 "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  say "SKIP  python checks with CUDA tensors ($PYTHON has no PyTorch with CUDA)"
  [ -z "$TERN_BUNDLE_STANDIN" ] && failed=1
else
  export PYTHONPATH="$HERE/site/$wheel" PYTHONUNBUFFERED=1
  check python-default-allocator 90 "$PYTHON" -m pytest -q -p no:cacheprovider -x python/tests
  check python-expandable-segments 90 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    "$PYTHON" -m pytest -q -p no:cacheprovider -x python/tests
  check bench-default-allocator 45 "$PYTHON" python/bench_gpu.py
  check bench-expandable-segments 45 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    "$PYTHON" python/bench_gpu.py
  for log in logs/bench-*.log; do
    [ -e "$log" ] && sed "s/^/bench $(basename "$log" .log | cut -c7-): /" "$log" | grep -v '^$'
  done
fi
say "done  in $(($(date +%s) - START)) s of ${BUDGET} s; $([ "$failed" -eq 0 ] && echo 'every check passed' || echo 'some checks failed')"
exit $failed
