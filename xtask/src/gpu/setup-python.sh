#!/bin/sh
# The GPU bundle's Python set-up (run by run.sh under its timeout): a tern wheel (the default
# one, else the TCP-only one for a machine without libibverbs) and, where $PYTHON lacks it,
# pytest, installed with pip --target into site/<wheel>, which run.sh puts on PYTHONPATH.
# No venv is made and ensurepip is never needed. Writes the wheel's name to site/wheel.
cd "$(dirname "$0")" || exit 1
PYTHON=${PYTHON:-python3}
mkdir -p site
install_into() {
  rm -rf "$2"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$2" "$1" &&
    PYTHONPATH="$2" "$PYTHON" -c 'import tern, tern.mooncake'
}
if install_into wheels/tern-default/*.whl site/default; then wheel=default
elif install_into wheels/tern-tcp-only/*.whl site/tcp-only; then wheel=tcp-only
else
  echo "neither tern wheel installs and imports with $PYTHON"
  exit 1
fi
if ! PYTHONPATH="site/$wheel" "$PYTHON" -c 'import pytest' 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-compile --disable-pip-version-check \
    --find-links wheels --target "site/$wheel" pytest || exit 1
fi
PYTHONPATH="site/$wheel" "$PYTHON" -c '
import pytest, tern
print("pytest", pytest.__version__, "from", pytest.__file__)
print("tern from", tern.__file__)
' || exit 1
echo "$wheel" >site/wheel
