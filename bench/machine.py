"""Which machine and software produced the figures, and the command that reproduces them."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from service.cost_cache import cpu_name

REPO = Path(__file__).resolve().parent.parent


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{rev}{' (uncommitted changes)' if dirty else ''}" if rev else "unknown"


def describe(device: str = "cpu") -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    info = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "os": f"{platform.system()} {platform.release()}",
        "git": git_revision(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def one_line(info: dict) -> str:
    return (
        f"{info['cpu']}, {info['usable_cores']} cores, torch {info['torch']} ({info['torch_threads']} threads), "
        f"transformers {info['transformers']}, Python {info['python']}, load average at start "
        f"{info['load_average'][0] if info['load_average'] else '?'}, commit {info['git']}"
    )


def reproduce_command(argv: list[str]) -> str:
    return f"cd {shlex.quote(str(REPO))} && HF_HUB_OFFLINE=1 {shlex.quote(sys.executable)} -m bench {shlex.join(argv)}".rstrip()


def module_command(module: str, argv: list[str]) -> str:
    """The command that reproduces `python -m <module> <argv>` from anywhere."""
    return (
        f"cd {shlex.quote(str(REPO))} && HF_HUB_OFFLINE=1 {shlex.quote(sys.executable)} -m {module} "
        f"{shlex.join(argv)}"
    ).rstrip()


def start_run(module: str, argv: list[str], threads: int) -> tuple[str, str]:
    """What a standalone bench does before it measures: offline, transformers quiet, `threads` torch threads;
    prints and returns (the command that reproduces the run, the machine line: CPU, kernels, software)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from service.executor.cpu_kernels import simd_summary

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(threads)
    command = module_command(module, argv)
    machine = f"{one_line(describe())}; cpu flags: {simd_summary()}"
    print(f"reproduce: {command}", file=sys.stderr)
    print(f"machine:   {machine}", file=sys.stderr, flush=True)
    return command, machine


def write_run(name: str, out: Path | None, result: dict, report: list[str], started) -> Path:
    """A standalone bench's result as `<name>.json` and `<name>.md` (command, machine, `report`) in `out`
    (default bench/results/<name>-<started>), the report printed; returns the folder."""
    out = out or REPO / "bench" / "results" / f"{name}-{started.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    text = "\n".join(
        [f"Command: `{result['command']}`", "", f"Machine: {result['machine_line']}", "", *report, ""]
    )
    (out / f"{name}.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"wall time {result['wall_seconds']:.0f} s; report in {out}", file=sys.stderr)
    return out
