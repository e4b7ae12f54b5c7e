"""Where a decode step's time goes outside compute, piece by piece, across the processes of a
local swarm (issue 51): every process records a monotonic timestamp where a step passes a
probe, and the steps are followed from the head through each hop and back.

The probes wrap functions of the data path at start-up (``--boot``, below), so nothing is
added to meshnet's own code: the head's step (``HeadPasses.step``), the compute scheduler
(``_submit``; ``_start``, called as a pass is handed over; ``_run`` on the compute thread
and ``_encode_outputs`` at its end; ``_finished`` back on the loop), the hop streams (``HopLinks.relay``, ``_Stream.call`` and
``on_message``; on the serving end ``decode_request``, ``forward_answer``, ``parse_step``
and ``_reply``), decode lanes (ADR-0058: ``lane_io.read``, ``read_next``, ``read_message`` and the head's ``read_answer``, ``lanes.write``, a lane's
pass, the head's ``LaneStep.write`` and ``HopLinks.lane_answer``; a swarm whose steps took
the lanes is followed along them, a burst's answers from the tail's answer lane where the
middle hops read each step once, ADR-0060). ``time.perf_counter_ns`` is CLOCK_MONOTONIC, one clock for every process
on a host. A probe costs ~1 us, a wrapped coroutine a few more: the pieces are a few
microseconds longer than without the probes, and the step's own ``meshnet_timing`` is
printed beside them.

    .venv/bin/python bench/step_trace.py [--procs 3] [--bf16] [--threads N] [--tokens 128]
        [--runs 3] [--pin] [--fine] [--model ID] [--step-delay-ms D]

Default: SmolLM2's Q4_1 GGUF (the peers section's swarm) at each process's default threads.

``--pin`` (with ``--threads 1``): each process's event loop on CPU 0 and its compute
thread on CPU 1 (where the cost would be wake-ups across cores or the caches a pass
empties on its own core, this moves it). A piece that ends with a message sent and the
next that begins with it received can trade time: the receiver may run before the sender
marks its send done; their sum holds.
Writes ``bench/results/step_trace.json``.
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import functools
import inspect
import itertools
import json
import os
import runpy
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

_EVENTS: list[tuple[int, str]] = []
_NS = time.perf_counter_ns


def _mark(tag: str) -> None:
    _EVENTS.append((_NS(), tag))


def _wrap(owner, name: str, enter: str | None, leave: str | None = None) -> None:
    """Replace ``owner.name`` with a function that marks ``enter`` before and ``leave`` after
    it."""
    fn = getattr(owner, name)
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def probed(*args, **kwargs):
            if enter:
                _mark(enter)
            try:
                return await fn(*args, **kwargs)
            finally:
                if leave:
                    _mark(leave)

    else:

        @functools.wraps(fn)
        def probed(*args, **kwargs):
            if enter:
                _mark(enter)
            try:
                return fn(*args, **kwargs)
            finally:
                if leave:
                    _mark(leave)

    setattr(owner, name, probed)


def fine_calls() -> list[tuple[object, str]]:
    """``--fine``: the calls on a lane step's way whose own time is printed."""
    from meshnet_common import wire
    from meshnet_node.dataplane import lane_burst, lane_io, lane_known, lane_relay, lanes
    from meshnet_node.engine import sessions
    from meshnet_node.engine import stage as stage_mod
    from meshnet_node.scheduling import scheduler
    from meshnet_node.swarm import host_turns

    return [
        (host_turns.HostTurns, "take"), (host_turns.HostTurns, "give"),
        (wire, "encode_tensor"), (lane_known.KnownStep, "read"),
        (lane_known.KnownStep, "matches"), (lane_known.KnownStep, "prepare"),
        (sessions.SessionStore, "observe"), (lanes, "parse_answer"), (lanes, "message"),
        (lane_relay.LaneRelay, "_count"), (lane_relay.LaneRelay, "_answer"),
        (lane_relay.LaneRelay, "_send_on"), (scheduler.ComputeScheduler, "_waiting"),
        (lanes, "read_message"), (lane_known.NextMessage, "fill"),
        (scheduler, "_timed"),
        (lane_burst.LaneBurst, "_answer"), (lane_burst.LaneBurst, "_answers"),
        (lanes.Direct, "prefix"), (lane_known.NextMessage, "fits"),
        (lane_relay.LaneRelay, "_known_step"), (lane_relay.LaneRelay, "_pass"),
        (stage_mod.Stage, "step"), (lane_burst.LaneBurst, "_write"),
        (lane_known.NextMessage, "send"), (lane_known.NextMessage, "send_on"),
        (lane_io, "send_answer"),
    ]  # fmt: skip


