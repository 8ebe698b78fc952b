"""PNG plots of a benchmark report (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402


def speedup_per_workload(report: dict, path: Path) -> None:
    workloads = list(report["workloads"])
    methods = [m["label"] for m in report["methods"] if m["label"] != "vanilla"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads) + 2), 4.2))
    width = 0.8 / max(1, len(methods))
    for j, method in enumerate(methods):
        values = [report["workloads"][w]["methods"][method]["speedup"] or 0 for w in workloads]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(workloads))]
        ax.bar(xs, values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("speedup over vanilla (tokens/s ratio)")
    ax.set_title("Speedup per workload")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def acceptance_histogram(report: dict, path: Path) -> None:
    histograms = report["acceptance_histograms"]
    methods = list(histograms)
    sizes = list(range(report["config"]["num_speculative_tokens"] + 1))
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / max(1, len(methods))
    for j, method in enumerate(methods):
        h = {int(n): c for n, c in histograms[method]["drafted_rounds"].items()}
        drafted = sum(h.values())
        undrafted = histograms[method]["undrafted_rounds"]
        share_undrafted = undrafted / (drafted + undrafted) if drafted + undrafted else 0.0
        xs = [n + (j - (len(methods) - 1) / 2) * width for n in sizes]
        ax.bar(
            xs,
            [h.get(n, 0) / (drafted or 1) for n in sizes],
            width,
            label=f"{method} ({share_undrafted:.0%} of forwards had no draft)",
        )
    ax.set_xticks(sizes)
    ax.set_xlabel("draft tokens kept (accepted + rescued) in a round that carried a draft")
    ax.set_ylabel("share of drafted rounds")
    ax.set_title("Acceptance length, all workloads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep_heatmaps(report: dict, path: Path) -> None:
    sweep = report["sweep"]
    taus, lambdas = sweep["taus"], sweep["lambdas"]
    drafter = sweep["drafters"][-1]  # the last: the head's combined drafter when there is a head
    by_point = {
        (p["tau"], p["lambda"]): p
        for p in sweep["points"]
        if p["drafter"] == drafter and p.get("guarded", True)
    }
    panels = [
        ("tokens_per_forward", "tokens per target forward", "{:.2f}"),
        ("length_ratio", "output length / vanilla's", "{:.0%}"),
        ("similarity", "similarity to vanilla", "{:.3f}"),
        ("exact_match", "outputs equal to vanilla's", "{:.0%}"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, (key, title, fmt) in zip(axes.flat, panels, strict=True):
        grid = [[by_point[(t, lam)][key] for t in taus] for lam in lambdas]
        values = [[v if v is not None else float("nan") for v in row] for row in grid]
        image = ax.imshow(values, cmap="viridis", aspect="auto", origin="lower")
        for yi, row in enumerate(grid):
            for xi, v in enumerate(row):
                if v is not None:
                    ax.text(xi, yi, fmt.format(v), ha="center", va="center", color="white", fontsize=8)
        ax.set_xticks(range(len(taus)), [str(t) for t in taus])
        ax.set_yticks(range(len(lambdas)), [f"{lam:g}" for lam in lambdas])
        ax.set_xlabel("tau")
        ax.set_ylabel("lambda")
        ax.set_title(title)
        fig.colorbar(image, ax=ax)
    fig.suptitle(
        f"Guarded CSD ({drafter} drafter): tau / lambda sweep ({len(sweep['prompts'])} held-out calibration prompts)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rolling(values: list[float | None], window: int) -> list[float | None]:
    out: list[float | None] = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1) : i + 1] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else None)
    return out


def online_learning(report: dict, path: Path) -> None:
    replay = report["replay"]
    requests = replay["requests"]
    xs = [r["request"] for r in requests]
    window = max(3, replay["prompts"] // 3)
    references = report.get("replay_references", {})
    panels = [
        ("kept_rate", "kept rate\n(accepted + rescued)", references.get("sd_kept_rate"), "sd (grounded)"),
        ("rescue_rate", "rescue rate", None, None),
        ("tokens_per_second", "tokens/s", references.get("vanilla_tokens_per_second"), "vanilla (grounded)"),
    ]
    fig, axes = plt.subplots(4, 1, figsize=(8, 10), sharex=True)

    def nan(values: list) -> list[float]:
        return [v if v is not None else float("nan") for v in values]

    for ax, (key, label, reference, reference_label) in zip(axes, panels, strict=False):
        ys = [r[key] for r in requests]
        ax.plot(xs, nan(ys), ".", alpha=0.35, label="per request")
        ax.plot(xs, nan(_rolling(ys, window)), "-", label=f"mean of last {window}")
        if f"cumulative_{key}" in requests[0]:
            ax.plot(xs, nan([r[f"cumulative_{key}"] for r in requests]), "-", label="all requests so far")
        if reference is not None:
            ax.axhline(reference, color="grey", linestyle="--", linewidth=0.8, label=reference_label)
        ax.set_ylabel(label)
    memory = axes[3]
    memory.plot(xs, [r["patterns"] for r in requests], "-", label="distinct patterns")
    memory.plot(
        xs, [r.get("patterns_over_lambda", 0) for r in requests], "-", label="seen more than lambda times"
    )
    memory.set_ylabel("OCM patterns")
    for ax in axes:
        for r in requests[1:]:
            if r["pass"] != requests[r["request"] - 2]["pass"]:
                ax.axvline(r["request"] - 0.5, color="black", linewidth=0.5, alpha=0.4)
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("requests served (grounded suite, shuffled, each pass separated by a line)")
    fig.suptitle("Online learning: CSD from an empty OCM")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    written = []
    for name, draw, needs in (
        ("speedup.png", speedup_per_workload, "workloads"),
        ("acceptance_length.png", acceptance_histogram, "acceptance_histograms"),
        ("sweep.png", sweep_heatmaps, "sweep"),
        ("online_learning.png", online_learning, "replay"),
    ):
        if report.get(needs):
            draw(report, out_dir / name)
            written.append(out_dir / name)
    return written
