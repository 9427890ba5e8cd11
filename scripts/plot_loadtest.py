#!/usr/bin/env python3
"""Chart for scripts/loadtest: throughput and p99 latency vs connections.

    .venv/bin/python scripts/plot_loadtest.py [docs/loadtest-results.json] [docs/img/loadtest.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="?", type=Path, default=ROOT / "docs" / "loadtest-results.json",
                   help="scripts/loadtest's JSON (default: docs/loadtest-results.json)")
    p.add_argument("chart", nargs="?", type=Path, default=ROOT / "docs" / "img" / "loadtest.png",
                   help="the PNG to write (default: docs/img/loadtest.png)")
    args = p.parse_args()
    src, dst = args.results, args.chart
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: .venv/bin/pip install matplotlib", file=sys.stderr)
        return 1
    res = json.loads(src.read_text())
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(12, 4.8))
    conns = sorted({lv["connections"] for run in res["runs"] for lv in run["levels"]})
    for run in res["runs"]:
        lv = sorted(run["levels"], key=lambda x: x["connections"])
        xs = [x["connections"] for x in lv]
        ax_t.plot(xs, [x.get("texts_per_s") or 0 for x in lv], marker="o", label=run["label"])
        ax_l.plot(xs, [x["p99_ms"] for x in lv], marker="o", label=run["label"])
    model = res.get("model") or {}
    if model.get("best"):
        b = model["best"]
        ax_t.axhline(b["texts_per_s"], color="black", linestyle="--", linewidth=1,
                     label=f"model alone, in-process (batch {b['batch_size']})")
    peer = res.get("peer") or {}
    if peer.get("best"):
        ax_t.axhline(peer["best"]["texts_per_s"], color="grey", linestyle=":", linewidth=1.5,
                     label=f"sentence-transformers, torch CPU (batch {peer['best']['batch_size']})")
    for ax in (ax_t, ax_l):
        ax.set_xscale("log")
        ax.set_xticks(conns)
        ax.set_xticklabels([str(c) for c in conns])
        ax.minorticks_off()
        ax.set_xlabel("wrk connections (2 texts per request)")
        ax.grid(True, alpha=0.3)
    ax_t.set_ylabel("texts/s")
    ax_t.set_ylim(bottom=0)
    ax_t.set_title("Throughput")
    ax_l.set_yscale("log")
    ax_l.set_ylabel("p99 latency (ms, log scale)")
    ax_l.set_title("p99 latency")
    ax_t.legend(fontsize=8, loc="lower right")
    ax_l.legend(fontsize=8, loc="upper left")
    m = res["machine"]
    title = f"mlx-embed under wrk: {m.get('nproc')} cores, {m.get('cpu', '')}"
    if res.get("kind") != "full":
        title = f"SMOKE RUN ({res['duration_s']} s per level, not the benchmark) - " + title
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
