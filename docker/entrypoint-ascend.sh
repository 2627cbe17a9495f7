#!/usr/bin/env bash
# Source CANN's set_env.sh (legacy ascend-toolkit layout, the CANN >= 8.5 layout, or a versioned
# /usr/local/Ascend/cann-<version>/ install, newest first), then run the command.
# ASCEND_INSTALL_ROOT (default /usr/local/Ascend) only moves where to look.
set -e
root="${ASCEND_INSTALL_ROOT:-/usr/local/Ascend}"
for f in "$root/ascend-toolkit/set_env.sh" "$root/cann/set_env.sh" \
         $(ls -d "$root"/cann-*/set_env.sh 2>/dev/null | sort -rV); do
  if [ -f "$f" ]; then
    # shellcheck disable=SC1090
    source "$f"
    break
  fi
done
if [ -z "${ASCEND_HOME_PATH:-}${ASCEND_TOOLKIT_HOME:-}" ]; then
  echo "entrypoint: CANN set_env.sh not found under $root; torch_npu will not load" >&2
fi
exec "$@"
