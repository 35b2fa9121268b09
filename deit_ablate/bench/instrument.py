"""Run train.py with a timer on every training step: `python -m deit_ablate.bench.instrument OUT TRAIN_PY [overrides]`.

Each optimizer step appends one JSON line to OUT: wall-clock time at entry and exit of Trainer.train_step and the
seconds spent in Mixup/CutMix inside it. Nothing else about the run changes.
"""

from __future__ import annotations

import functools
import json
import runpy
import sys
import time

from timm.data.mixup import Mixup

from deit_ablate.bench.env import synchronize
from deit_ablate.train.trainer import Trainer


def install(out_path: str) -> None:
    """Wrap Trainer.train_step and Mixup.__call__ with timers that write to `out_path`."""
    out = open(out_path, "a", buffering=1)
    mixup_seconds = [0.0]
    original_step, original_mix = Trainer.train_step, Mixup.__call__

    @functools.wraps(original_mix)
    def timed_mix(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original_mix(self, *args, **kwargs)
        finally:
            mixup_seconds[0] += time.perf_counter() - start

    @functools.wraps(original_step)
    def timed_step(self, images, targets, *args, **kwargs):
        mixup_seconds[0] = 0.0
        enter = time.time()
        loss = original_step(self, images, targets, *args, **kwargs)
        synchronize(self.info.device)  # attribute GPU time to the step that queued it
        out.write(json.dumps({"enter": enter, "exit": time.time(), "mixup_s": mixup_seconds[0],
                              "batch": int(images.shape[0])}) + "\n")
        return loss

    Trainer.train_step = timed_step
    Mixup.__call__ = timed_mix


def main() -> None:
    """Install the timers, then run train.py as `python train.py [overrides]` would."""
    out_path, train_py, *overrides = sys.argv[1:]
    install(out_path)
    sys.argv = [train_py, *overrides]
    runpy.run_path(train_py, run_name="__main__")


if __name__ == "__main__":
    main()
