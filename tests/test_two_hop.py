"""The two-hop study's inputs (experiments/two_hop/prepare.py): its FlashRAG-format sets load through the loader every
run uses, the primary set holds the two-hop questions only, and the config reads them where prepare writes them."""

from __future__ import annotations

import numpy as np

from data.qa import load_flashrag
from experiments.mechanism.kb import KBSpec, generate_kb
from experiments.two_hop.prepare import CONFIG, TWO_HOP, write_sets
from trainer.config import load_config


def test_the_sets_split_two_hop_from_one_hop_and_load_as_flashrag_sets(tmp_path):
    kb = generate_kb(KBSpec(train_people=30, test_people=10, train_cities=6, test_cities=3, countries=3))
    rng = np.random.default_rng(0)
    train, test = kb.questions("train", 40, rng), kb.questions("test", 20, rng)
    counts = write_sets(tmp_path, train, test)
    two_hop = [q for q in test if q.kind == TWO_HOP]
    assert counts == {"kb/train": 40, "kb-2hop/test": len(two_hop), "kb-1hop/test": 20 - len(two_hop)}
    loaded = load_flashrag("kb-2hop", "test", root=tmp_path)
    assert [(e.question, e.golden_answers) for e in loaded] == [(q.example.question, q.example.golden_answers)
                                                                for q in two_hop]
    assert all(e.question.startswith("In which country was person") for e in loaded)
    assert len({e.id for e in load_flashrag("kb", "train", root=tmp_path)}) == 40  # ids unique: GRPO groups


def test_the_config_reads_the_sets_and_index_where_prepare_writes_them():
    cfg = load_config(CONFIG)
    assert cfg.data.train == ["kb:train"] and cfg.data.eval == ["kb-2hop:test"] and cfg.data.subset == "full"
    assert cfg.data.flashrag_root == cfg.out_dir / "flashrag" and cfg.retriever.index == cfg.out_dir / "index"
    assert cfg.retriever.topk == 1  # the answer ends its one document (kb.py)
