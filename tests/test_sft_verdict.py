"""The SFT start's verdict: each floor that is set and not met fails it, naming the floor and the measured value."""

from eval.sft_verdict import sft_verdict

MEASURED = {"n": 40, "em": 0.15, "em_low": 0.071, "em_high": 0.291, "well_formed": 1.0, "searches": 1.2}


def test_unset_floors_are_reported_and_never_fail():
    verdict = sft_verdict(MEASURED, None, None)
    assert verdict.ok and not verdict.failures
    assert verdict.lines[0].startswith("protocol learned? unchecked (sft.min_format not set): valid format 1.000")
    assert "1.20 searches a question (40 held-out questions)" in verdict.lines[0]
    assert verdict.lines[1].startswith("answers learned? unchecked (sft.min_em not set): held-out EM 0.150")


def test_floors_met_pass_and_floors_missed_fail_by_name_with_the_measured_value():
    assert sft_verdict(MEASURED, 0.9, 0.15).ok  # a floor is met at equality
    verdict = sft_verdict({**MEASURED, "well_formed": 0.25, "em": 0.0}, 0.5, 0.1)
    assert not verdict.ok
    assert verdict.failures == ["sft.min_format = 0.5 not met: valid format 0.250",
                                "sft.min_em = 0.1 not met: held-out EM 0.000"]
    assert verdict.lines[0].startswith("protocol learned? NO: below sft.min_format = 0.5")
    only_em = sft_verdict(MEASURED, 0.5, 0.2)
    assert only_em.failures == ["sft.min_em = 0.2 not met: held-out EM 0.150"]
    assert only_em.lines[0].startswith("protocol learned? yes: at least sft.min_format = 0.5")
