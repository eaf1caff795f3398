#!/bin/sh
# plot_loss.sh: the loss curve of a train_gpt run as a PNG, from its --log-json file.
#
#   examples/plot_loss.sh run.jsonl loss.png ["title"]
#
# Plots the training loss of every step (light), its centred mean over 51 steps, and the validation loss at
# the steps that evaluated (points), in nats per token. Needs gnuplot (Debian: apt-get install gnuplot-nox).
set -eu
if [ $# -lt 2 ]; then
  echo "usage: $0 LOG.jsonl OUT.png [TITLE]" >&2
  exit 2
fi
log=$1
out=$2
title=${3:-train_gpt}
command -v gnuplot >/dev/null || { echo "plot_loss.sh: gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
[ -s "$log" ] || { echo "plot_loss.sh: $log is missing or empty" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# train_gpt writes one flat JSON object per line with numeric values: pull the fields out with sed.
# Steps are 0-based in the log; the plot counts optimizer steps done (step + 1).
sed -n 's/.*"step":\([0-9]*\),"loss":\([-+0-9.eE]*\),.*/\1 \2/p' "$log" | awk '{print $1 + 1, $2}' > "$tmp/train.dat"
grep '"val_loss"' "$log" | sed -n 's/.*"step":\([0-9]*\),.*"val_loss":\([-+0-9.eE]*\).*/\1 \2/p' |
  awk '{print $1 + 1, $2}' > "$tmp/val.dat"
[ -s "$tmp/train.dat" ] || { echo "plot_loss.sh: no training steps found in $log" >&2; exit 1; }
# Centred mean of the training loss over 51 steps (fewer at the ends), so the curve does not lag.
awk '{ x[NR] = $1; y[NR] = $2 }
     END { for (i = 1; i <= NR; ++i) { s = 0; n = 0
             for (j = i - 25; j <= i + 25; ++j) if (j >= 1 && j <= NR) { s += y[j]; ++n }
             print x[i], s / n } }' "$tmp/train.dat" > "$tmp/mean.dat"
final_val=$(tail -n 1 "$tmp/val.dat" | awk '{printf "%.4f", $2}')

gnuplot <<EOF
set terminal pngcairo size 900,540 font "sans,11"
set output "$out.tmp"
set title "$title"
set xlabel "step"
set ylabel "loss (nats per token)"
set grid
set key top right
set yrange [*:*]
plot "$tmp/train.dat" using 1:2 with lines lc rgb "#c8d7ee" title "training loss (batch)", \
     "$tmp/mean.dat" using 1:2 with lines lw 2 lc rgb "#1f5fbf" title "training loss (centred mean of 51 steps)", \
     "$tmp/val.dat" using 1:2 with linespoints pt 7 ps 0.9 lw 2 lc rgb "#d9480f" title "validation loss${final_val:+ (final $final_val)}"
EOF
mv "$out.tmp" "$out"  # complete or absent, never half-written
echo "plot_loss.sh: wrote $out"
