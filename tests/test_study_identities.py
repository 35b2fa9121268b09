"""Run names, wandb ids and wandb groups stay what they were when Table 8 became a Hydra choice: the golden file
was written by the code before that change (every Table 8 row at both stages and presets, and CaiT's rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import identity_of, study_rows

GOLDEN = json.loads((Path(__file__).parent / "data" / "run_identities.json").read_text())


def test_the_golden_file_covers_table_8_and_cait():
    table8 = [g for g in GOLDEN if not any(o.startswith(("cait=", "seed=", "distill=")) for o in g["overrides"])]
    rows = {next((o for o in g["overrides"] if o.startswith("ablation=")), None) for g in table8}
    # every row of Table 8 when the file was written (rows added since have no runs from before) and no row, each at
    # both stages and both presets
    assert {f"ablation={row}" for row in study_rows("ablation")} >= rows - {None} >= {"ablation=baseline"}
    assert None in rows and len(table8) == len(rows) * 2 * 2
    assert len({(g["overrides"][0], *sorted(g["overrides"][1:])) for g in table8}) == len(table8)  # no repeat
    cait = {o for g in GOLDEN for o in g["overrides"] if o.startswith("cait=")}
    assert cait and {row.removeprefix("cait=") for row in cait} <= set(study_rows("cait"))


@pytest.mark.parametrize("golden", GOLDEN, ids=lambda g: ",".join(g["overrides"]))
def test_run_identities_are_unchanged(golden):
    overrides = golden["overrides"]
    identity = identity_of(overrides)
    assert (identity.name, identity.run_id, identity.group) == (golden["name"], golden["run_id"], golden["group"])
