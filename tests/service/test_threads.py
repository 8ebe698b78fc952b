"""torch's default thread count (service/executor/threads.py): from the CPUs the process may use (affinity mask,
cgroup CPU quota, CPUs other processes leave idle), the governor that follows the idle CPUs while serving,
OpenMP's passive wait set before torch loads where the threads start oversubscribed, and the start-up log
line and oversubscription warning of a real `csd` process.

The cgroup trees are real files in tmp_path laid out as the kernel lays them out (cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us`), since a test cannot set a CPU quota on its own process; busy CPUs are real busy
processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from service.executor.threads import (
    affinity_cpus,
    busy_elsewhere,
    cgroup_cpus,
    choose_threads,
    oversubscription,
    prepare_wait_policy,
)

ROOT = Path(__file__).resolve().parents[2]
SPIN = "while True:\n    pass\n"


def _cgroup_v2(root: Path, path: str, limits: dict[str, str]) -> Path:
    """A v2 hierarchy at root with `cpu.max` files at the given cgroup paths; returns /proc/self/cgroup."""
    for folder, value in limits.items():
        (root / folder.strip("/")).mkdir(parents=True, exist_ok=True)
        (root / folder.strip("/") / "cpu.max").write_text(value + "\n")
    proc = root.parent / "proc-self-cgroup"
    proc.write_text(f"0::{path}\n")
    return proc


# ---------------------------------------------------------------- cgroup quota


@pytest.mark.parametrize(
    ("value", "cpus"),
    [
        ("200000 100000", 2),
        ("150000 100000", 1),
        ("50000 100000", 1),
        ("400000 100000", 4),
        ("max 100000", None),
    ],
)
def test_a_v2_quota_gives_whole_cpus_rounded_down_and_at_least_one(tmp_path, value, cpus):
    proc = _cgroup_v2(tmp_path / "cgroup", "/kubepods/pod/ctr", {"/kubepods/pod/ctr": value})
    assert cgroup_cpus(tmp_path / "cgroup", proc) == cpus


def test_the_tightest_quota_along_the_ancestors_bounds_the_process(tmp_path):
    # Kubernetes sets the pod's limit on the pod cgroup; the container's own may say max
    limits = {
        "/kubepods/pod/ctr": "max 100000",
        "/kubepods/pod": "300000 100000",
        "/kubepods": "800000 100000",
    }
    proc = _cgroup_v2(tmp_path / "cgroup", "/kubepods/pod/ctr", limits)
    assert cgroup_cpus(tmp_path / "cgroup", proc) == 3


def test_a_container_sees_its_own_quota_at_the_mount_point(tmp_path):
    # with a cgroup namespace /proc/self/cgroup says "/", and the limit sits at the mount itself
    proc = _cgroup_v2(tmp_path / "cgroup", "/", {"/": "100000 100000"})
    assert cgroup_cpus(tmp_path / "cgroup", proc) == 1


def test_a_v1_cfs_quota_is_read_where_v2_has_none(tmp_path):
    root = tmp_path / "cgroup"
    folder = root / "cpu,cpuacct" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("250000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n")
    assert cgroup_cpus(root, proc) == 2
    (folder / "cpu.cfs_quota_us").write_text("-1\n")  # no limit
    assert cgroup_cpus(root, proc) is None


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_cpus(tmp_path / "missing", tmp_path / "missing-proc") is None


# ---------------------------------------------------------------- the choice


def test_the_default_is_the_smallest_of_mask_quota_and_idle_cpus(tmp_path):
    mask = affinity_cpus()
    no_quota = _cgroup_v2(tmp_path / "none", "/", {"/": "max 100000"})
    idle = choose_threads(None, tmp_path / "none", no_quota, busy_cpus=0.0)
    assert (idle.threads, idle.source) == (mask, "affinity")
    assert oversubscription(idle) is None
    quota = _cgroup_v2(tmp_path / "one", "/", {"/": "100000 100000"})
    limited = choose_threads(None, tmp_path / "one", quota, busy_cpus=0.0)
    assert limited.threads == 1 and limited.usable_cpus == 1
    if mask > 1:
        assert limited.source == "cgroup"
        # every CPU but one kept busy by other processes: one thread, which no busy process slows
        shared = choose_threads(None, tmp_path / "none", no_quota, busy_cpus=mask - 1.0)
        assert (shared.threads, shared.source) == (1, "idle CPUs")
        assert oversubscription(shared) is None
        assert "busy with other processes" in shared.describe()


def test_an_explicit_count_is_kept_and_oversubscription_is_reported(tmp_path):
    mask = affinity_cpus()
    no_quota = _cgroup_v2(tmp_path / "none", "/", {"/": "max 100000"})
    over = choose_threads(mask + 1, tmp_path / "none", no_quota, busy_cpus=0.0)
    assert (over.threads, over.source) == (mask + 1, "flag")
    assert oversubscription(over) == f"{mask + 1} torch threads on {mask} usable CPUs"
    crowded = choose_threads(mask, tmp_path / "none", no_quota, busy_cpus=1.0)
    assert "other processes keep 1.0" in oversubscription(crowded)
    assert oversubscription(choose_threads(1, tmp_path / "none", no_quota, busy_cpus=0.0)) is None


def test_busy_elsewhere_counts_other_processes_not_this_one():
    """A busy thread of this process is not counted; a busy process beside it is (the difference between
    the two measurements, so whatever else the host runs cancels out)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    own = threading.Thread(target=spin)
    own.start()
    try:
        with_own_work = busy_elsewhere(0.6)
    finally:
        stop.set()
        own.join()
    other = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.2)
        with_other_process = busy_elsewhere(0.6)
    finally:
        other.kill()
        other.wait()
    assert with_own_work is not None and with_other_process is not None
    assert with_other_process - with_own_work > 0.5, (with_own_work, with_other_process)


