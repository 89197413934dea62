"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed).

* ``latency_cdfs.png`` — CDFs of TTFT, TPOT, ITL and end-to-end latency, one line per run;
* ``rate_sweep.png`` — output throughput and p99 TPOT against the request rate, one line
  per speculation setting;
* ``acceptance_per_position.png`` — the fraction of drafts whose token at each position
  was accepted, per speculation setting;
* ``spec_sweep.png`` — speedup over speculation off against k, per drafter and concurrency.
"""
from __future__ import annotations

import math
from pathlib import Path


def _pyplot():
    import matplotlib  # lazy: matplotlib, only to draw plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above

    return plt


def plot_serving(runs: list[dict], out_dir: str | Path) -> list[Path]:
    """Every plot the serving runs support; returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [latency_cdfs(runs, out_dir / "latency_cdfs.png")]
    if len({r["request_rate"] for r in runs}) > 1:
        written.append(rate_sweep(runs, out_dir / "rate_sweep.png"))
    if any(r.get("spec_decode_per_position_acceptance_rates") for r in runs):
        written.append(acceptance_per_position(runs, out_dir / "acceptance_per_position.png"))
    return written


def _detail(run: dict) -> dict:
    return run.get("_detail") or run  # per-request lists, kept aside or saved in the run


def latency_cdfs(runs: list[dict], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for run in runs:
        d = _detail(run)
        ok = [i for i, e in enumerate(d["errors"]) if not e]
        ttft = [d["ttfts"][i] * 1000 for i in ok]
        e2el = [d["latencies"][i] * 1000 for i in ok]
        tpot = [(d["latencies"][i] - d["ttfts"][i]) * 1000 / (d["output_lens"][i] - 1)
                for i in ok if d["output_lens"][i] > 1]
        itl = [gap * 1000 for i in ok for gap in d["itls"][i]]
        for ax, values in zip(axes.flat, (ttft, tpot, itl, e2el)):
            if values:
                values = sorted(values)
                ax.step(values, [(j + 1) / len(values) for j in range(len(values))], where="post",
                        label=run.get("label") or "run")
    for ax, title in zip(axes.flat, ("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "End-to-end latency (ms)")):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if "ITL" not in title else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(_title(runs, "Latency CDFs"))
    return _save(fig, path)


def rate_sweep(runs: list[dict], path: Path) -> Path:
    """Rates on a categorical axis so inf has a place."""
    plt = _pyplot()
    rates = sorted({r["request_rate"] for r in runs}, key=lambda x: math.inf if x == "inf" else x)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r.get("speculation", "") for r in runs):
        mine = {r["request_rate"]: r for r in runs if r.get("speculation", "") == name}
        xs = [i for i, rate in enumerate(rates) if rate in mine]
        left.plot(xs, [mine[rates[i]]["output_throughput"] for i in xs], marker="o", label=name or "run")
        right.plot(xs, [mine[rates[i]]["p99_tpot_ms"] for i in xs], marker="o", label=name or "run")
    for ax, label in ((left, "output throughput (tokens/s)"), (right, "p99 TPOT (ms)")):
        ax.set_xticks(range(len(rates)), [str(r) for r in rates])
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(_title(runs, "Throughput and p99 TPOT vs request rate"))
    return _save(fig, path)


def acceptance_per_position(runs: list[dict], path: Path) -> Path:
    """One bar group per setting, pooled over its runs (weighted by drafts)."""
    plt = _pyplot()
    pooled: dict[str, list[float]] = {}
    drafts: dict[str, float] = {}
    for r in runs:
        rates = r.get("spec_decode_per_position_acceptance_rates")
        if not rates:
            continue
        name = r.get("speculation") or r.get("label") or "run"
        n = r["spec_decode_num_drafts"]
        acc = pooled.setdefault(name, [])
        acc.extend([0.0] * (len(rates) - len(acc)))
        for j, rate in enumerate(rates):
            acc[j] += rate * n
        drafts[name] = drafts.get(name, 0) + n
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(pooled))
    for g, (name, acc) in enumerate(pooled.items()):
        xs = [j + 1 + (g - (len(pooled) - 1) / 2) * width for j in range(len(acc))]
        ax.bar(xs, [a / drafts[name] for a in acc], width=width, label=name)
    ax.set_xticks(range(1, 1 + max((len(a) for a in pooled.values()), default=0)))
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of drafts accepted there")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.suptitle(_title(runs, "Acceptance per position"))
    return _save(fig, path)


def spec_sweep_plot(rows: list[dict], path: str | Path) -> Path:
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for level in dict.fromkeys(r["concurrency"] for r in rows):
        for drafter in dict.fromkeys(r["drafter"] for r in rows if r["drafter"] != "off"):
            mine = [r for r in rows if r["concurrency"] == level and r["drafter"] == drafter]
            ax.plot([r["k"] for r in mine], [r["speedup"] for r in mine], marker="o",
                    label=f"{drafter}, concurrency {level}")
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_xticks(sorted({r["k"] for r in rows if r["k"]}))
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("speedup over speculation off")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle("Speculation sweep: output tokens/s relative to speculation off")
    return _save(fig, path)


def _title(runs: list[dict], what: str) -> str:
    first = runs[0] if runs else {}
    model = Path(str(first.get("model_id", ""))).name
    return f"{what}{' — ' + model if model else ''}"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt  # lazy: as in _pyplot

    plt.close(fig)
    return path
