"""A long stage's progress off a terminal (a piped `make demo`, a CI log): a plain line every tenth of the work and
at the end, with the stage's own numbers; on a terminal, rich's live bar instead."""

from __future__ import annotations

import io

from rich.console import Console

from emapg.progress import stage_progress


def test_off_a_terminal_a_line_every_tenth_of_the_work_with_its_numbers():
    out = io.StringIO()
    with stage_progress(Console(file=out, force_terminal=False, width=200), "SFT", 20) as progress:
        assert progress.bar is None
        for step in range(1, 21):
            progress.update(step, f"loss {1 / step:.3f}")
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [f"{step}/20" for step in range(1, 21, 2)] + ["20/20"]
    assert lines[-1].startswith("SFT 20/20  loss 0.050  elapsed ") and lines[-1].endswith("left 0:00:00")


def test_a_stage_that_prints_its_own_lines_adds_none_off_a_terminal():
    out = io.StringIO()
    with stage_progress(Console(file=out, force_terminal=False), "EMA-PG", 3, lines=False) as progress:
        for iteration in (1, 2, 3):
            progress.update(iteration, "reward 0.5")
    assert out.getvalue() == ""


def test_on_a_terminal_a_live_bar_that_pauses_for_work_printing_its_own():
    out = io.StringIO()
    with stage_progress(Console(file=out, force_terminal=True, width=120), "SFT", 4) as progress:
        assert progress.bar is not None
        progress.update(2, "loss 1.234")
        with progress.paused():
            assert not progress.bar.live.is_started
        assert progress.bar.live.is_started
        assert progress.bar.tasks[0].completed == 2 and progress.bar.tasks[0].fields["status"] == "loss 1.234"


def test_a_resumed_stage_counts_from_where_it_starts():
    out = io.StringIO()
    with stage_progress(Console(file=out, force_terminal=False, width=200), "SFT", 10, done=8) as progress:
        progress.update(9, "")
        progress.update(10, "")
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["9/10", "10/10"] and lines[-1].endswith("left 0:00:00")
    with stage_progress(Console(file=io.StringIO(), force_terminal=True), "SFT", 10, done=8) as progress:
        assert progress.bar.tasks[0].completed == 8
