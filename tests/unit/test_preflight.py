"""Preflight's comparison of the ranks' fingerprints: the first difference from rank 0, named in one line."""

from __future__ import annotations

import pytest

from shardtune.training.engine.preflight import PreflightError, check_fingerprints


def fingerprints(**changes_on_rank_3: str) -> list[dict[str, str]]:
    base = {
        "host": "hostA",
        "torch version": "2.13.0",
        "processes per node": "2",
        "--lr": "0.003",
        "training data": "ab12",
    }
    ranks = [dict(base), dict(base), {**base, "host": "hostB"}, {**base, "host": "hostB"}]
    ranks[3].update(changes_on_rank_3)
    return ranks


def test_identical_fingerprints_on_two_hosts_pass():
    check_fingerprints(fingerprints())  # the host name is not compared


def test_a_difference_names_the_field_both_nodes_and_both_values():
    with pytest.raises(PreflightError) as caught:
        check_fingerprints(fingerprints(**{"--lr": "0.002"}))
    assert str(caught.value).startswith(
        "preflight: the nodes differ in --lr: hostA (rank 0) has 0.003, hostB (rank 3) has 0.002; "
    )
    assert "\n" not in str(caught.value)


def test_the_first_field_in_order_is_reported():
    with pytest.raises(PreflightError, match="differ in torch version: hostA .* has 2.13.0, hostB .* has 2.12.0"):
        check_fingerprints(fingerprints(**{"--lr": "0.002", "torch version": "2.12.0"}))
