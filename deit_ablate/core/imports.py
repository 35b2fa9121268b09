"""What a command leaves out of its imports: the wandb that timm imports for its own training script.

timm.utils.summary imports wandb, when it is installed, for `update_summary(log_wandb=True)`, which only timm's
train.py calls; so every `import timm` paid for wandb (a tenth of what a dry run or a skip imports: 0.21 s of 2.07 s
and 0.47 s of 4.44 s in two runs with the machine loaded, `python -X importtime`), also where nothing is logged. Our
tracking imports wandb itself when a run logs (record/tracking.py). The finder below refuses wandb to that one timm
module while it is imported, as if wandb were not installed (timm guards the import), and to nothing else.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

TIMM_SUMMARY = "timm.utils.summary"


def being_imported(name: str) -> bool:
    """Whether the body of module `name` is running now (Python marks its spec while it executes the module)."""
    module = sys.modules.get(name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class TimmWithoutWandb(importlib.abc.MetaPathFinder):
    """Refuse `wandb` to timm.utils.summary while it is imported; leave every other import to the next finder."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname == "wandb" and being_imported(TIMM_SUMMARY):
            raise ModuleNotFoundError(f"wandb is left out of {TIMM_SUMMARY} (deit_ablate/core/imports.py)",
                                      name="wandb")
        return None


def keep_wandb_out_of_timm() -> None:
    """Put TimmWithoutWandb first on sys.meta_path (once), before anything imports timm: an entry point calls it."""
    if not any(isinstance(finder, TimmWithoutWandb) for finder in sys.meta_path):
        sys.meta_path.insert(0, TimmWithoutWandb())
