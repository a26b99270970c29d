#!/usr/bin/env bash
# README's main command: set up (or reuse) .venv, then serve the embedded default (CPU, the shipped small model)
# on 127.0.0.1:8000. Extra arguments go to `serve run`.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec serve run configs/local.yaml "$@"
