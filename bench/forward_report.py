"""The forward section's markdown (`python -m bench.forward`, and the `forward` section of `python -m bench`'s
report): plain formatting of the measured dict, no torch, so the report and its tests stay light."""

from __future__ import annotations

PARTS = ("matmul", "attention", "other", "host")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _part(row: dict, part: str) -> str:
    seconds = row[f"{part}_seconds"]
    return f"{_ms(seconds)} ({seconds / row['seconds']:.0%})" if row["seconds"] else _ms(seconds)


def _find(fmt: dict, rows: int, width: int) -> dict | None:
    return next((r for r in fmt["rows"] if r["rows"] == rows and r["width"] == width), None)


def forward_table(result: dict) -> str:
    lines = [
        "| format | rows | width | tokens | ms | x width 1 | ms/token | matmul | (LM head) | attention | other | "
        "host | bound ms | x bound | weight passes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fmt in result["formats"]:
        bound = fmt["bound_seconds"]
        for row in fmt["rows"]:
            ratio = f"{row['vs_width_1']:.2f}x" if row.get("vs_width_1") else "-"
            lines.append(
                f"| {fmt['format']} | {row['rows']} | {row['width']} | {row['tokens']} | {_ms(row['seconds'])} | "
                f"{ratio} | {_ms(row['seconds'] / row['tokens'])} | "
                + " | ".join(_part(row, p) for p in ("matmul", "lm_head", "attention", "other", "host"))
                + f" | {_ms(bound)} | {row['seconds'] / bound:.1f}x | {row['weight_passes']} |"
            )
    return "\n".join(lines)


def format_summary(fmt: dict) -> str:
    """One line per format: the widest measured width against width 1 on one row, and the shares at width 1."""
    one = [r for r in fmt["rows"] if r["rows"] == min(x["rows"] for x in fmt["rows"])]
    first = _find(fmt, one[0]["rows"], min(r["width"] for r in one))
    widest = max(one, key=lambda r: r["width"])
    assert first is not None
    shares = ", ".join(f"{p} {first[f'{p}_seconds'] / first['seconds']:.0%}" for p in PARTS)
    return (
        f"`{fmt['format']}` ({fmt['what']}; {fmt['dtype']}, attention `{fmt['attention']}`, executor `{fmt.get('executor', 'eager')}`): "
        f"{fmt['weight_bytes'] / 1e6:.0f} MB of weights a forward (LM head {fmt['head_bytes'] / 1e6:.0f} MB), "
        f"bound {_ms(fmt['bound_seconds'])} ms; {first['rows']} row: width {first['width']} "
        f"{_ms(first['seconds'])} ms ({first['seconds'] / fmt['bound_seconds']:.1f}x the bound; {shares}), "
        f"width {widest['width']} {widest['seconds'] / first['seconds']:.2f}x it."
    )


def forward_markdown(result: dict | None) -> list[str]:
    """The section's lines (empty when the run did not measure it)."""
    if not result or not result.get("formats"):
        return []
    bw = result["bandwidth"]
    lines = [
        "## The target forward by width, rows and weight format (`python -m bench.forward`)",
        "",
        f"{result['model']}; {result['threads']} torch thread(s); memory read {bw['read_bytes_per_s'] / 1e9:.1f} "
        f"GB/s, copy {bw['copy_bytes_per_s'] / 1e9:.1f} GB/s ({bw['array_mib']} MiB arrays, best of "
        f"{bw['repeats']}, before and after the forwards); {result['context']} tokens of context a row (several rows: ragged around it); "
        f"median of {result['repeats']} forwards a shape, split by the torch profiler over "
        f"{result['profile_repeats']}; `--dtype auto` serves dense weights in {result['served_dtype']} here "
        f"(native bf16: {'yes' if result['native_bf16'] else 'no'}); measured in {result['wall_seconds']:.0f} s.",
        "",
        "ms: median wall time of one `BatchKV.forward` (logits for every fed position); matmul / attention / "
        "other: operator self time per forward; (LM head): the vocabulary projection's operators, part of "
        "matmul (and of other: a cast); host: the wall time less all operators' (Python, dispatch); bound: the "
        "weights' bytes read once over the read bandwidth; weight passes: reads of the weights as the engine "
        "runs them (bf16: one per 32-row block).",
        "",
        *[f"- {format_summary(fmt)}" for fmt in result["formats"]],
        "",
        forward_table(result),
    ]
    return lines
