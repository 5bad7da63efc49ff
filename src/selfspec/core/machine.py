"""The machine a timing ran on: its identity (``machine_id``, ``cpu_flags``) and whether other work
kept it busy while we timed (:class:`LoadMonitor`, readings through ``psutil``).

Timings are only comparable on one machine, and only when nothing else competed for its CPUs; every
benchmark record and cached profile carries these readings.
"""

from __future__ import annotations

import copy
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

CONTENDED_LOAD_PER_CORE = 0.5  # 1-min load average beyond our threads, per core
CONTENDED_OTHERS_SHARE = 0.25  # share of our CPUs' time used by other processes (and stolen) during the run
MIN_STAT_WALL_S = 0.5  # shorter runs are judged by the load average alone (CPU time ticks are 10 ms)

# (wall s, CPU s of this process and its helpers, (busy s, stolen s) of our CPUs | None, 1-min load | None)
Sample = tuple[float, float, "tuple[float, float] | None", "float | None"]


def machine_id() -> str:
    """CPU model, cores and torch version: profiles are only valid on the machine they came from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def cpu_flag_set() -> frozenset[str]:
    """Every feature flag of the CPU from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> str:
    """The SIMD features that decide which kernels are fast and exact here (e.g. ``avx2``,
    ``avx512f+avx512_vnni``); empty where they cannot be read."""
    have = cpu_flag_set()
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")
    return "+".join(f for f in wanted if f in have)


CPU_FAMILIES = ("AVX2", "AVX-512 VNNI", "Intel Xeon AVX-512", "AMX Intel Xeon")
"""The CPU families the README's headline table keeps one row pair for (see :func:`cpu_family`)."""


def cpu_family(flags: str | None = None, machine: str | None = None) -> str:
    """The CPU family of ``flags`` (as :func:`cpu_flags` writes them) on ``machine`` (as
    :func:`machine_id` writes it; its CPU model tells an Intel Xeon apart); both None: this
    machine's. ``AMX Intel Xeon``; ``Intel Xeon AVX-512`` (an Intel Xeon whose AMX the VM does not
    expose: oneDNN cannot use it there); ``AVX-512 VNNI``; ``AVX2``; or ``unknown``."""
    if flags is None:
        flags = cpu_flags()
        machine = machine_id() if machine is None else machine
    have = set(flags.split("+")) - {""}
    if "amx_int8" in have:
        return "AMX Intel Xeon"
    if "avx512f" in have and "intel" in (machine or "").lower():
        return "Intel Xeon AVX-512"
    if "avx512_vnni" in have:
        return "AVX-512 VNNI"
    if "avx2" in have:
        return "AVX2"
    return "unknown"


