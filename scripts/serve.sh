#!/usr/bin/env bash
# README's main command: set up (or reuse) .venv, then serve the embedded default (CPU, the shipped small model).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ ! -f configs/local.yaml ]; then
    echo "serve.sh: configs/local.yaml does not exist yet: the Ray Serve application is not built (issue 7)." >&2
    exit 2
fi
exec serve run configs/local.yaml "$@"
