"""Test-only: with this folder on PYTHONPATH and DEIT_OTHER_DRAW=<epoch>,<step>,<slot>, slot <slot>'s micro-batch at
step <step> of epoch <epoch> draws its Mixup/CutMix from another seed, every other draw of the run as it was: the
invariance audit's negative control (tests/test_invariance.py). Python imports `sitecustomize` at start-up; nothing
in the trainer knows."""

import os

_DRAW = os.environ.get("DEIT_OTHER_DRAW")


def _install(epoch: int, step: int, slot: int) -> None:
    from deit_ablate.core import streams

    original = streams.EpochStreams.chunk_seed

    def chunk_seed(self, stream, at_step: int, at_slot: int) -> int:
        seed = original(self, stream, at_step, at_slot)
        if stream == streams.Stream.MIX and (self.epoch, at_step, at_slot) == (epoch, step, slot):
            return streams.mix_seed(seed, 1)
        return seed

    streams.EpochStreams.chunk_seed = chunk_seed


if _DRAW:
    _install(*(int(part) for part in _DRAW.split(",")))