def cpu_busy(cpus: tuple[int, ...] | None) -> tuple[float, float] | None:
    """(busy, stolen) seconds of ``cpus`` (all when None) since boot; None where it cannot be
    read. Busy counts user, nice, system, irq, softirq and steal time."""
    try:
        per_cpu = psutil.cpu_times(percpu=True)
    except (OSError, RuntimeError, NotImplementedError):
        return None
    busy = steal = 0.0
    found = False
    for i, t in enumerate(per_cpu):
        if cpus is not None and i not in cpus:
            continue
        st = getattr(t, "steal", 0.0)
        busy += t.user + getattr(t, "nice", 0.0) + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + st
        steal += st
        found = True
    return (busy, steal) if found else None


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of the live process ``pid``; 0 where it is gone or unreadable."""
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except (psutil.Error, OSError):
        return 0.0


def load_average() -> float | None:
    """The 1-minute load average; None where the system has none."""
    try:
        return psutil.getloadavg()[0]
    except (OSError, AttributeError, RuntimeError):
        return None


def sample(cpus: tuple[int, ...] | None, helpers: tuple[int, ...] = ()) -> Sample:
    """The readings :class:`LoadMonitor` compares, now: wall clock, CPU seconds of our process and
    its ``helpers`` (worker pids), :func:`cpu_busy` and :func:`load_average`."""
    own = psutil.Process().cpu_times()
    return (time.perf_counter(), own.user + own.system + sum(process_cpu(p) for p in helpers), cpu_busy(cpus),
            load_average())


class LoadMonitor:
    """Was the machine busy with other work while we timed something?

    ``with LoadMonitor() as load: ...`` samples before and after: the 1-minute load average, and
    the busy time of the CPUs this process may run on, less this process's own CPU time (so: other
    processes, and time stolen by a hypervisor). The run was contended when other processes used
    more than ``CONTENDED_OTHERS_SHARE`` of those CPUs' time during it, or when the load average
    minus our own compute threads exceeded ``CONTENDED_LOAD_PER_CORE`` per core, before or after.
    Timings of a contended run are noisy.

    Args:
        threads: our compute threads (default: torch's, at :meth:`start`).
        helpers: pids of worker processes doing our timed work (their CPU time is ours).
        sampler: the readings (default :func:`sample`; injected in tests).
        machine_cores: CPUs of the machine, which the load average counts (default ``os.cpu_count()``).
    """

    def __init__(self, threads: int | None = None, helpers: tuple[int, ...] = (),
                 sampler: Callable[[tuple[int, ...] | None, tuple[int, ...]], Sample] = sample,
                 machine_cores: int | None = None) -> None:
        self.helpers = tuple(helpers)
        self.sampler = sampler
        try:
            self.cpus: tuple[int, ...] | None = tuple(sorted(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            self.cpus = None
        self.cores = len(self.cpus) if self.cpus else (os.cpu_count() or 1)
        self.machine_cores = machine_cores or os.cpu_count() or self.cores
        self.threads = threads
        self.wall = 0.0
        self.load_before: float | None = None
        self.load_after: float | None = None
        self.others_share: float | None = None
        self.steal_share: float | None = None
        self._start: Sample | None = None

    def start(self) -> LoadMonitor:
        if self.threads is None:
            self.threads = torch.get_num_threads()
        self._start = self.sampler(self.cpus, self.helpers)
        self.load_before = self._start[3]
        return self

    def stop(self) -> LoadMonitor:
        if self._start is None:
            raise RuntimeError("LoadMonitor.stop before start")
        t0, own0, stat0, _ = self._start
        t1, own1, stat1, self.load_after = self.sampler(self.cpus, self.helpers)
        self.wall = max(t1 - t0, 0.0)
        if stat0 is not None and stat1 is not None and self.wall > 0:
            capacity = self.wall * self.cores
            others = max(stat1[0] - stat0[0] - (own1 - own0), 0.0)
            self.others_share = min(others / capacity, 1.0)
            self.steal_share = min(max(stat1[1] - stat0[1], 0.0) / capacity, 1.0)
        return self

    def others_so_far(self) -> float | None:
        """Other processes' (and a hypervisor's) share of our CPUs from :meth:`start` until now,
        while the monitor keeps running; None before :data:`MIN_STAT_WALL_S` or where the CPUs'
        times cannot be read."""
        if self._start is None:
            raise RuntimeError("LoadMonitor.others_so_far before start")
        probe = copy.copy(self).stop()
        return probe.others_share if probe.wall >= MIN_STAT_WALL_S else None

    __enter__ = start

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def load(self) -> float | None:
        """The larger 1-minute load average of before and after."""
        vals = [v for v in (self.load_before, self.load_after) if v is not None]
        return max(vals) if vals else None

    @property
    def contended(self) -> bool:
        if self.others_share is not None and self.wall >= MIN_STAT_WALL_S \
                and self.others_share > CONTENDED_OTHERS_SHARE:
            return True
        load = self.load
        return load is not None and (load - (self.threads or 1)) > CONTENDED_LOAD_PER_CORE * self.machine_cores

    def summary(self) -> dict:
        """What a report records: ``contended`` and the readings it was decided from."""
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 3)

        return {"contended": self.contended, "load_before": r(self.load_before), "load_after": r(self.load_after),
                "machine_cores": self.machine_cores, "cores": self.cores, "threads": self.threads,
                "others_share": r(self.others_share), "steal_share": r(self.steal_share), "wall_s": r(self.wall)}

    def note(self) -> str | None:
        """One line for stderr when contended, else None. It names the other processes' share
        only where that share is what made the run contended (a "0%" beside "busy" read as a
        contradiction), and suggests fewer threads when we ran on several."""
        if not self.contended:
            return None
        load = f"load {self.load:.1f}" if self.load is not None else "load unknown"
        others = (f"; other processes took {self.others_share:.0%} of our {self.cores} CPUs"
                  if self.others_share is not None and self.wall >= MIN_STAT_WALL_S
                  and self.others_share > CONTENDED_OTHERS_SHARE else "")
        return (f"selfspec: machine was busy during the timing ({load} on {self.machine_cores} "
                f"cores{others}): speedups are noisy{threads_hint(self.threads)}")



BUSY_SAMPLE_S = 0.5
"""How long :func:`machine_busy` watches the CPUs."""


def machine_busy(sample_s: float = BUSY_SAMPLE_S, sleep: Callable[[float], None] = time.sleep,
                 monitor: Callable[[], LoadMonitor] = LoadMonitor) -> bool:
    """Whether other processes keep this machine busy right now: their share of our CPUs over
    ``sample_s`` seconds (this process idle meanwhile). Not the load average, which lags a busy
    spell by minutes: a quiet start just after one read as busy and kept the busy choice. Where
    the CPUs' times cannot be read, the load average decides. ``sleep`` and ``monitor`` are injected
    in tests."""
    mon = monitor().start()
    sleep(sample_s)
    return others_busy(mon.stop())


def others_busy(mon: LoadMonitor) -> bool:
    """Whether other processes took more than :data:`CONTENDED_OTHERS_SHARE` of our CPUs while
    ``mon`` watched; where their share is unknown (too short a watch, no CPU times), whether the run
    was contended by the load average."""
    if mon.others_share is None or mon.wall < MIN_STAT_WALL_S:
        return mon.contended
    return share_busy(mon.others_share)


def share_busy(share: float | None) -> bool:
    """Whether other processes' ``share`` of our CPUs (None: unknown) makes the machine busy."""
    return share is not None and share > CONTENDED_OTHERS_SHARE


def threads_hint(threads: int | None = None) -> str:
    """The busy-machine advice (empty on one thread): a thread count that oversubscribes a busy
    machine can decode several times slower than one thread (0.7 against 15 tok/s measured)."""
    n = torch.get_num_threads() if threads is None else threads
    return f"; fewer threads are often much faster on a busy machine: try --threads 1 (now {n})" if n > 1 else ""
