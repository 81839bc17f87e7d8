"""The search agent: Search-R1's protocol, token-exact multi-turn rollouts, rollout backends."""
