"""Evaluation: answer metrics with FlashRAG/SQuAD semantics and the QA benchmark harness."""
