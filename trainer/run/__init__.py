"""A training run: the loop, its workers (in process or on Ray), SFT, the guard, checkpoints and logs."""
