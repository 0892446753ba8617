#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine, installing what it needs first:
# system packages (redis-server, libibverbs1 for Mooncake; g++ and libssl-dev for the
# hash extension SGLang builds) when missing, the CPU build of PyTorch, and kvconn with
# its dev, redis and mooncake extras. Then the engine adapters' suites (noxfile.py), each
# in its own virtual environment under .nox/, created on the first run and reused after.
# Arguments go to the core pytest run and skip the engine suites (a targeted run);
# KVCONN_SKIP_ENGINES=1 skips them too.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-cli >/dev/null || missing+=(redis-tools)  # redis-cli --cluster create
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then missing+=(libibverbs1); fi
command -v g++ >/dev/null || missing+=(g++)
[ -e /usr/include/openssl/sha.h ] || missing+=(libssl-dev)
if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing system packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

PY="${PYTHON:-python3}"
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
