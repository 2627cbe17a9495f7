# Source me: the embedded Airflow defaults for this checkout (absolute paths derived from where it lives).
_repo="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
_var="${LLM_PIPELINE_VAR_DIR:-$_repo/var}"  # runs, stores, logs: all follow LLM_PIPELINE_VAR_DIR
export AIRFLOW_HOME="$_repo"
export AIRFLOW_CONFIG="$_repo/airflow.cfg"
# A value set by hand is kept; one this script derived for another var dir (sourced again with another
# LLM_PIPELINE_VAR_DIR, e.g. `make run LLM_PIPELINE_VAR_DIR=…` from a shell that sourced it) follows the new one.
_old="${_LLM_PIPELINE_ENV_VAR:-}"
_derive() {  # NAME VALUE
  local cur="${!1-}"
  if [ -z "$cur" ] || { [ -n "$_old" ] && [ "$_old" != "$_var" ] && [ "$cur" = "${2//"$_var"/"$_old"}" ]; }; then
    export "$1=$2"
  fi
}
_derive AIRFLOW__DATABASE__SQL_ALCHEMY_CONN "sqlite:///$_var/airflow.db"
export AIRFLOW__CORE__DAGS_FOLDER="$_repo/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$_repo/plugins"
_derive AIRFLOW__LOGGING__BASE_LOG_FOLDER "$_var/logs"
_derive AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE "$_var/simple_auth_manager_passwords.json.generated"
_derive MLFLOW_TRACKING_URI "sqlite:///$_var/mlflow.db"
export _LLM_PIPELINE_ENV_VAR="$_var"
export PYTHONPATH="$_repo${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$_repo/.venv/bin:$PATH"
# torch_npu, when installed without CANN, breaks `import torch`; on Ascend hosts set_env.sh is sourced first.
export TORCH_DEVICE_BACKEND_AUTOLOAD="${TORCH_DEVICE_BACKEND_AUTOLOAD:-0}"
mkdir -p "$_var/logs" "$AIRFLOW__LOGGING__BASE_LOG_FOLDER"
# A SQLite DB holding credentials (Airflow's connections and users, MLflow's auth DB) is 0600 whatever the umask:
# created empty here (SQLite takes a 0-byte file as a new database, and gives its journal the file's mode).
private_sqlite() {
  local f="${1#sqlite:///}"
  [ "$f" != "$1" ] || return 0
  mkdir -p "$(dirname "$f")" && { [ -e "$f" ] || (umask 077 && : > "$f"); } && chmod 600 "$f" 2>/dev/null
  return 0
}
private_sqlite "$AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"
unset _repo _var _old
unset -f _derive