def test_passive_wait_is_set_only_for_oversubscribed_threads_before_torch_loads():
    code = (
        "import os, sys\n"
        "from service.executor.threads import affinity_cpus, prepare_wait_policy\n"
        "requested = None if sys.argv[1] == 'none' else affinity_cpus() + 1\n"
        "print(prepare_wait_policy(requested), os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}

    def run(requested: str, **extra: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", code, requested],
            cwd=ROOT,
            env={**env, **extra},
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    # the default count fits the idle CPUs: OpenMP keeps its own policy (a short spin, then sleep)
    assert run("none") == ["False", "None"]
    # more threads than CPUs: a waiting thread sleeps
    assert run("more") == ["True", "PASSIVE"]
    assert run("more", OMP_WAIT_POLICY="ACTIVE") == ["False", "ACTIVE"]
    # this process loaded torch long ago: too late to change OpenMP's policy, so it does not pretend to
    assert "torch" in sys.modules and not prepare_wait_policy(10_000)


GOVERNED = """
import os, subprocess, sys, time
import torch
from service.executor.threads import ThreadGovernor, choose_threads

SPIN = "while True:\\n    pass\\n"
choice = choose_threads(None, busy_cpus=0.0)
torch.set_num_threads(choice.threads)
governor = ThreadGovernor(choice, torch.set_num_threads, period_s=0.3)
a = torch.randn(256, 256)


def serve_until(threads, seconds=8.0):
    # the model thread's work between ticks, as rounds of a forward
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and governor.tick() != threads:
        for _ in range(20):
            a @ a
    return torch.get_num_threads()


print("start", torch.get_num_threads())
busy = subprocess.Popen(
    [sys.executable, "-c", SPIN], preexec_fn=lambda: os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
)
try:
    time.sleep(0.2)
    print("beside a busy process", serve_until(1))
finally:
    busy.kill()
    busy.wait()
print("after it ended", serve_until(2))
"""


def test_the_governor_lowers_threads_when_a_competitor_starts_and_raises_them_when_it_ends(two_cpus):
    """A real busy process started after the choice, on one of the process's 2 CPUs: the governor, ticked
    between rounds of real torch work, moves torch to 1 thread, and back to 2 once the CPU is free."""
    if choose_threads(None, busy_cpus=0.0).usable_cpus < 2:
        pytest.skip("a cgroup CPU quota below 2 CPUs")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run(
        [sys.executable, "-c", GOVERNED],
        cwd=ROOT,
        env={**env, "CSD_LOG_LEVEL": "INFO"},
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.sched_setaffinity(0, two_cpus),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["start 2", "beside a busy process 1", "after it ended 2"], out.stderr


# ---------------------------------------------------------------- a real csd process


def _csd_generate(
    *flags: str, cpus: set[int], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("CSD_") or k == "CSD_CACHE_DIR"}
    env = {k: v for k, v in env.items() if k != "OMP_WAIT_POLICY"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CSD_LOG_LEVEL="INFO", **extra)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "service.cli",
            "generate",
            "--max-tokens",
            "2",
            "--method",
            "vanilla",
            *flags,
            "Hi",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )


@pytest.fixture(scope="module")
def two_cpus(embedded) -> set[int]:  # `embedded`: the GGUF is converted before any process needs it
    mask = sorted(os.sched_getaffinity(0))
    if len(mask) < 2:
        pytest.skip("needs 2 CPUs in the affinity mask")
    return set(mask[:2])


def test_csd_logs_its_thread_choice_and_keeps_openmps_wait_where_threads_fit(two_cpus):
    one = {min(two_cpus)}
    out = _csd_generate(cpus=one)
    assert out.returncode == 0, out.stderr
    assert "torch intra-op threads: 1 (from affinity; 1 CPUs in the affinity mask" in out.stderr
    assert "OpenMP wait policy unset" in out.stderr
    assert "CPU oversubscribed" not in out.stderr


def test_csd_takes_fewer_threads_beside_a_busy_process_and_warns_when_told_more(two_cpus):
    busy = subprocess.Popen(
        [sys.executable, "-c", SPIN], preexec_fn=lambda: os.sched_setaffinity(0, {max(two_cpus)})
    )
    try:
        time.sleep(0.3)
        default = _csd_generate(cpus=two_cpus)
        forced = _csd_generate("--torch-threads", "2", cpus=two_cpus)
        forced_by_env = _csd_generate(cpus=two_cpus, env={"CSD_TORCH_THREADS": "2"})
    finally:
        busy.kill()
        busy.wait()
    assert default.returncode == 0 and forced.returncode == 0, default.stderr + forced.stderr
    assert "torch intra-op threads: 1 (from idle CPUs; 2 CPUs in the affinity mask" in default.stderr
    assert "CPU oversubscribed" not in default.stderr
    for run in (forced, forced_by_env):
        assert run.returncode == 0, run.stderr
        assert "torch intra-op threads: 2 (from flag" in run.stderr
        assert "OpenMP wait policy passive" in run.stderr  # spinning through a descheduled peer costs more
        assert "CPU oversubscribed: other processes keep" in run.stderr


def test_a_forward_gives_the_same_logits_on_one_thread_and_on_two(embedded):
    """What makes following the load safe for lossless decoding: the governor may change torch's thread
    count between two rounds of one request, and strict SD must still equal plain decoding. The model as
    `--dtype auto` serves it here (bf16 with AVX512-BF16 or AMX, fp32 elsewhere or under the dispatch cap
    of the restricted run): a prompt's forward and a 7-token chunk over its cache, bit for bit."""
    import torch

    ids = embedded.tokenizer(
        "The quick brown fox jumps over the lazy dog because it wants to reach the river bank before",
        return_tensors="pt",
    ).input_ids
    before = torch.get_num_threads()
    logits = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                full = embedded.model(ids).logits[0]
                prefix = embedded.model(ids[:, :-7], use_cache=True)
                chunk = embedded.model(ids[:, -7:], past_key_values=prefix.past_key_values).logits[0]
            logits[threads] = (full, chunk)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(logits[1][0], logits[2][0])
    assert torch.equal(logits[1][1], logits[2][1])
