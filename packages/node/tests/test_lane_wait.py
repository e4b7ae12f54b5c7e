"""When a decode lane's next message is due (``lane_wait``, docs/adr/0058): a lane's reader
looks ahead only once its latest waits keep a beat, around their median, for at most the
window, and only where the node's compute threads leave a CPU free."""

from __future__ import annotations

from meshnet_node.dataplane.lane_wait import ASLEEP, WAITS, Cadence, spin_window_s


def test_a_reader_looks_ahead_only_on_a_steady_beat():
    cadence = Cadence(0.002)
    for _ in range(WAITS - 1):
        cadence.note(0.028)
        assert cadence.due() == ASLEEP  # too few waits known
    cadence.note(0.0285)
    sleep_s, spin_s = cadence.due()  # half the window before the median, then the window
    assert spin_s == 0.002 and abs(sleep_s - (0.028 - 0.001)) < 1e-9
    for wait_s in (0.020, 0.036, 0.021, 0.035):  # the middle half spreads wider: no beat
        cadence.note(wait_s)
    assert cadence.due() == ASLEEP
    for _ in range(WAITS):  # a beat again, however short: looked for from the start
        cadence.note(0.0005)
    assert cadence.due() == (0.0, 0.002)
    cadence.forget()  # another session's step came first: start over
    assert cadence.due() == ASLEEP


def test_a_reader_looks_ahead_only_where_a_cpu_is_free():
    assert spin_window_s(2.0, 1, 4) == 0.002
    assert spin_window_s(2.0, 3, 4) == 0.002
    assert spin_window_s(2.0, 4, 4) == 0.0  # the passes take every CPU
    assert spin_window_s(2.0, None, 4) == 0.0  # torch's default: every CPU
    assert spin_window_s(0.0, 1, 4) == 0.0  # --lane-spin-ms 0: asleep until it comes
