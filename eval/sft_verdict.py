"""Did an SFT start learn? Two questions, read off a held-out evaluation's pooled row (eval.report.pooled):

    protocol learned?  the share of valid-format trajectories (ended in <answer>, no invalid action), and searches
    answers learned?   held-out exact match

Each floor that is set (sft.min_format, sft.min_em) and not met fails the verdict, naming the floor and what was
measured; an unset floor is reported, never checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Verdict:
    lines: list[str]  # the two answers, for people
    failures: list[str] = field(default_factory=list)  # each floor not met, naming it and the measured value

    @property
    def ok(self) -> bool:
        return not self.failures


def _against(name: str, floor: float | None, measured: float, what: str, failures: list[str]) -> str:
    if floor is None:
        return f"unchecked ({name} not set)"
    if measured < floor:
        failures.append(f"{name} = {floor:g} not met: {what} {measured:.3f}")
        return f"NO: below {name} = {floor:g}"
    return f"yes: at least {name} = {floor:g}"


def sft_verdict(measured: dict[str, float], min_format: float | None, min_em: float | None) -> Verdict:
    """`measured`: eval.report.pooled of the held-out evaluation (n, em, em_low, em_high, well_formed, searches)."""
    failures: list[str] = []
    protocol = _against("sft.min_format", min_format, measured["well_formed"], "valid format", failures)
    answers = _against("sft.min_em", min_em, measured["em"], "held-out EM", failures)
    n = int(measured["n"])
    return Verdict(lines=[
        f"protocol learned? {protocol}: valid format {measured['well_formed']:.3f}, {measured['searches']:.2f} "
        f"searches a question ({n} held-out questions)",
        f"answers learned? {answers}: held-out EM {measured['em']:.3f} (95% CI {measured['em_low']:.3f}-"
        f"{measured['em_high']:.3f}, n = {n})",
    ], failures=failures)
