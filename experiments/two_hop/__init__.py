"""The two-hop study with the real policy (issue 33; its plan: docs/study_two_hop_plan.md)."""
