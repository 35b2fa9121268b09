"""Run names, wandb ids and wandb groups stay what they were when Table 8 became a Hydra choice: the golden file
was written by the code before that change (every Table 8 row at both stages and presets, and CaiT's rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import identity_of

GOLDEN = json.loads((Path(__file__).parent / "data" / "run_identities.json").read_text())


def test_the_golden_file_covers_table_8_and_cait():
    table8 = [g for g in GOLDEN if not any(o.startswith(("cait=", "seed=", "distill=")) for o in g["overrides"])]
    assert len(table8) == 56  # 13 rows + no override, both stages, both presets
    assert sum(1 for g in GOLDEN if any(o.startswith("cait=") for o in g["overrides"])) >= 58


@pytest.mark.parametrize("golden", GOLDEN, ids=lambda g: ",".join(g["overrides"]))
def test_run_identities_are_unchanged(golden):
    overrides = golden["overrides"]
    identity = identity_of(overrides)
    assert (identity.name, identity.run_id, identity.group) == (golden["name"], golden["run_id"], golden["group"])
