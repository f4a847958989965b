#!/usr/bin/env python3
"""Plot a ladder.tsv written by `k3-orch ladder`: s/token and GB read per token against the
total budget, one point per rung."""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
x = [float(r["total_gb"]) for r in rows]
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(x, [float(r["s_per_token"]) for r in rows], "o-", label="s/token")
ax.set_xlabel("total budget (GB)")
ax.set_ylabel("s/token")
ax2 = ax.twinx()
ax2.plot(x, [float(r["gb_read_per_token"]) for r in rows], "s--", color="tab:orange", label="GB read/token")
ax2.set_ylabel("GB read per token")
ax.set_title("k3 memory ladder (same ids on every rung)")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=120)
print(f"wrote {sys.argv[2]}")
