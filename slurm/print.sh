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