def calls(events: list[list[tuple[int, str]]]) -> dict:
    """``--fine``: each process's median time (us) in each call of ``fine_calls``."""
    out = {}
    for proc, e in enumerate(events):
        began: dict[str, int] = {}
        took: dict[str, list[float]] = {}
        for t, tag in e:
            if not tag.startswith("f:"):
                continue
            if tag.endswith(":end"):
                name = tag[2:-4]
                if name in began:
                    took.setdefault(name, []).append((t - began.pop(name)) / 1000)
            else:
                began[tag[2:]] = t
        out[proc] = {name: round(statistics.median(v), 1) for name, v in took.items()}
        print(f"process {proc}: " + ", ".join(f"{k} {v}" for k, v in out[proc].items()))
    return out


def install(out_dir: str, pin: bool, fine: bool = False) -> None:
    """The probes, and what writes them out (SIGUSR1 or exit) to ``out_dir/<pid>.txt``."""
    from meshnet_node.dataplane import handlers, links, stream_server, streams
    from meshnet_node.head import chain
    from meshnet_node.scheduling import scheduler

    cs = scheduler.ComputeScheduler
    _wrap(chain.HeadPasses, "step", "step", "end")
    _wrap(cs, "_submit", "submit")
    _wrap(cs, "_start", "hand")  # under the condition, just before the compute thread's wake
    _wrap(cs, "_run", "woke")
    _wrap(scheduler, "_encode_outputs", None, "done")  # before the loop is called back
    _wrap(cs, "_finished", "fin")
    _wrap(links.HopLinks, "relay", "relay", "relayed")
    _wrap(streams._Stream, "call", "call")
    _wrap(streams._Stream, "on_message", "ans")
    _wrap(stream_server, "decode_request", "recv")
    _wrap(stream_server, "forward_answer", "fwd", "handled")
    _wrap(handlers, "parse_step", None, "parsed")
    _wrap(stream_server._ServerStream, "_reply", "reply", "replied")
    from meshnet_node.dataplane import lane_io, lane_relay, lanes  # decode lanes (ADR-0058)

    _wrap(lane_io, "read", "lread", "lgot")
    _wrap(lane_io, "read_message", "lread", "lgot")
    _wrap(lane_io, "read_answer", "await", "answered")  # the head's: its wait is inside
    _wrap(lane_io, "read_next", None, "lnext")  # a node's next step: its wait is inside
    _wrap(lane_relay, "_timed", "lpass", "lpassed")
    _wrap(lanes, "write", "lwrite", "lwrote")
    from meshnet_node.dataplane.lane_known import NextMessage

    _wrap(NextMessage, "send", "lwrite", "lwrote")  # a step's message filled in and written
    _wrap(NextMessage, "send_on", "lwrite", "lwrote")  # the same, at a relay
    _wrap(lane_io, "send_answer", "lwrite", "lwrote")  # the tail's, on the answer lane
    _wrap(lanes.LaneClient, "data_received", "lans")
    _wrap(lanes.LaneStep, "write", "hwrite", "hwrote")  # the head's, on its compute thread
    _wrap(links.HopLinks, "lane_answer", None, "lsent")
    from meshnet_node.dataplane import lane_burst  # bursts down the lane (ADR-0059)
    from meshnet_node.engine import stage

    _wrap(stage.Stage, "step", "hstep", "hstepped")
    _wrap(lane_burst.LaneBurst, "_exchange", "bx", "bxd")
    if fine:  # calls inside the pieces, each timed on its own (``calls``)
        for owner, name in fine_calls():
            _wrap(owner, name, f"f:{name}", f"f:{name}:end")
    if pin:
        os.sched_setaffinity(0, {0})  # this thread, and every thread it starts from now
        serve = cs._serve

        def pinned(self):
            os.sched_setaffinity(0, {1})  # the compute thread (and its OpenMP team)
            return serve(self)

        cs._serve = pinned

    def dump(*_args) -> None:
        with open(os.path.join(out_dir, f"{os.getpid()}.txt"), "a") as f:
            f.writelines(f"{t} {tag}\n" for t, tag in _EVENTS)
        _EVENTS.clear()

    atexit.register(dump)
    signal.signal(signal.SIGUSR1, dump)


