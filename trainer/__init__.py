"""The EMA-PG learner: KL estimators, policy-gradient losses, the EMA anchor, the training loop."""
