#!/usr/bin/env bash
# `make run`: the whole llm_pipeline DAG in one process (`airflow dags test`), progress on screen, the full log in
# var/logs/make-run.log, then the one-screen summary. Exits non-zero unless every stage succeeded.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/airflow-env.sh
conf="${1:-{\}}"
log="${LLM_RUN_LOG:-var/logs/make-run.log}"
runs="${LLM_PIPELINE_VAR_DIR:-var}/runs/llm_pipeline"
echo "llm_pipeline on $(python -c 'import tasks.config as c; print(c.load_config().preset)') (conf: $conf); full log: $log"
start=$(date +%s)
airflow dags test llm_pipeline --conf "$conf" 2>&1 | tee "$log" | \
  sed -nuE 's/.*\[DAG TEST\] starting task_id=([a-z_]+).*/  … \1/p; s/.*(AirflowFailException|StageError): (.*)/  ! \2/p'
status=${PIPESTATUS[0]}
run_dir=$(ls -td "$runs"/*/ 2>/dev/null | head -1)
echo
python -m tasks summary --run-dir "$run_dir" --check || status=1
echo
echo "Took $(( $(date +%s) - start )) s. Run directory: $run_dir"
echo "MLflow UI: .venv/bin/mlflow ui --backend-store-uri ${MLFLOW_TRACKING_URI} --host 127.0.0.1 --port 5000"
exit $status
