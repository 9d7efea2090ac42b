#!/usr/bin/env bash
# Sets up .venv (see setup_env.sh), builds sparsekit and trains the DLRM-style model on
# built-in synthetic data: a few minutes on a CPU, held-out AUC printed as it rises.
#
#   bash scripts/train.sh [python -m sparsekit.train args...]
source "$(dirname "$0")/setup_env.sh"

echo "== python -m sparsekit.train $*"
exec "$PY" -m sparsekit.train --data synthetic "$@"
