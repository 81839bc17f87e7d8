"""The learner's machinery: batches, log-prob passes, LoRA, data parallelism, and the Learner (prepare + update)."""
