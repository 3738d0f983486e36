#!/usr/bin/env bash
# Runs docs/pipeline.md's "prefect deploy with a process work pool" block, word for word, in a fresh clone of this
# repository (its committed HEAD), against the Prefect server that PREFECT_API_URL names, and waits for the
# deployment run to finish (`prefect deployment run ... --watch` exits non-zero unless it completes).
#
#   PREFECT_API_URL=http://127.0.0.1:4200/api tools/deploy_from_clone.sh [EXTRA ARGS for `prefect deployment run`]
#
# ORTFLOW_VENV=/path/to/.venv links an installed environment as the clone's .venv (then `make setup` finds it up to
# date); tests use it, and extra args such as --params '{"overrides": [...]}' to train a few steps only.
# ORTFLOW_CLONE_DIR=DIR clones there (default: a new temporary folder); the clone is left for inspection.
set -euo pipefail
: "${PREFECT_API_URL:?set PREFECT_API_URL to the server to deploy to (e.g. http://127.0.0.1:4200/api)}"
source_repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
work=${ORTFLOW_CLONE_DIR:-$(mktemp -d)}
git clone --quiet "$source_repo" "$work/ortflow"
cd "$work/ortflow"
if [ -n "${ORTFLOW_VENV:-}" ]; then
    ln -s "$ORTFLOW_VENV" .venv
fi
steps=$(sed -n '/<!-- deploy-steps:begin -->/,/<!-- deploy-steps:end -->/p' docs/pipeline.md | grep -v '^<!--' \
        | grep -v '^```')
[ -n "$steps" ] || { echo "docs/pipeline.md has no deploy-steps block" >&2; exit 2; }
extra=$(printf ' %q' "$@")
steps=$(printf '%s\n' "$steps" | sed "s|^prefect deployment run .*|&${extra//|/\\|}|")
printf 'running in %s:\n%s\n' "$PWD" "$steps"
cleanup() { jobs -p | xargs -r kill 2>/dev/null || true; }
trap cleanup EXIT
set -x
eval "$steps"
