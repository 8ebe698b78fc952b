"""How many intra-op threads torch takes: the CPUs this process may use, not the host's cores.

torch starts one OpenMP thread per host core. Under a Kubernetes CPU limit, beside a second replica or a
Redis on the same cores, those threads outnumber the CPUs they get, and OpenMP's default wait policy has
every thread spin at each of the hundreds of barriers a forward has until the one that was descheduled comes
back: on 2 cores beside one busy process a request took 47.6 s on torch's default threads and 2.0 s on one
(issue 31). Three things keep the default safe:

- the count: the CPUs of the process's affinity mask, capped by its cgroup's CPU quota (floor of quota /
  period, at least 1), as Go's automaxprocs and the JVM count them (a quota of 2 CPUs on a 64-core node is 2
  threads, not 64), and by the CPUs of the mask that other processes leave idle at start-up (measured over
  a quarter of a second from /proc/stat): a forward waits at every barrier for its slowest thread, so one
  thread that shares its CPU with a busy process holds back all the others.
- the count follows the load while serving (`ThreadGovernor`): a competitor that starts later lowers it
  within a second or two, and it comes back when the CPUs are free again.
- the wait: OpenMP's default (a short spin at each barrier, then sleep) while the threads fit the idle CPUs,
  which is always so without a flag; `OMP_WAIT_POLICY=PASSIVE` when `--torch-threads` asks for more threads
  than there are idle CPUs, set before torch loads OpenMP (`csd` does it first thing), so a thread waiting at
  a barrier sleeps instead of spinning through its descheduled peer's time slice.

Measured by `python -m bench.threads` (docs/benchmarks.md): the numbers there decide this default.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
WAIT_POLICY_VARIABLE = "OMP_WAIT_POLICY"


def affinity_cpus() -> int:
    """CPUs this process may run on (its affinity mask: `taskset`, a cpuset, Kubernetes' static CPU manager)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _quota_cpus(quota: int, period: int) -> int:
    return max(1, math.floor(quota / period))


def _cpu_max(folder: Path) -> int | None:
    """cgroup v2 `cpu.max`: "QUOTA PERIOD" in microseconds, or "max PERIOD" (no limit)."""
    try:
        fields = (folder / "cpu.max").read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return _quota_cpus(quota, period) if quota > 0 and period > 0 else None


def _cfs_quota(folder: Path) -> int | None:
    """cgroup v1 `cpu.cfs_quota_us` (-1: no limit) over `cpu.cfs_period_us`."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return _quota_cpus(quota, period) if quota > 0 and period > 0 else None


def _own_cgroups(proc_cgroup: Path) -> dict[str, str]:
    """Controller -> this process's cgroup path, from /proc/self/cgroup ("" is the v2 unified hierarchy)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return {}
    paths = {}
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _with_ancestors(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder and its parents up to the mount: a parent's quota bounds its children too. The
    mount itself is always there, because a container usually sees its own cgroup at the mount point
    whatever /proc/self/cgroup names (no cgroup namespace on v1)."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), 0, -1)] + [mount]


def cgroup_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Whole CPUs the cgroup CPU quota allows this process (v2 `cpu.max`, else v1 `cpu.cfs_quota_us`), the
    tightest along the cgroup's ancestors; None without a quota."""
    own = _own_cgroups(proc_cgroup)
    limits = [cpus for folder in _with_ancestors(root, own.get("", "/")) if (cpus := _cpu_max(folder))]
    if not limits:  # v1: the cpu controller is mounted as cpu, cpu,cpuacct or both
        for mount in (root / "cpu", root / "cpu,cpuacct"):
            folders = _with_ancestors(mount, own.get("cpu", "/"))
            limits += [cpus for folder in folders if (cpus := _cfs_quota(folder))]
    return min(limits) if limits else None


def _cpu_ticks(cpus: set[int]) -> tuple[int, int]:
    """(busy, total) clock ticks so far of the CPUs `cpus`, from /proc/stat's per-CPU lines. Busy counts
    steal: on a VM, time the hypervisor gave another guest is time these threads do not get."""
    busy = total = 0
    with open("/proc/stat") as stat:
        for line in stat:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                continue
            ticks = [int(x) for x in rest.split()]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
            total += sum(ticks[:8])  # guest time is already counted in user
            busy += sum(ticks[:8]) - idle
    return busy, total


def _own_ticks() -> int:
    """This process's user + system clock ticks so far (/proc/self/stat fields 14 and 15)."""
    with open("/proc/self/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def busy_elsewhere(interval_s: float = 0.25) -> float | None:
    """CPUs of this process's affinity mask that other processes kept busy over the next `interval_s`
    seconds (busy time of those CPUs minus this process's own), or None where /proc cannot say (not Linux)."""
    try:
        cpus = os.sched_getaffinity(0)
        busy0, total0 = _cpu_ticks(cpus)
        own0 = _own_ticks()
        time.sleep(interval_s)
        busy1, total1 = _cpu_ticks(cpus)
        own1 = _own_ticks()
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    elapsed = total1 - total0  # ticks of all the mask's CPUs together
    if elapsed <= 0:
        return None
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / elapsed * len(cpus)


@dataclass(frozen=True)
class ThreadChoice:
    """torch's intra-op thread count and where it came from, as the start-up log line says it."""

    threads: int
    source: str  # "flag" (--torch-threads / CSD_TORCH_THREADS), "affinity", "cgroup" or "idle CPUs"
    affinity_cpus: int
    cgroup_cpus: int | None
    busy_cpus: float | None  # CPUs of the affinity mask other processes kept busy at start-up
    wait_policy: str  # OMP_WAIT_POLICY as OpenMP read it

    @property
    def usable_cpus(self) -> int:
        return min(self.affinity_cpus, self.cgroup_cpus or self.affinity_cpus)

    @property
    def idle_cpus(self) -> int:
        """CPUs of the mask nobody else used at start-up, rounded to the nearest whole one (at least 1)."""
        return _idle(self.affinity_cpus, self.busy_cpus)

    def describe(self) -> str:
        quota = f"cgroup quota {self.cgroup_cpus} CPUs" if self.cgroup_cpus else "no cgroup CPU quota"
        busy = (
            f"{self.busy_cpus:.1f} busy with other processes"
            if self.busy_cpus is not None
            else "load unknown"
        )
        return (
            f"torch intra-op threads: {self.threads} (from {self.source}; {self.affinity_cpus} CPUs in the "
            f"affinity mask, {busy}; {quota}; OpenMP wait policy {self.wait_policy})"
        )


def choose_threads(
    requested: int | None,
    root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_CGROUP,
    busy_cpus: float | None = None,
) -> ThreadChoice:
    """The thread count to give torch: `requested` where set, else the CPUs the process may use (affinity
    mask, cgroup quota) that other processes leave idle (`busy_cpus`, measured by `busy_elsewhere` where not
    given). A forward waits at every barrier for its slowest thread, so a thread that has to share its CPU
    with a busy process slows all of them: on 2 CPUs beside one busy process, 1 thread beat 2 (bench.threads)."""
    affinity = affinity_cpus()
    quota = cgroup_cpus(root, proc_cgroup)
    if busy_cpus is None:
        busy_cpus = _take_startup_busy()
    choice = ThreadChoice(0, "", affinity, quota, busy_cpus, wait_policy())
    if requested is not None:
        threads, source = requested, "flag"
    else:
        threads, source = min(
            (affinity, "affinity"),
            (quota or affinity, "cgroup"),
            (choice.idle_cpus, "idle CPUs"),
            key=lambda option: option[0],
        )
    return replace(choice, threads=threads, source=source)


def oversubscription(choice: ThreadChoice) -> str | None:
    """Why these threads will compete for CPUs, or None: more threads than usable CPUs, or than CPUs that
    other processes leave idle."""
    if choice.threads > choice.usable_cpus:
        return f"{choice.threads} torch threads on {choice.usable_cpus} usable CPUs"
    if choice.threads > choice.idle_cpus:
        return (
            f"other processes keep {choice.busy_cpus:.1f} of the {choice.affinity_cpus} CPUs of this "
            f"process's affinity mask busy, and torch runs {choice.threads} threads"
        )
    return None


def wait_policy() -> str:
    """OpenMP's wait policy for this process, as its environment set it before OpenMP loaded."""
    policy = os.environ.get(WAIT_POLICY_VARIABLE, "").strip().lower()
    return policy or "unset (OpenMP's default: spin a while at barriers, then sleep)"


def prepare_wait_policy(requested: int | None) -> bool:
    """Before torch loads OpenMP (which reads its wait policy once): set OMP_WAIT_POLICY=PASSIVE when the
    threads would start oversubscribed, i.e. `requested` exceeds the CPUs other processes leave idle now.
    Returns True if it set it. The environment's own choice and a process that imported torch already are
    left alone.

    Without a flag the thread count fits the idle CPUs (`choose_threads`) and the `ThreadGovernor` follows
    them while serving, so OpenMP keeps its default, spinning briefly at a barrier: on 2 idle CPUs a request
    took 1.87x as long with waits passive, each barrier paying a thread's wake-up (bench.threads, Intel
    Xeon). With more threads than idle CPUs a waiting thread should sleep instead: beside one busy process,
    2 threads took 1.11x one thread's time waiting passively and 2.12x spinning."""
    global _startup_busy
    if WAIT_POLICY_VARIABLE in os.environ or "torch" in sys.modules:
        return False
    _startup_busy = busy_elsewhere()
    if requested is None or requested <= _idle(affinity_cpus(), _startup_busy):
        return False
    os.environ[WAIT_POLICY_VARIABLE] = "PASSIVE"
    return True


def _idle(affinity: int, busy: float | None, threshold: float = 0.5) -> int:
    """CPUs of the mask left idle when `busy` of them are busy elsewhere: a CPU counts as taken once it is
    busier than `threshold` (at least 1 CPU is left)."""
    return max(1, affinity - math.floor((busy or 0.0) + 1 - threshold))


_startup_busy: float | None = None  # prepare_wait_policy's measurement, taken by the first choose_threads


def _take_startup_busy() -> float | None:
    global _startup_busy
    busy, _startup_busy = _startup_busy, None
    return busy if busy is not None else busy_elsewhere()


class ThreadGovernor:
    """Follows the CPUs other processes leave idle while serving: a competitor that starts after this
    process (a second replica getting traffic, a batch job on the node) would otherwise have torch's threads
    share CPUs with it, and every barrier of a forward wait for the thread it descheduled. Ticked by the model
    thread before each round (torch's thread count is per calling thread once set: only the thread that runs
    the model may change it); every `period_s` it reads /proc/stat and moves the thread count to the idle
    CPUs of the mask, within [1, usable CPUs]. Hysteresis: a CPU counts as taken above 0.6 of it busy, as
    free again below 0.4, so a neighbour near half a CPU does not flip the count every period."""

    def __init__(
        self,
        choice: ThreadChoice,
        set_threads,  # Callable[[int], None]: torch.set_num_threads
        period_s: float = 1.0,
    ) -> None:
        self.choice = choice
        self.threads = choice.threads
        self.period_s = period_s
        self._set_threads = set_threads
        self._last: tuple[float, int, int, int] | None = None  # (monotonic time, busy, total, own ticks)
        self.busy_cpus: float | None = choice.busy_cpus

    def tick(self) -> int:
        """Re-measure if a period has passed, and change the thread count if the idle CPUs moved; returns the
        thread count. Cheap between periods (one clock read)."""
        now = time.monotonic()
        last = self._last
        if last is not None and now - last[0] < self.period_s:
            return self.threads
        try:
            cpus = os.sched_getaffinity(0)
            busy, total = _cpu_ticks(cpus)
            own = _own_ticks()
        except (AttributeError, OSError, ValueError, IndexError):
            return self.threads
        self._last = (now, busy, total, own)
        if last is None or now - last[0] > 3 * self.period_s:
            return self.threads  # the first sample, or the engine sat idle: a fresh window starts now
        elapsed = total - last[2]
        if elapsed <= 0:
            return self.threads
        self.busy_cpus = max(0.0, (busy - last[1]) - (own - last[3])) / elapsed * len(cpus)
        usable = self.choice.usable_cpus
        fewer = min(usable, _idle(len(cpus), self.busy_cpus, threshold=0.6))
        more = min(usable, _idle(len(cpus), self.busy_cpus, threshold=0.4))
        target = fewer if fewer < self.threads else more if more > self.threads else self.threads
        if target != self.threads:
            log.info(
                "torch intra-op threads %d -> %d: other processes keep %.1f of the %d CPUs of the affinity "
                "mask busy",
                self.threads,
                target,
                self.busy_cpus,
                len(cpus),
            )
            self._set_threads(target)
            self.threads = target
        return self.threads


_governor: ThreadGovernor | None = None


def install_governor(governor: ThreadGovernor | None) -> None:
    """The process's one governor (torch's thread count is process state), or None to stop following."""
    global _governor
    _governor = governor


def tick() -> None:
    """Called by the model thread before each round (`Batch.step`)."""
    if _governor is not None:
        _governor.tick()