def boot(argv: list[str]) -> None:
    """``--boot OUT PIN FINE MODULE ARGS...``: a swarm process with the probes installed."""
    from meshnet_common.config.openmp import short_spin

    out_dir, pin, fine, module, *args = argv
    short_spin(os.environ)  # as the node's own CLI does, before the probes import torch
    install(out_dir, pin == "1", fine == "1")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


# -- following the steps ---------------------------------------------------------------------

COMPUTE = "compute"


def chain_of(procs: int, lanes: bool = False, burst: bool = False,
             direct: bool = False) -> list[tuple[int, str]]:  # fmt: skip
    """(process, probe) in the order a decode step passes them: 0 is the head. ``lanes``:
    the hops after the head read and write decode lanes on their compute threads;
    ``burst``: the head's compute thread too, step after step (ADR-0059); ``direct``: the
    tail answering the head's burst on its answer lane (ADR-0060)."""
    if burst:  # the head's pass, the step written, its answer read (await: the wait)
        out = [(0, t) for t in ("hstep", "hstepped", "bx")]
        if not direct:
            out.append((0, "await"))
        for p in range(1, procs):  # each node waits for the next step in its read
            out += [(p, t) for t in ("lnext", "lpass", "lpassed", "lwrite", "lwrote")]
        if direct:  # the head's read returns once the tail's answer came and was read
            return [*out, (0, "answered"), (0, "bxd"), (0, "hstep")]
        for p in range(procs - 2, 0, -1):
            out += [(p, t) for t in ("lread", "lgot", "lwrite", "lwrote")]
        return [*out, (0, "answered"), (0, "bxd"), (0, "hstep")]
    out = [(0, t) for t in ("step", "submit", "hand", "woke", "done", "fin")]
    if procs == 1:
        return [*out, (0, "end")]
    if lanes:  # the head's compute thread writes the step; the loop hears of it meanwhile
        out = [*out[:4], (0, "hwrite"), (0, "hwrote")]
        for p in range(1, procs):
            out += [(p, t) for t in ("lread", "lgot", "lpass", "lpassed", "lwrite", "lwrote")]
        for p in range(procs - 2, 0, -1):  # the answer back through each middle hop
            out += [(p, t) for t in ("lread", "lgot", "lwrite", "lwrote")]
        return [*out, (0, "lans"), (0, "lsent"), (0, "end")]
    out += [(0, "relay"), (0, "call")]
    for p in range(1, procs):
        out += [(p, t) for t in ("recv", "fwd", "parsed", "submit", "hand", "woke", "done",
                                 "fin")]  # fmt: skip
        out += [(p, "relay"), (p, "call")] if p < procs - 1 else [(p, "handled")]
    for p in range(procs - 1, 0, -1):
        out += [(p, "reply"), (p, "replied"), (p - 1, "ans"), (p - 1, "relayed")]
        if p - 1 > 0:
            out += [(p - 1, "handled")]
    return [*out, (0, "end")]


