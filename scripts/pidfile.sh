# Sourced by ui.sh, stop.sh and clean.sh: the pid files `make ui` writes ($var/airflow.pid, $var/mlflow.pid).
# A pid alone names whatever program holds that number now: after a reboot, another program's, and `make ui` refused
# for ever ("already running") while `make stop` would have signalled it. So the file holds the pid, then the
# process's start (/proc/<pid>/stat field 22, clock ticks since boot) and the boot (/proc/sys/kernel/random/boot_id);
# the process counts as the recorded one only while both still match. A file holding only a pid (an older ui.sh's, or
# written by hand) counts when its process started no later than the file was written (a reused pid started later).

_pid_stat() {  # pid -> "STATE START" from /proc/<pid>/stat, or fails
  local stat f
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  read -r -a f <<< "${stat##*) }"  # fields 3… (the command name, field 2, may hold spaces and parentheses)
  [[ "${f[19]:-}" =~ ^[0-9]+$ ]] || return 1
  echo "${f[0]} ${f[19]}"
}

_boot_id() { cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo -; }

pid_write() {  # file pid: what ui.sh records for a process it just started
  local st
  st=$(_pid_stat "$2") || st="- -"
  printf '%s\n%s %s\n' "$2" "${st#* }" "$(_boot_id)" > "$1"
}

_pid_read() {  # file: sets pid_of (line 1, a number) and pid_rec (line 2: "START BOOT", or nothing)
  pid_of="" pid_rec=""
  [ -f "$1" ] || return 1
  { IFS= read -r pid_of; IFS= read -r pid_rec; } < "$1" 2>/dev/null || true  # a last line may lack its newline
  [[ "$pid_of" =~ ^[0-9]+$ ]]
}

_pid_recorded() {  # file start: the process of pid_of, started at START (ticks since boot), is the one recorded
  local rec_start rec_boot btime tck mtime
  if [ -n "$pid_rec" ]; then
    read -r rec_start rec_boot <<< "$pid_rec"
    [ "$rec_start" = "$2" ] && [ "$rec_boot" = "$(_boot_id)" ]
    return
  fi
  btime=$(awk '$1 == "btime" {print $2}' /proc/stat)
  tck=$(getconf CLK_TCK)
  mtime=$(stat -c %Y "$1" 2>/dev/null)
  [[ "$btime" =~ ^[0-9]+$ && "$tck" =~ ^[0-9]+$ && "$mtime" =~ ^[0-9]+$ ]] || return 1
  ((btime + $2 / tck <= mtime + 2))  # 2 s: btime is rounded, and drifts
}

pid_live() {  # file: true when the file names a running (not zombie) process that is the one recorded; sets pid_of
  local st
  _pid_read "$1" || return 1
  if [ ! -r /proc/self/stat ]; then  # no /proc (not Linux): the pid is all there is
    ps -o stat= -p "$pid_of" 2>/dev/null | grep -qv '^Z'
    return
  fi
  st=$(_pid_stat "$pid_of") || return 1
  case "${st%% *}" in Z | X) return 1 ;; esac
  _pid_recorded "$1" "${st#* }"
}

pid_group_left() {  # file: the recorded process has exited (or is a zombie) but its group (ui.sh setsid's each) lives on
  local st rec_boot
  _pid_read "$1" && [ -r /proc/self/stat ] || return 1
  if st=$(_pid_stat "$pid_of"); then  # still there: only as the recorded process's zombie
    [ "${st%% *}" = Z ] && _pid_recorded "$1" "${st#* }" || return 1
  else  # gone: the group is ours on the same boot (the kernel hands out no pid a group still bears)
    rec_boot="${pid_rec#* }"
    [ -n "$pid_rec" ] && [ "$rec_boot" != - ] && [ "$rec_boot" = "$(_boot_id)" ] || return 1
  fi
  ps -eo pgid=,stat= | awk -v g="$pid_of" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'
}
