#!/usr/bin/env bash
# The GPU figures of issues 3 and 7 in one command, for a lent CUDA machine whose python3 has torch and
# triton but not loraplex's other requirements (this workplace's H200 image):
#
#   bash benchmarks/gpu_session.sh OUT_DIR [TOTAL_S]
#
# 1. loraplex (built from this checkout) and the wheels in .whl/ (SQLAlchemy, alembic, Mako, greenlet for
#    CPython 3.12: the adapter store's imports) into /tmp/lp-site; nothing is fetched;
# 2. benchmarks/kernels_gpu.py (issue 3: ceilings, SGMV, paged attention) -> OUT_DIR/kernels_gpu.{json,md};
# 3. benchmarks/step_profile.py --gpu (where a decode step's host and device time go) -> OUT_DIR/step_profile.json;
# 4. benchmarks/e2e/run.py --quick --gpu (issue 7) with what is left of TOTAL_S (default 540 s) ->
#    OUT_DIR/e2e_quick_gpu.{json,png}; its JSON is rewritten after each part, so a stop keeps the parts done.
# Logs: OUT_DIR/session.log. Fetch the wheels first (see benchmarks/README.md, "GPU runs").
set -u -o pipefail
out=${1:?usage: gpu_session.sh OUT_DIR [TOTAL_S]}
total=${2:-540}
mkdir -p "$out"
exec > >(tee "$out/session.log") 2>&1
export PYTHONUNBUFFERED=1
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
python3 -c 'import sys, torch, triton, transformers; print("python", sys.version.split()[0], "torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__)'
python3 -m pip show peft 2>/dev/null | head -2
lscpu | grep -E '^(Model name|CPU\(s\))'

site=/tmp/lp-site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" .whl/*.whl . \
    2>&1 | grep -v -i -E 'warn|^ *\*|^ *$|!!|package data|importable|check\.' || true
export PYTHONPATH=$site
python3 -c 'import loraplex.kernels, loraplex.engine, loraplex.adapter_store.host_cache; print("loraplex imports")' || exit 1

# LP_SKIP_KERNELS=1 / LP_SKIP_PROFILE=1 / LP_SKIP_E2E=1 leave a part out (a second call for what the first
# one's TOTAL_S cut, say).
if [ "${LP_SKIP_KERNELS:-0}" != 1 ]; then
    echo "== kernels_gpu.py ($((SECONDS - start)) s in)"
    timeout 200 python3 benchmarks/kernels_gpu.py --out "$out" --budget-s 110
    echo "kernels_gpu exit $? ($((SECONDS - start)) s in)"
fi

if [ "${LP_SKIP_PROFILE:-0}" != 1 ]; then
    # four cases: without and with 16 adapters, each with the Triton pointwise kernels and with torch's formulas
    echo "== step_profile.py ($((SECONDS - start)) s in)"  # builds the model e2e/run.py then reuses
    timeout 240 python3 benchmarks/step_profile.py --gpu --adapters 16 --out "$out" --work-dir /tmp/lp-e2e
    echo "step_profile exit $? ($((SECONDS - start)) s in)"
fi

left=$((total - (SECONDS - start) - 10))
if [ "${LP_SKIP_E2E:-0}" = 1 ]; then
    echo "== e2e left out (LP_SKIP_E2E=1)"
elif [ "$left" -lt 60 ]; then
    echo "== e2e left out: ${left} s of TOTAL_S left (run it in a second call with LP_SKIP_KERNELS=1 LP_SKIP_PROFILE=1)"
else
    echo "== e2e --quick --gpu with ${left} s"
    timeout "$left" python3 benchmarks/e2e/run.py --quick --gpu --scaling-repeats 2 --out "$out/e2e_quick_gpu.json" \
        --work-dir /tmp/lp-e2e
    echo "e2e exit $? ($((SECONDS - start)) s in)"
fi
ls -la "$out"
