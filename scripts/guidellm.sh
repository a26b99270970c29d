#!/usr/bin/env bash
# guidellm in chat mode against configs/local.yaml (benchmarks/guidellm_chat.py; its arguments pass through).
# guidellm pulls torch, datasets and pandas: it gets an environment of its own, .venv-guidellm, created on first use.
#   SHADOWKV_GUIDELLM_SPEC  guidellm requirement (default guidellm==0.8.1, the version docs/api.md's run used)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
gvenv=$repo/.venv-guidellm
if [ ! -x "$gvenv/bin/guidellm" ]; then
    echo "shadowkv: installing ${SHADOWKV_GUIDELLM_SPEC:-guidellm==0.8.1} into $gvenv" >&2
    python3 -m venv "$gvenv"
    # the torch env.sh installs first, so that guidellm does not pull a CUDA build onto a CPU machine
    "$gvenv/bin/python" -m pip --disable-pip-version-check install "${SHADOWKV_TORCH_SPEC:-torch==2.13.0}" \
        "${SHADOWKV_GUIDELLM_SPEC:-guidellm==0.8.1}"
fi
. "$repo/scripts/env.sh"
PYTHONPATH=$repo exec python -m benchmarks.guidellm_chat --guidellm "$gvenv/bin/guidellm" "$@"
