"""bench.lifted_step runs on CPU at toy size: both loops (single steps and decode_rounds) over
the public calls, each row with its walls and the tokens a round emitted."""

from __future__ import annotations


def test_lifted_step_quick_runs():
    from bench.lifted_step import main

    rows = main(
        ["--geometry", "quick", "--modes", "greedy", "--batches", "1", "--rounds", "2",
         "--dispatches", "1", "--steps", "2"]
    )  # fmt: skip
    (row,) = rows
    assert row["mode"] == "greedy" and row["bs"] == 1 and row["tokens / round"] == 1.0
    assert row["step wall ms"] > 0 and row["rounds wall ms"] > 0
