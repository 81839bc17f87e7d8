"""The weight-sync file (agent/vllm_backend.py): what the trainer writes is what the engine's worker reads, bit for
bit, for every dtype and shape a policy has, at every sync of one mapping; no file is left behind."""

import os
import shutil
from collections import namedtuple

import pytest
import torch

from agent import vllm_backend
from agent.vllm_backend import SharedWeights, map_weight_file, read_weight_file, write_weight_file


def test_weight_file_round_trips_every_tensor_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": torch.randn(37, 11, generator=generator),  # odd sizes: offsets need aligning
        "model.layers.0.self_attn.q_proj.weight": torch.randn(11, 11, generator=generator).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(11, generator=generator).half(),
        "scale": torch.tensor(3.5, dtype=torch.float64),  # a 0-d tensor
        "positions": torch.arange(5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(6, 8, generator=generator).t(),  # not contiguous
    }
    path, layout, _ = write_weight_file(weights.items())
    try:
        read = dict(read_weight_file(map_weight_file(path), layout))
        assert list(read) == list(weights)
        for name, tensor in weights.items():
            assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
            assert torch.equal(read[name], tensor), name
            assert read[name].data_ptr() % vllm_backend.WEIGHT_FILE_ALIGN == 0, name
    finally:
        os.unlink(path)


def test_weight_file_falls_back_to_the_temporary_directory_when_shared_memory_is_small(monkeypatch, tmp_path):
    """Docker's default /dev/shm is 64 MiB, smaller than a 135M-parameter policy."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, 64 << 20))
    monkeypatch.setattr(vllm_backend.tempfile, "tempdir", str(tmp_path))
    assert vllm_backend.weight_file_dir(100 << 20) == str(tmp_path)
    if os.path.isdir("/dev/shm"):
        assert vllm_backend.weight_file_dir(1 << 20) == "/dev/shm"


def test_weight_file_is_removed_when_writing_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_backend, "weight_file_dir", lambda nbytes: str(tmp_path))

    # A meta tensor has a shape and a dtype but no data: the file is made, then copying into it fails.
    with pytest.raises((NotImplementedError, RuntimeError)):
        write_weight_file([("ok", torch.ones(3)), ("no data", torch.empty(3, device="meta"))])
    assert list(tmp_path.iterdir()) == []


class FakeWorker:
    """A fake of the engine's worker side of the sync (WeightSyncExtension.load_policy_weights without vLLM): maps
    the file when given a path, then reads every later sync from that mapping."""

    def __init__(self):
        self.buffer, self.paths, self.seen = None, [], []

    def load(self, path, layout):
        self.paths.append(path)
        if path is not None:
            assert os.path.exists(path)  # the file is still there while the workers map it
            self.buffer = map_weight_file(path)
        self.seen.append({name: tensor.clone() for name, tensor in read_weight_file(self.buffer, layout)})


def test_shared_weights_reuse_one_mapping_and_leave_no_file(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_backend, "weight_file_dir", lambda nbytes: str(tmp_path))
    generator = torch.Generator().manual_seed(0)
    shared, worker = SharedWeights(), FakeWorker()
    syncs = [{"w": torch.randn(5, 3, generator=generator), "b": torch.randn(3, generator=generator)} for _ in range(3)]
    for weights in syncs:
        shared.sync(weights.items(), worker.load)
        assert list(tmp_path.iterdir()) == []  # unlinked once the worker mapped it
    assert worker.paths[0] is not None and worker.paths[1:] == [None, None]  # one file, mapped once
    for weights, seen in zip(syncs, worker.seen, strict=True):
        assert all(torch.equal(seen[name], tensor) for name, tensor in weights.items())

    bigger = {"w": torch.randn(6, 3, generator=generator), "b": torch.randn(3, generator=generator)}
    shared.sync(bigger.items(), worker.load)  # a new layout: a new file, mapped anew
    assert worker.paths[-1] is not None and list(tmp_path.iterdir()) == []
    assert all(torch.equal(worker.seen[-1][name], tensor) for name, tensor in bigger.items())


def test_shared_weights_make_a_new_file_after_a_failed_first_load(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_backend, "weight_file_dir", lambda nbytes: str(tmp_path))

    def failing_load(path, layout):
        raise RuntimeError("the engine died")

    shared, worker = SharedWeights(), FakeWorker()
    with pytest.raises(RuntimeError):
        shared.sync([("w", torch.ones(2))], failing_load)
    assert list(tmp_path.iterdir()) == []
    shared.sync([("w", torch.ones(2))], worker.load)
    assert worker.paths == [worker.paths[0]] and worker.paths[0] is not None  # not a reuse of a mapping never made
