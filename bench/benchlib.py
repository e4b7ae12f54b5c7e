"""Small helpers shared by the benchmark scripts: statistics, tables, JSON results."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"


def summary(values: Sequence[float]) -> dict:
    """Median, min and max of a list of measurements (plus how many there were)."""
    if not values:
        raise ValueError("no measurements to summarize")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def ratio_summary(numerators: Sequence[float], denominators: Sequence[float]) -> dict:
    """Summary of ``numerators[i] / denominators[i]``: ratios computed pair by pair.

    Each pair was measured back to back, so slow drift of the machine cancels out.
    """
    return summary([n / d for n, d in zip(numerators, denominators, strict=True)])


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def fmt_summary(stats: dict, digits: int = 1) -> str:
    """``median [min-max]`` with a fixed number of decimals."""
    return f"{stats['median']:.{digits}f} [{stats['min']:.{digits}f}-{stats['max']:.{digits}f}]"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print a plain-text table with right-aligned columns (first column left-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(parts)

    print(f"\n{title}")
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))


def environment(threads: int) -> dict:
    """Where the numbers were measured."""
    import torch
    import transformers

    return {
        "date": dt.date.today().isoformat(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "loadavg_1m_at_end": os.getloadavg()[0],
    }


def _system_busy_s() -> float:
    """CPU seconds spent by everything on this machine (all cores), idle and iowait excluded."""
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))


def _own_busy_s(pids: Iterable[int]) -> float:
    """CPU seconds of this process, its waited-for children, and the live ``pids``."""
    import psutil

    me = psutil.Process().cpu_times()
    total = me.user + me.system + me.children_user + me.children_system
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


class CpuWatch:
    """Average number of cores used by processes that are NOT ours during a section.

    Other work on a 2-core machine (a test run, a build) distorts timings badly: with two
    torch threads, one busy neighbour can make a decode step 10x slower. Each result
    carries this number; above ``BUSY_CORES`` it is flagged.
    """

    def __init__(self, pids: Callable[[], Iterable[int]] = lambda: ()) -> None:
        self.pids = pids
        self.other_cores = 0.0
        self.own_cores = 0.0  # this process, its children and ``pids``: our own CPU use

    def __enter__(self) -> CpuWatch:
        self._t0 = time.monotonic()
        self._sys0 = _system_busy_s()
        self._own0 = _own_busy_s(self.pids())
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.monotonic() - self._t0, 1e-6)
        own = _own_busy_s(self.pids()) - self._own0
        self.other_cores = max(0.0, (_system_busy_s() - self._sys0 - own) / wall)
        self.own_cores = own / wall


BUSY_CORES = 0.25  # other processes using more than this many cores: timings unreliable


def busy_flag(other_cores: float) -> str:
    return " (BUSY)" if other_cores > BUSY_CORES else ""


class Slack:
    """Seconds a whole benchmark may spend, in all, waiting for quiet and redoing runs.

    On a machine that stays busy, waiting and redoing do not help; this caps what they
    cost so that a suite keeps its time budget (its results are then marked BUSY).
    """

    def __init__(self, seconds: float) -> None:
        self.left = seconds

    def spend(self, seconds: float) -> None:
        self.left = max(0.0, self.left - seconds)


def wait_quiet(max_wait_s: float, label: str, slack: Slack | None = None) -> float:
    """Wait (up to ``max_wait_s``) until other processes use < BUSY_CORES; return their use."""
    if slack is not None:
        max_wait_s = min(max_wait_s, slack.left)
    started = time.monotonic()
    deadline = started + max_wait_s
    waited = False
    while True:
        with CpuWatch() as watch:
            time.sleep(1.0)
        if watch.other_cores <= BUSY_CORES or time.monotonic() >= deadline:
            break
        if not waited:
            print(f"[{label}] other processes use {watch.other_cores:.2f} cores; waiting "
                  f"up to {max_wait_s:.0f} s for a quiet machine", flush=True)  # fmt: skip
            waited = True
    if slack is not None and waited:
        slack.spend(time.monotonic() - started)
    note = busy_flag(watch.other_cores) and "  WARNING: busy machine, timings will be noisy"
    print(f"[{label}] load average {os.getloadavg()[0]:.2f}, other processes "
          f"{watch.other_cores:.2f} cores{note}", flush=True)  # fmt: skip
    return watch.other_cores


def write_json(name: str, data: dict) -> Path:
    """Write ``data`` to ``bench/results/<name>`` and return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def default_threads() -> int:
    """Torch threads for a benchmark: every core this machine has."""
    return max(1, os.cpu_count() or 1)


def steady_runs(
    runs: int,
    one_run: Callable[[], object],
    *,
    pids: Callable[[], Iterable[int]] = lambda: (),
    retries: int = 2,
    wait_s: float = 60.0,
    slack: Slack | None = None,
) -> tuple[list, float]:
    """Call ``one_run`` until ``runs`` results are kept; redo a run other processes disturbed.

    At most ``retries`` runs are redone in all (after waiting for a quiet machine), and none
    once ``slack`` is used up (a redone run and its wait are charged to it); returns the
    kept results and the largest "other cores" seen among them.
    """
    kept: list = []
    worst = 0.0
    while len(kept) < runs:
        started = time.monotonic()
        with CpuWatch(pids) as watch:
            value = one_run()
        disturbed = watch.other_cores > BUSY_CORES
        if disturbed and retries > 0 and (slack is None or slack.left > 0):
            retries -= 1
            print(f"  run disturbed ({watch.other_cores:.2f} other cores); redoing it", flush=True)
            if slack is not None:
                slack.spend(time.monotonic() - started)
            wait_quiet(wait_s, "retry", slack)
            continue
        kept.append(value)
        worst = max(worst, watch.other_cores)
    return kept, worst