def follow(events: list[list[tuple[int, str]]], procs: int, last: int) -> dict:
    """Each piece's durations (us) over the last ``last`` steps the head started."""
    lanes = procs > 1 and any(tag == "lpass" for _, tag in events[1])
    burst = lanes and any(tag == "bx" for _, tag in events[0])
    # a middle hop reads each step once where the tail answers the head itself (ADR-0060)
    reads = sum(tag in ("lread", "lnext") for _, tag in events[1]) if procs > 2 else 0
    passes = sum(tag == "lpass" for _, tag in events[1]) if procs > 2 else 0
    direct = burst and procs > 2 and reads < 1.5 * passes
    order = chain_of(procs, lanes, burst, direct)
    first = "hstep" if burst else "step"
    starts = [t for t, tag in events[0] if tag == first][-last:]
    times = [[t for t, _ in e] for e in events]
    pieces: dict[str, list[float]] = {}
    for t0 in starts:
        at = [bisect.bisect_left(ts, t0) for ts in times]
        prev, row = None, []
        for proc, tag in order:
            e, i = events[proc], at[proc]
            while i < len(e) and e[i][1] != tag:
                i += 1
            if i >= len(e):
                row = None
                break
            at[proc] = i + 1
            if prev is not None:
                role = "H" if proc == 0 else "T" if proc == procs - 1 else "M"
                name = f"{role}{proc} {tag}"
                while any(n == name for n, _ in row):  # a probe passed again: the answer's way
                    name += "'"
                row.append((name, (e[i][0] - prev) / 1000))
            prev = e[i][0]
        if row:
            for name, us in row:
                pieces.setdefault(name, []).append(us)
    return pieces


def kind(name: str) -> str:
    tag = name.split()[1].rstrip("'")
    if tag in ("done", "lpassed", "hwrite", "hstepped"):
        return COMPUTE
    if tag in ("woke", "fin"):
        return "thread hand-off"
    if tag in ("recv", "ans", "lread", "lans", "answered", "lnext"):
        return "message (send, transit, wake)"
    return "Python on the loop"


def report(pieces: dict, loop_gaps: list[float]) -> dict:
    rows, totals = [], {}
    for name, values in pieces.items():
        p50 = statistics.median(values)
        p90 = sorted(values)[int(len(values) * 0.9)]
        rows.append((name, kind(name), p50, p90))
        totals[kind(name)] = totals.get(kind(name), 0.0) + p50
    if loop_gaps:
        gap = statistics.median(loop_gaps)
        p90 = sorted(loop_gaps)[int(len(loop_gaps) * 0.9)]
        rows.append(("H0 next step", "Python on the loop", gap, p90))
        totals["Python on the loop"] += gap
    print(f"\n{'piece (process, probe)':26s}{'kind':32s}{'p50 us':>9s}{'p90 us':>9s}")
    for name, what, p50, p90 in rows:
        print(f"{name:26s}{what:32s}{p50:9.1f}{p90:9.1f}")
    outside = sum(v for k, v in totals.items() if k != COMPUTE)
    print("\nmedians summed by kind (us): " + ", ".join(f"{k} {v:.0f}" for k, v in totals.items()))
    print(f"outside compute: {outside:.0f} us a step, {len(rows)} pieces")
    fields = ("piece", "kind", "p50_us", "p90_us")
    pieces = [dict(zip(fields, row, strict=True)) for row in rows]
    return {"pieces": pieces, "by_kind_us": totals, "outside_compute_us": outside}


