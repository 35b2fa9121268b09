"""bench/parts.py: where a whole run's time goes, ours part by part and timm's from its step log."""

from __future__ import annotations

import time

from pytest import approx

from deit_ablate.bench.parts import PARTS, PartTimer, timm_parts


def _step(epoch: int, index: int, step_s: float, data_s: float) -> str:
    return (f"Train: {epoch} [   {index}/2 ( 50%)]  Loss: 2.30 (2.30)  Time: {step_s:.3f}s,  100.00/s  (0.5s, 1/s)  "
            f"LR: 1.000e-04  Data: {data_s:.3f} (0.1)")


def test_timms_parts_come_from_its_step_log_and_the_lines_times():
    lines = [(10.0, "Model created\n"), (14.0, _step(0, 0, 1.0, 0.4)), (14.5, _step(0, 1, 0.5, 0.1)),
             (17.0, "Test: [ 0/0] ...\n"), (18.0, _step(1, 0, 0.5, 0.2)), (18.5, _step(1, 1, 0.5, 0.1))]
    parts = timm_parts(lines, started=10.0, ended=20.0)
    seconds = parts["seconds"]
    assert seconds["start-up"] == approx(3.4)  # the first step began 3.0 s after the start, its batch 0.4 s later
    assert seconds["train step"] == approx(0.6 + 0.4 + 0.3 + 0.4)  # each step's time less its data wait
    assert seconds["data wait"] == approx(0.1 + 0.2 + 0.1)  # after the first batch, which is start-up's
    assert seconds["evaluation"] == approx((17.5 - 14.5) + (20.0 - 18.5))  # to the next step's start, then to exit
    assert parts["counts"]["evaluation"] == 2 and parts["seconds_since_start"] == 10.0


def test_a_parts_time_excludes_the_parts_inside_it():
    timer = PartTimer()
    evaluate = timer.wrap("evaluation", lambda: time.sleep(0.05) or wait())
    wait = timer.wrap("data wait", lambda: time.sleep(0.1))
    evaluate()
    assert 0.1 <= timer.seconds["data wait"] < 0.15 and timer.counts["data wait"] == 1
    assert 0.05 <= timer.seconds["evaluation"] < 0.1  # its own 0.05 s, not the 0.1 s of the wait inside it
    assert set(timer.seconds) == set(PARTS)
