"""``bench/focus_signal.py`` runs the config's workflow without a trainer: the option that waits for
one must go, its value with it, and nothing else."""

from __future__ import annotations

from bench.focus_signal import without_option


def test_the_trainer_wait_is_dropped_with_its_value_and_nothing_else() -> None:
    args = ("--group-size", "4", "--max-pending", "5", "-o", "temperature=0.8")
    assert without_option(args, "--max-pending") == ["--group-size", "4", "-o", "temperature=0.8"]
    assert without_option(args, "--focus") == list(args)
