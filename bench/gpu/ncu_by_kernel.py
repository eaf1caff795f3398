"""Sums ncu's per-kernel durations by kernel name: python3 ncu_by_kernel.py ncu.csv (from
ncu --metrics gpu__time_duration.sum --csv --print-units base ...)."""
import collections
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if 'Kernel Name' in r)
h = rows[head]
name_col, metric_col, value_col = h.index('Kernel Name'), h.index('Metric Name'), h.index('Metric Value')
total, count = collections.defaultdict(float), collections.Counter()
for r in rows[head + 1:]:
    if len(r) > value_col and r[metric_col] == 'gpu__time_duration.sum':
        name = r[name_col].split('(')[0][:90]
        total[name] += float(r[value_col].replace(',', '')) / 1e6
        count[name] += 1
all_ms = sum(total.values())
print(f"total {all_ms:.2f} ms over {sum(count.values())} kernels")
for name, ms in sorted(total.items(), key=lambda x: -x[1])[:28]:
    print(f"{ms:9.3f} ms {100 * ms / all_ms:5.1f}% {count[name]:5d}  {name}")
