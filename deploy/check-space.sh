#!/usr/bin/env bash
# Before `make venv` installs: is there room? The environment (torch with the CUDA libraries PyPI's
# wheels bring, FATE, FATE-LLM, transformers) takes about 6.5 GiB, and pip unpacks the wheels in TMPDIR
# on the way. A full disk otherwise shows up minutes later as pip's "OSError: [Errno 28]".
#
#   deploy/check-space.sh VENV_DIR      exit 1, naming the file system and what it lacks, below 7 GiB free
set -euo pipefail

need_gib=7
warn_gib=10
target=$(realpath -m -- "${1:-.venv}")
while [ ! -d "$target" ]; do target=$(dirname -- "$target"); done  # the nearest folder that exists
tmp=${TMPDIR:-/tmp}

free_gib() { df -Pk -- "$1" | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }'; }
fs() { df -Pk -- "$1" | awk 'NR == 2 { print $6 }'; }

have=$(free_gib "$target")
if [ "$(fs "$target")" = "$(fs "$tmp")" ]; then
  where="$target (and TMPDIR $tmp, the same file system)"
else
  where="$target"
  tmp_have=$(free_gib "$tmp")
  if awk -v h="$tmp_have" 'BEGIN { exit !(h < 2) }'; then
    echo "check-space: TMPDIR $tmp has $tmp_have GiB free; pip unpacks wheels of up to ~1 GiB there: set TMPDIR to a folder with room" >&2
    exit 1
  fi
fi
if awk -v h="$have" -v n="$need_gib" 'BEGIN { exit !(h < n) }'; then
  echo "check-space: $where has $have GiB free; the environment needs about $need_gib GiB (torch and its CUDA libraries ~4 GiB of it)." >&2
  echo "  Free some space (old clones' .venv folders, pip's cache) or put the environment elsewhere: make VENV=/path/with/room/.venv" >&2
  exit 1
fi
if awk -v h="$have" -v n="$warn_gib" 'BEGIN { exit !(h < n) }'; then
  echo "check-space: $where has $have GiB free: enough for the environment (~6.5 GiB), little beyond it" >&2
fi
