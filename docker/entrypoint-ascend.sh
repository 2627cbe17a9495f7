#!/usr/bin/env bash
# Source CANN's set_env.sh (legacy ascend-toolkit layout, or the CANN >= 8.5 layout), then run the command.
set -e
for f in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/cann/set_env.sh; do
  if [ -f "$f" ]; then
    # shellcheck disable=SC1090
    source "$f"
    break
  fi
done
if [ -z "${ASCEND_HOME_PATH:-}${ASCEND_TOOLKIT_HOME:-}" ]; then
  echo "entrypoint: CANN set_env.sh not found under /usr/local/Ascend; torch_npu will not load" >&2
fi
exec "$@"
