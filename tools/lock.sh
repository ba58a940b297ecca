#!/usr/bin/env bash
# Refresh requirements/lock/<env>.txt: every package (transitive ones too) that `make test` installs into
# .venv/<env>, resolved today from requirements/<env>.txt and requirements/test.txt in a fresh venv.
# torch is left out: the Makefile installs it first, pinned, from the index the user chooses (TORCH_INDEX),
# and the packages that come with a torch build (triton, nvidia-*) depend on that choice.
# Usage: tools/lock.sh PYTHON TORCH_SPEC "TORCH_INDEX_ARGS" ENV...
set -euo pipefail
python=$1 torch_spec=$2 torch_index_args=$3
shift 3
for env in "$@"; do
    venv=.venv/lock-$env
    rm -rf "$venv"
    "$python" -m venv "$venv"
    # shellcheck disable=SC2086  # the index arguments are words
    "$venv/bin/pip" install -q "$torch_spec" $torch_index_args
    "$venv/bin/pip" install -q -r "requirements/$env.txt" -r requirements/test.txt -e ".[cli]"
    {
        echo "# Made by \`make lock\` from requirements/$env.txt and requirements/test.txt; do not edit."
        "$venv/bin/pip" freeze --exclude-editable | grep -viE '^(torch|triton|nvidia-[a-z0-9-]+)==' | sed 's/+cpu$//'
    } > "requirements/lock/$env.txt"
    rm -rf "$venv"
    echo "requirements/lock/$env.txt: $(grep -vc '^#' "requirements/lock/$env.txt") packages"
done
