"""The broker rows of the benchmark: server CPU per message as a cost ceiling against the bare server, the CPU
window interpolated from samples, and the rows a mode without the broker leaves (skipped, with a reason)."""

from __future__ import annotations

from rocketstore.bench import report, system
from rocketstore.bench.broker_client import CpuClock
from rocketstore.bench.harness import MODES, Measurement, Results
from rocketstore.bench.targets import TARGETS, evaluate

CPU_ROWS = ("broker.send.cpu.vs.bare", "broker.receive.cpu.vs.bare")
RATE_ROWS = ("broker.produce.vs.bare", "broker.consume.vs.bare")


def _results(send: float, bare_send: float, receive: float, bare_receive: float) -> Results:
    res = Results()
    for id, v, ref in (("broker.send.cpu", send, "bare.send.cpu"), ("bare.send.cpu", bare_send, None),
                       ("broker.receive.cpu", receive, "bare.receive.cpu"),
                       ("bare.receive.cpu", bare_receive, None)):
        res.add(Measurement(id, "x", id, v, "us/msg", ref=ref))
    return res


def _rows(res: Results) -> dict[str, dict]:
    return {r["id"]: r for r in evaluate(res)}


def test_cpu_rows_are_ceilings_on_the_ratio_to_the_bare_server():
    rows = _rows(_results(561.0, 296.0, 400.0, 300.0))
    send, receive = rows["broker.send.cpu.vs.bare"], rows["broker.receive.cpu.vs.bare"]
    assert abs(send["ratio"] - 561 / 296) < 1e-9 and send["met"] is False  # the figures: 1.9x
    assert abs(receive["ratio"] - 4 / 3) < 1e-9 and receive["met"] is True
    assert send["threshold"] == receive["threshold"] == 1.4
    on_the_line = _rows(_results(420.0, 300.0, 1.0, 1.0))["broker.send.cpu.vs.bare"]
    assert on_the_line["met"] is True  # <= 1.4x is met


def test_cpu_rows_show_a_ratio_not_megabytes():
    rows = evaluate(_results(450.0, 300.0, 330.0, 300.0))
    table = "\n".join(report.targets_table(rows))
    line = next(x for x in table.splitlines() if "CPU per message sent" in x)
    assert "| 1.50x | **missed** |" in line and "MB" not in line
    assert "450 us/msg" in line.replace(".0 us", " us") and "300 us/msg" in line.replace(".0 us", " us")


def test_every_broker_row_is_a_target_and_unmeasured_without_the_broker(tmp_path):
    ids = {t.id for t in TARGETS}
    assert set(CPU_ROWS + RATE_ROWS) <= ids
    res = Results()
    system.broker_client(res, str(tmp_path), MODES["smoke"])  # smoke mode does not run the broker
    for id in ("broker.produce", "bare.produce", "broker.consume", "bare.consume", "broker.send.cpu",
               "bare.send.cpu", "broker.receive.cpu", "bare.receive.cpu"):
        m = res.get(id)
        assert m is not None and m.status == "skipped" and "smoke" in m.note, id
    rows = _rows(res)
    for id in CPU_ROWS + RATE_ROWS:
        assert rows[id]["met"] is None and rows[id]["why_not_measured"]
    assert MODES["quick"].broker and MODES["full"].broker


def test_cpu_clock_interpolates_the_window_between_samples():
    clock = CpuClock(lambda: 0.0)
    clock.times, clock.cpu = [10.0, 11.0, 12.0, 14.0], [0.0, 1.0, 3.0, 3.0]  # (wall time, CPU seconds) samples
    assert clock.between(10.0, 12.0) == 3.0
    assert clock.between(10.5, 11.5) == 0.5 + 1.0  # half of each second's use
    assert clock.between(12.0, 20.0) == 0.0  # idle after the last message: nothing counted
    assert clock.between(0.0, 10.0) == 0.0  # before the first sample: clamped


def test_cpu_clock_samples_a_process_while_it_runs():
    import os

    def cpu() -> float:
        t = os.times()
        return t.user + t.system

    clock = CpuClock(cpu, period=0.005).start()
    x = 0
    for i in range(300000):
        x += i * i
    clock.stop()
    assert len(clock.times) >= 3 and clock.times == sorted(clock.times)
    assert clock.cpu == sorted(clock.cpu)  # CPU time never goes back
    assert clock.between(clock.times[0], clock.times[-1]) == clock.cpu[-1] - clock.cpu[0]
