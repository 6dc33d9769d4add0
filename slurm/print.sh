# shellcheck shell=bash
# Printing commands for DRY_RUN (sourced by common.sh and torchrun_node.sh, so both print alike).

# Shell-quote an argument only where needed, so printed lines stay readable and can be pasted into a shell.
_quote() {
  if [[ -n $1 && $1 =~ ^[A-Za-z0-9_./:=,@%+-]*$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# _line WHERE ARGS...: prints "[WHERE] arg arg ...": WHERE is "batch" (the batch shell) or a node name.
_line() {
  local where="$1" out a
  shift
  out="[$where]"
  for a in "$@"; do out+=" $(_quote "$a")"; done
  printf '%s\n' "$out"
}

# _show WHERE ARGS...: _line for a command the job runs (or, under DRY_RUN=1, would run): printed under
# DRY_RUN=1 instead of running it, and under SHOW_COMMANDS=1 (a rehearsal, slurm/rehearse.sh) just before
# running it, so a rehearsal's log holds the same lines as the dry run's output. SHOW_COMMANDS_LOG: a file on the
# shared filesystem that gets the same lines, whole: in the job's log, srun passes each task's output on in
# pieces of at most 1 KiB, and a long line from one node can be cut by another node's output.
_show() {
  if [[ ${DRY_RUN:-0} == 1 || ${SHOW_COMMANDS:-0} == 1 ]]; then _line "$@"; fi
  if [[ ${SHOW_COMMANDS:-0} == 1 && -n ${SHOW_COMMANDS_LOG:-} ]]; then _line "$@" >>"$SHOW_COMMANDS_LOG"; fi
}
