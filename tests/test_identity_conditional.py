"""A key read under one value of a switch only (a bool, an enum or a text key of its group) is in the identity
exactly there: every key flipped on a run whose switch takes each of its other values (test_identity_generated.py's
flips and what the run builds). A file of its own, so that the slow tier runs it beside the all-pairs test."""

from __future__ import annotations

import zlib
from typing import Any

import pytest
from test_identity_generated import SAMPLE, check_conditional, conditional_pairs, write_teachers


@pytest.fixture(scope="module", autouse=True)
def teacher_files():
    write_teachers()


def run_conditional(triples: list[tuple[str, Any, str]]) -> tuple[list[str], int]:
    """Each (switch, value, key) flip's mismatch, and how many were checked (not skipped)."""
    mismatches, checked = [], 0
    for switch, value, key in triples:
        found = check_conditional(switch, value, key)
        if found is None:
            checked += 1
        elif not found.startswith("skip:"):
            mismatches.append(f"{key}: {found}")
    return mismatches, checked


def test_a_key_read_under_one_value_of_a_switch_only_is_in_the_identity_then_only_sampled():
    triples = sorted(conditional_pairs(), key=lambda t: zlib.crc32(f"{t[0]}={t[1]}@{t[2]}".encode()))[:SAMPLE // 4]
    mismatches, checked = run_conditional(triples)
    assert not mismatches, "\n".join(mismatches)
    assert checked >= SAMPLE // 10


def test_the_warmup_a_fine_tune_sets_is_unread_under_a_flat_schedule():
    """optimizer.sched=none trains at the peak throughout: the fine-tune block's warm-up and floor are then unread
    (before: recorded, a second folder for the same fine-tune)."""
    triples = [("optimizer.sched", "none", key) for key in ("finetune.warmup_epochs", "finetune.warmup_lr",
                                                            "finetune.min_lr")]
    mismatches, checked = run_conditional(triples)
    assert not mismatches and checked == 3, mismatches


@pytest.mark.slow
def test_a_key_read_under_one_value_of_a_switch_only_is_in_the_identity_then_every_pair():
    triples = conditional_pairs()
    mismatches, checked = run_conditional(triples)
    print(f"{checked} of {len(triples)} (switch, value, key) flips checked")
    assert not mismatches, "\n".join(mismatches)
