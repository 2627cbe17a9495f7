#!/usr/bin/env bash
# `make run`: the whole llm_pipeline DAG in one process (`airflow dags test`), progress on screen, the full log in
# var/logs/make-run.log, then the one-screen summary of THIS run. Exits non-zero unless every stage succeeded.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/airflow-env.sh
conf="${1:-}"
[ -n "$conf" ] || conf='{}'
log="${LLM_RUN_LOG:-${LLM_PIPELINE_VAR_DIR:-var}/logs/make-run.log}"
runs="${LLM_PIPELINE_VAR_DIR:-var}/runs/llm_pipeline"
preset=$(python - "$conf" <<'PY'
import json, sys
from tasks.errors import StageError
from tasks.config import load_config
try:
    print(load_config(json.loads(sys.argv[1]).get("preset")).preset)
except (ValueError, StageError) as e:  # bad JSON or an unknown preset: one line, before Airflow starts
    sys.exit(f"error: CONF {sys.argv[1]}: {e}")
PY
) || exit 2
echo "llm_pipeline on $preset (conf: $conf); full log: $log"
before=$(ls "$runs" 2>/dev/null)
start=$(date +%s)
airflow dags test llm_pipeline --conf "$conf" 2>&1 | tee "$log" | \
  sed -nuE 's/.*\[DAG TEST\] starting task_id=([a-z_]+).*/  … \1/p; s/.*(AirflowFailException|StageError): (.*)/  ! \2/p'
status=${PIPESTATUS[0]}
run=$(comm -13 <(echo "$before" | sort) <(ls "$runs" 2>/dev/null | sort) | head -1)  # the directory this run made
echo
if [ -z "$run" ]; then
  cause=$(grep -m1 -oE "ParamValidationError: .*" "$log" | cut -c1-300)
  echo "error: no stage ran: ${cause:-see $log}"; exit 1
fi
python -m tasks summary --run-dir "$runs/$run" --check || status=1
echo
echo "Took $(( $(date +%s) - start )) s. Run directory: $runs/$run"
echo "MLflow UI: .venv/bin/mlflow ui --backend-store-uri ${MLFLOW_TRACKING_URI} --host 127.0.0.1 --port 5000"
exit $status
