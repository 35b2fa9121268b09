"""No change moves a run of any study: every row of every study, at both stages and presets, keeps the experiment
digest it had when tests/data/study_identities.json was written (a new key without its config/keys.ADDED_KEYS
entry, or a new unread rule that canonicalises to another value, would move them all and fail here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deit_ablate.config.compose import compose_run_config
from deit_ablate.record.identity import composed_choices, run_identity

GOLDEN: dict[str, str] = json.loads((Path(__file__).parent / "data" / "study_identities.json").read_text())
FAST = 24  # rows in the default suite: every 17th of the file; the slow tier checks them all


def digest_of(launch: str) -> str:
    overrides = launch.split()
    cfg = compose_run_config(overrides)
    return run_identity(cfg, overrides, composed_choices(cfg)).digest


@pytest.mark.parametrize("launch", [pytest.param(launch, marks=() if i % 17 == 0 else pytest.mark.slow)
                                    for i, launch in enumerate(GOLDEN)])
def test_a_study_rows_identity_is_unchanged(launch):
    assert digest_of(launch) == GOLDEN[launch], (
        f"{launch}: its experiment digest moved, so every run of it would train again in a new folder. A new "
        "config key needs its ADDED_KEYS entry (docs/adding-a-study.md); an identity that must move needs this file "
        "written again, and the move named in docs/runs.md")
