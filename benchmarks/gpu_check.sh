#!/usr/bin/env bash
# The GPU check in one command (benchmarks/gpu_check.py says what it measures). On an H200 it fits in 10 minutes:
#
#   bash benchmarks/gpu_check.sh                          # GPU: both models, every config, against TRL
#   bash benchmarks/gpu_check.sh --device cpu --tiny      # CPU: the same path on tiny shapes, in about a minute
#
# The lent GPU machine has torch, transformers, peft and accelerate but no trl and no datasets, and no network.
# Their wheels travel with the call: first, where pip reaches PyPI, in the repository's root,
#
#   bash benchmarks/gpu_check.sh --fetch-wheels           # trl, transformers, datasets, dill, multiprocess into .whl/
#
# then name `.whl` in the device call's `carry`. This script installs them into /tmp/site when trl or datasets is
# missing, and runs dpo_min from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
# transformers too: the machine's 5.17 predates the boolean logits_to_keep dpo_min passes (pyproject.toml).
WHEELS=(trl==1.16.0 transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    exclude="$(git rev-parse --git-path info/exclude)"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    exit 0
fi

if ! python3 -c "import trl, datasets, transformers.modeling_utils as m; m.slice_logits_to_keep" 2>/dev/null; then
    if ! compgen -G ".whl/*.whl" > /dev/null; then
        echo "trl and datasets are not installed and .whl/ holds no wheels: run 'bash benchmarks/gpu_check.sh" \
             "--fetch-wheels' where pip reaches PyPI, and carry .whl" >&2
        exit 2
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if [[ " $* " == *" --tiny "* ]]; then
    set -- --batch-size 2 --warmup 1 --steps 1 "$@"   # a proof that the path runs, not a measurement
fi
exec python3 benchmarks/gpu_check.py "$@"