def trace(args, model: str) -> tuple[list[list[tuple[int, str]]], list[dict]]:
    """Run the swarm with its probes: every process's (timestamp, probe) events, the head
    first, and each run's ``meshnet_timing`` medians."""
    import httpx
    from swarm import Swarm, complete

    layers = 30
    if args.model:
        config = json.loads((Path(args.models_dir) / args.model / "config.json").read_text())
        layers = config["num_hidden_layers"]
    cuts = [layers * i // args.procs for i in range(args.procs + 1)]
    flags = [
        "--speculative",
        "off",
        "--step-delay-ms",
        str(args.step_delay_ms),
        *args.flags.split(),
    ]
    out_dir = tempfile.mkdtemp(prefix="step-trace-")
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))

    def probed(module: str, argv: list[str]) -> tuple[str, list[str]]:
        switches = ["1" if args.pin else "0", "1" if args.fine else "0"]
        return "step_trace", ["--boot", out_dir, *switches, module, *argv]

    swarm = Swarm(Path(args.models_dir), model, list(itertools.pairwise(cuts)), args.threads,
                  extra={i: flags for i in range(args.procs)}, launch=probed)  # fmt: skip
    prompt = list(range(100, 140))  # within every test model's vocabulary
    timings = []
    try:
        swarm.start()
        swarm.wait_ready()
        with httpx.Client(timeout=600) as client:
            complete(client, swarm.tracker_url, model, prompt, 8)  # warm
            for _ in range(args.runs):
                res = complete(client, swarm.tracker_url, model, prompt, args.tokens)
                timing = res["response"].get("meshnet_timing", {})
                timings.append({k: v for k, v in timing.items() if k.endswith("_p50")})
                print(f"{args.tokens / res['wall_s']:.1f} tok/s, {timings[-1]}", flush=True)
        for proc in swarm.procs:
            proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
    finally:
        swarm.stop()
    events = []
    for pid in swarm.pids:  # the head (tracker node) first, then down the chain
        path = Path(out_dir) / f"{pid}.txt"
        lines = path.read_text().split() if path.exists() else []
        events.append([(int(t), tag) for t, tag in zip(lines[::2], lines[1::2], strict=True)])
    return events, timings


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--boot":
        boot(sys.argv[2:])
        return
    from benchlib import REPO_ROOT, write_json

    from meshnet_common.models.gguf_import import SMOLLM2_GGUF_ID, SMOLLM2_MODEL_ID

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--bf16", action="store_true", help="SmolLM2 safetensors (default: "
                        "its Q4_1 GGUF, as the peers section)")  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch threads a process (default: own)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pin", action="store_true", help="loops on CPU 0, compute threads "
                        "on CPU 1 (with --threads 1)")  # fmt: skip
    parser.add_argument("--fine", action="store_true", help="also time the calls inside "
                        "the pieces (encode, turns, reads: ``fine_calls``)")  # fmt: skip
    parser.add_argument("--model", help="another snapshot under --models-dir (its layers "
                        "split evenly), e.g. meshnet-tiny/llama")  # fmt: skip
    parser.add_argument("--step-delay-ms", type=float, default=0.0, help="every pass this "
                        "much longer, asleep (with a tiny model: the idle gaps of a real "
                        "one without the caches its passes empty)")  # fmt: skip
    parser.add_argument("--flags", default="", help="more flags for every process, e.g. "
                        "'--direct-min-rtt 0'")  # fmt: skip
    parser.add_argument("--models-dir", default=str(REPO_ROOT / ".cache" / "test-models"))
    args = parser.parse_args()
    if args.pin and args.threads != 1:
        parser.error("--pin gives each compute thread one CPU: use it with --threads 1")
    model = args.model or (SMOLLM2_MODEL_ID if args.bf16 else SMOLLM2_GGUF_ID)
    events, timings = trace(args, model)
    steps = args.runs * (args.tokens - 1)
    head = events[0]
    gaps = [(b[0] - a[0]) / 1000 for a, b in itertools.pairwise(head)
            if a[1] == "end" and b[1] == "step"]  # fmt: skip
    res = report(follow(events, args.procs, steps), gaps[-steps:])
    if args.fine:
        res["calls_us"] = calls(events)
    res.update(procs=args.procs, model=model, threads=args.threads, pin=args.pin,
               timings=timings)  # fmt: skip
    print(f"wrote {write_json('step_trace.json', res)}")


if __name__ == "__main__":
    main()
