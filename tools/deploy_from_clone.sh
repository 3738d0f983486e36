#!/usr/bin/env bash
# Runs docs/operations.md's "prefect deploy with a process work pool" block, word for word, in a fresh clone of this
# repository (its committed HEAD), against the Prefect server that PREFECT_API_URL names, and waits for the
# deployment run to finish (`prefect deployment run ... --watch` exits non-zero unless it completes).
#
#   PREFECT_API_URL=http://127.0.0.1:4200/api tools/deploy_from_clone.sh [EXTRA ARGS for `prefect deployment run`]
#
# ORTFLOW_VENV=/path/to/.venv links an installed environment as the clone's .venv (then `make setup` finds it up to
# date); tests use it, and extra args such as --params '{"overrides": [...]}' to train a few steps only.
# ORTFLOW_CLONE_DIR=DIR clones there (default: a new temporary folder); the clone is left for inspection.
# ORTFLOW_PULL=git_clone deploys prefect.yaml's git_clone variant (the worker clones the repository for each run).
# ORTFLOW_PULL="working_directory git_clone" deploys and runs each variant in turn from the one clone, with one work pool
# and worker: the first runs the whole block, each later one its lines but the work pool's creation and the worker's
# start. Then `--` separates each variant's EXTRA ARGS (one group serves every variant); a line
# "== pull: VARIANT" starts each variant's part of the output.
set -euo pipefail
: "${PREFECT_API_URL:?set PREFECT_API_URL to the server to deploy to (e.g. http://127.0.0.1:4200/api)}"
source_repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
work=${ORTFLOW_CLONE_DIR:-$(mktemp -d)}
git clone --quiet "$source_repo" "$work/ortflow"
cd "$work/ortflow"
if [ -n "${ORTFLOW_VENV:-}" ]; then
    # `make setup` must find it up to date (its stamp names this pyproject.toml + requirements.lock): otherwise it
    # would reinstall ortflow from this clone into the shared environment.
    stamp="$ORTFLOW_VENV/.installed-$(cat pyproject.toml requirements.lock | cksum | cut -d' ' -f1)"
    [ -e "$stamp" ] || { echo "$ORTFLOW_VENV is not set up from this commit's pyproject.toml and requirements.lock" \
                              "(no $stamp): run make setup there first" >&2; exit 2; }
    touch "$stamp"  # newer than this fresh clone's files, so make sees nothing to redo
    ln -s "$ORTFLOW_VENV" .venv
fi
git_clone_pull() {
    # The git_clone variant that prefect.yaml describes, cloning this repository's current branch: each flow run
    # then works in a clone of its own, not in this folder.
    python3 - "$source_repo" "$(git -C "$source_repo" rev-parse --abbrev-ref HEAD)" <<'PY'
import sys
repo, branch = sys.argv[1:]
pull = f"""pull:
  - prefect.deployments.steps.git_clone:
      id: clone
      repository: "{repo}"
      branch: "{branch}"
  - prefect.deployments.steps.run_shell_script:
      directory: "{{{{ clone.directory }}}}"
      script: ortflow example gpt examples/gpt/deploy
      stream_output: true
"""
text = open("prefect.yaml").read()
start, end = text.index("\npull:\n") + 1, text.index("\ndefinitions:")
open("prefect.yaml", "w").write(text[:start] + pull + text[end:])
PY
}
steps=$(sed -n '/<!-- deploy-steps:begin -->/,/<!-- deploy-steps:end -->/p' docs/operations.md | grep -v '^<!--' \
        | grep -v '^```')
[ -n "$steps" ] || { echo "docs/operations.md has no deploy-steps block" >&2; exit 2; }
groups=("")  # each variant's extra args for `prefect deployment run`, quoted
for arg in "$@"; do
    if [ "$arg" = -- ]; then groups+=(""); else groups[-1]+=$(printf ' %q' "$arg"); fi
done
with_extra() {  # the block, its `prefect deployment run` line with the extra args $1
    local line out=""
    while IFS= read -r line; do
        [[ $line == "prefect deployment run "* ]] && line+="$1"
        out+="$line"$'\n'
    done <<< "$steps"
    printf '%s' "$out"
}
stop_tree() {  # signal a background step (the worker) and everything it started
    local sig=$1 pid=$2 child
    for child in $(pgrep -P "$pid"); do stop_tree "$sig" "$child"; done
    kill "-$sig" "$pid" 2>/dev/null || true
}
cleanup() {
    local status=$? pid
    for pid in $(jobs -pr); do stop_tree TERM "$pid"; done
    for _ in $(seq 40); do [ -z "$(jobs -pr)" ] && break; sleep 0.5; done
    for pid in $(jobs -pr); do stop_tree KILL "$pid"; done  # a worker that is still shutting down after 20 s
    exit "$status"
}
trap cleanup EXIT
# Job control, as in the terminal the steps are typed into: without it a script's background commands ignore SIGINT,
# and a Prefect worker, which stops on SIGTERM by sending itself SIGINT, would then not stop until killed.
set -m
read -r -a pulls <<< "${ORTFLOW_PULL:-working_directory}"
for i in "${!pulls[@]}"; do
    set +x
    git checkout --quiet prefect.yaml
    case ${pulls[i]} in
        working_directory) ;;
        git_clone) git_clone_pull ;;
        *) echo "ORTFLOW_PULL: unknown pull variant ${pulls[i]} (use working_directory or git_clone)" >&2; exit 2 ;;
    esac
    run=$(with_extra "${groups[i]:-${groups[0]}}")
    # The pool exists and the worker serves it from the first variant on.
    [ "$i" = 0 ] || run=$(grep -v -e '^prefect work-pool create ' -e '^prefect worker start ' <<< "$run")
    printf '== pull: %s\nrunning in %s:\n%s\n' "${pulls[i]}" "$PWD" "$run"
    set -x
    eval "$run"
done
