# Source me: the embedded Airflow defaults for this checkout (absolute paths derived from where it lives).
_repo="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
export AIRFLOW_HOME="$_repo"
export AIRFLOW_CONFIG="$_repo/airflow.cfg"
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-sqlite:///$_repo/var/airflow.db}"
export AIRFLOW__CORE__DAGS_FOLDER="$_repo/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$_repo/plugins"
export AIRFLOW__LOGGING__BASE_LOG_FOLDER="$_repo/var/logs"
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE="$_repo/var/simple_auth_manager_passwords.json.generated"
export MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-sqlite:///$_repo/var/mlflow.db}"
export PYTHONPATH="$_repo${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$_repo/.venv/bin:$PATH"
# torch_npu, when installed without CANN, breaks `import torch`; on Ascend hosts set_env.sh is sourced first.
export TORCH_DEVICE_BACKEND_AUTOLOAD="${TORCH_DEVICE_BACKEND_AUTOLOAD:-0}"
mkdir -p "$_repo/var/logs"
unset _repo
