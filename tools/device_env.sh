# Sourced by the H200 scripts: wheels of missing packages from .whl/ into /tmp/site, and the
# environment that makes k3gen load the prebuilt sm90 cubins (no JIT on the device).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export K3GEN_GPU=1 K3GEN_PREBUILT=$PWD/build-out K3GEN_DISABLE_JIT=1 K3GEN_CACHE_DIR=/tmp/k3gen-cache
export PYTHONUNBUFFERED=1
