#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine, installing what it needs first:
# system packages when missing (redis-server, libibverbs1 for Mooncake; g++ and
# libssl-dev for the hash extension SGLang builds, g++ and python3-dev for kvconn's own),
# the CPU build of PyTorch, and kvconn with its dev, redis and mooncake extras. Then the
# engine adapters' suites (noxfile.py), each in its own virtual environment under .nox/,
# created on the first run and reused after. Arguments go to the core pytest run and skip
# the engine suites (a targeted run); KVCONN_SKIP_ENGINES=1 skips them too.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-cli >/dev/null || missing+=(redis-tools)  # redis-cli --cluster create
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then missing+=(libibverbs1); fi
command -v g++ >/dev/null || missing+=(g++)
[ -e /usr/include/openssl/sha.h ] || missing+=(libssl-dev)
# kvconn's own extensions (kvconn/_scatter.c, kvconn/_checksum.c) build against the
# interpreter's headers
py_include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -e "$py_include/Python.h" ] || missing+=(python3-dev)
if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing system packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

# A full disk fails pip deep into a run ("No space left on device" after the vLLM suite
# has taken 15 minutes): say so up front instead. The engine environments take 1.8 (vLLM)
# and 2.5 GiB (SGLang), each twice (with and without the stores' clients); round up to 3
# each, pip unpacks wheels beside them; torch about 1.
need_gib=1
"$PY" -c 'import torch' 2>/dev/null || need_gib=$((need_gib + 1))
if [ "$#" -eq 0 ] && [ "${KVCONN_SKIP_ENGINES:-0}" != 1 ]; then
    for env in vllm vllm_stores sglang sglang_stores; do [ -d ".nox/$env" ] || need_gib=$((need_gib + 3)); done
fi
free_gib=$(( $(df -Pk . | awk 'NR == 2 {print $4}') / 1048576 ))
if [ "$free_gib" -lt "$need_gib" ]; then
    echo "error: $free_gib GiB free on the disk holding $(pwd); this run needs about" \
        "$need_gib GiB (environments to install). Free some space and rerun." >&2
    exit 1
fi
# The CPU build of torch: a plain 'pip install torch' would pull a multi-GB CUDA build.
if ! "$PY" -c 'import torch' 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e '.[dev,redis,mooncake]'

"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
"$PY" -m pytest "$@"

if [ "$#" -eq 0 ] && [ "${KVCONN_SKIP_ENGINES:-0}" != 1 ]; then
    "$PY" -m nox
fi
