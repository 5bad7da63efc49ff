"""LoadMonitor: is a timed comparison contended by other work on the machine? Synthetic readings
for the rules, one real reading, and the demo's one-line note."""

from __future__ import annotations

import pytest

from selfspec.core import machine
from selfspec.core.machine import LoadMonitor


def monitor(monkeypatch, *samples, threads=2, cores=2):
    """A monitor whose injected sampler returns these (wall, own cpu s, (busy s, steal s) | None,
    load) in turn, on a machine of ``cores`` CPUs."""
    it = iter(samples)
    m = LoadMonitor(threads=threads, sampler=lambda cpus, helpers=(): next(it), machine_cores=cores)
    m.cores = cores
    with m:
        pass
    return m


def test_idle_machine_is_not_contended(monkeypatch):
    m = monitor(monkeypatch, (0.0, 0.0, (100.0, 0.0), 2.1), (2.0, 3.9, (104.0, 0.0), 2.2))
    assert m.wall == 2.0 and m.others_share == pytest.approx(0.1 / 4)
    assert not m.contended and m.note() is None
    assert m.summary()["contended"] is False and m.summary()["cores"] == 2


def test_other_processes_during_the_run_contend(monkeypatch):
    # our 2 threads got 2.0 of 4.0 CPU seconds; others (and steal) the other 2.0
    m = monitor(monkeypatch, (0.0, 0.0, (100.0, 1.0), 0.5), (2.0, 2.0, (104.0, 1.5), 1.0))
    assert m.others_share == pytest.approx(0.5) and m.steal_share == pytest.approx(0.125)
    assert m.contended
    note = m.note()
    assert note.startswith("selfspec: machine was busy during the timing (load 1.0 on 2 cores")
    assert "speedups are noisy" in note and "50%" in note and "warning" not in note.lower()
    assert note.endswith("try --threads 1 (now 2)")  # we ran on 2 threads: suggest fewer


def test_busy_note_names_only_the_readings_that_made_it_busy(monkeypatch):
    """Contended by the load average while other processes took ~0% of our CPUs: the note used to
    say both ("other processes took 0%" beside "machine was busy"); on one thread, no advice."""
    m = monitor(monkeypatch, (0.0, 0.0, (100.0, 0.0), 4.5), (2.0, 1.9, (102.0, 0.0), 4.5), threads=1)
    assert m.contended and m.others_share < 0.05
    note = m.note()
    assert "other processes" not in note and "0%" not in note and note.endswith("speedups are noisy")


def test_load_average_beyond_our_threads_contends(monkeypatch):
    m = monitor(monkeypatch, (0.0, 0.0, None, 4.5), (0.1, 0.2, None, 3.0))  # no /proc/stat: load alone
    assert m.others_share is None and m.contended  # 4.5 - 2 threads > 0.5 * 2 cores
    assert "load 4.5 on 2 cores" in m.note()
    assert not monitor(monkeypatch, (0.0, 0.0, None, 2.9), (0.1, 0.2, None, 2.9)).contended


def test_short_runs_are_judged_by_the_load_average(monkeypatch):
    # 0.1 s: ten CPU-time ticks at most, too coarse to blame other processes
    m = monitor(monkeypatch, (0.0, 0.0, (100.0, 0.0), 1.0), (0.1, 0.0, (100.2, 0.0), 1.0))
    assert m.others_share == pytest.approx(1.0) and not m.contended


def test_real_reading():
    with LoadMonitor() as m:
        sum(range(100000))
    s = m.summary()
    assert isinstance(s["contended"], bool) and s["wall_s"] >= 0 and s["cores"] >= 1
    assert m.threads >= 1


def test_demo_flags_a_busy_machine(capsys, tiny_dir, monkeypatch):
    from selfspec.cli import main

    monkeypatch.setattr(LoadMonitor, "contended", property(lambda self: True))
    code = main(["demo", "--model", str(tiny_dir), "--no-chat", "--method", "pld", "--kernels", "stock",
                 "--max-new-tokens", "8", "w5 w6 w7 w8"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "over ar" in out.strip().splitlines()[-1]  # the result line stays last on stdout
    busy = [line for line in err.splitlines() if "machine was busy during the timing" in line]
    assert len(busy) == 1 and busy[0].endswith("speedups are noisy")  # on one thread: no advice
    code = main(["demo", "--model", str(tiny_dir), "--no-chat", "--method", "pld", "--kernels", "stock",
                 "--max-new-tokens", "8", "--threads", "2", "w5 w6 w7 w8"])
    busy = [line for line in capsys.readouterr().err.splitlines() if "machine was busy" in line]
    assert code == 0 and len(busy) == 1 and busy[0].endswith("try --threads 1 (now 2)")


def test_worker_processes_cpu_time_counts_as_ours():
    """A bench peer decoding in a worker process (llama.cpp) is our work, not load: its CPU time
    joins ours when its pid is given as a helper (a 2-thread worker made every llama.cpp run of a
    quiet bench look contended)."""
    import subprocess
    import sys

    worker = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                               "while time.process_time() - t < 0.4: pass\nprint('done', flush=True)\n"
                               "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "done"  # it has burnt 0.4 s of CPU and now sleeps
        assert machine.process_cpu(worker.pid) >= 0.35
        alone, with_worker = machine.sample(None)[1], machine.sample(None, (worker.pid,))[1]
        assert with_worker - alone >= 0.35
        assert LoadMonitor(helpers=(worker.pid,)).helpers == (worker.pid,)
    finally:
        worker.kill()
        worker.wait()
    assert machine.process_cpu(worker.pid) == 0.0  # gone: unreadable counts nothing
