#!/usr/bin/env bash
# A checkpoint save killed at any moment leaves nothing behind but the checkpoint, which still loads.
#
# Runs `train_gpt --save-every 1` (a small model saving a checkpoint every step) in a fresh directory and
# kills it with SIGKILL at a random moment after its first save, KILLS times. After each kill it lists the
# files other than the checkpoint (a save's temp file caught between its write and its rename) and checks
# that the checkpoint loads (`generate --tokens 1`). After the last kill one more run saves once: the
# directory must then hold the checkpoint alone (a save removes the temp files that killed runs left).
#
#   tests/kill_during_save.sh --train-gpt build/examples/train_gpt --generate build/examples/generate \
#       [--data /work/shared/data/tinyshakespeare.txt] [--kills 30] [--work DIR]
#
# Without --data it trains on a generated text of 200 kB.
# Prints one line per kill and a summary ("N of KILLS kills left a file"); exits 1 when a file is left at
# the end or a checkpoint does not load, 2 on a usage error.
set -u

kills=30
train_gpt="" generate="" data="" work=""
while [ $# -gt 0 ]; do
  case "$1" in
    --kills) kills="$2"; shift 2 ;;
    --train-gpt) train_gpt="$2"; shift 2 ;;
    --generate) generate="$2"; shift 2 ;;
    --data) data="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    *) echo "kill_during_save.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
if [ -z "$train_gpt" ] || [ -z "$generate" ]; then
  echo "kill_during_save.sh: --train-gpt and --generate are required" >&2
  exit 2
fi
train_gpt=$(realpath "$train_gpt") generate=$(realpath "$generate")
if [ -z "$work" ]; then work=$(mktemp -d "${TMPDIR:-/tmp}/kill_during_save.XXXXXX"); fi
rm -rf "$work" && mkdir -p "$work/ckpt" || exit 2
if [ -z "$data" ]; then
  data="$work/text.txt"
  yes "the quick brown fox jumps over the lazy dog; a checkpoint is saved at every step." |
    head -c 200000 > "$data"
fi
data=$(realpath "$data")
cd "$work/ckpt" || exit 2
export OMP_NUM_THREADS=1

ckpt=ckpt.safetensors
model=(--layers 1 --heads 2 --width 32 --block 32 --batch 4 --eval-every 0 --no-final-eval)
failures=0
left_after_kill=0

# The files of the directory other than the checkpoint, one a line, sorted.
others() { find . -mindepth 1 ! -name "$ckpt" -printf '%f\n' | sort; }
inode() { stat -c %i "$ckpt" 2>/dev/null || echo none; }

for ((kill_number = 1; kill_number <= kills; kill_number++)); do
  before=$(inode)
  others_before=$(others)
  "$train_gpt" --data "$data" "${model[@]}" --steps 100000 --save-every 1 --save "$ckpt" \
      > "$work/run.out" 2>&1 &
  pid=$!
  # Its first save gives the checkpoint a new inode (each save renames a new file over it).
  for ((wait = 0; wait < 6000; wait++)); do
    [ "$(inode)" != "$before" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.01
  done
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "kill $kill_number: train_gpt ended before it could be killed:" >&2
    cat "$work/run.out" >&2
    exit 1
  fi
  sleep "$(printf '0.%03d' $((RANDOM % 100)))"  # 0 to 99 ms: up to some 40 saves later, inside one or not
  kill -9 "$pid"
  wait "$pid" 2>/dev/null
  # What this run left: the files that were not there before it.
  left=$(comm -13 <(echo "$others_before") <(others) | tr '\n' ' ' | sed 's/^ *//; s/ *$//')
  loads=yes
  if [ -e "$ckpt" ] && ! "$generate" --model "$ckpt" --tokens 1 > "$work/generate.out" 2>&1; then
    loads=NO
    failures=$((failures + 1))
    cat "$work/generate.out" >&2
  fi
  [ -n "$left" ] && left_after_kill=$((left_after_kill + 1))
  echo "kill $kill_number: left [${left}], checkpoint loads: $loads"
done

# One more run, saving once: the temp files of killed runs go, the checkpoint stays.
"$train_gpt" --data "$data" "${model[@]}" --steps 1 --save "$ckpt" > "$work/run.out" 2>&1 || {
  cat "$work/run.out" >&2
  failures=$((failures + 1))
}
at_end=$(others | tr '\n' ' ' | sed 's/ *$//')
echo "$left_after_kill of $kills kills left a file; after one more save the directory holds" \
     "[$(ls -A | tr '\n' ' ' | sed 's/ *$//')]"
if [ -n "$at_end" ]; then
  echo "kill_during_save.sh: files left besides the checkpoint: $at_end" >&2
  failures=$((failures + 1))
fi
[ "$failures" -eq 0 ] && rm -rf "$work"
[ "$failures" -eq 0 ]
