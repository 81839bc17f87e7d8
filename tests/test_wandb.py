"""Weights & Biases (logging.wandb): an offline run writes, under the run folder, the metrics it logged, the run's
config and the attached reports. Read back from the run's own record file (run-<id>.wandb), not from the folder's
existence."""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path

import pytest
from test_training import make_trainer, tiny_config

BLOCK = 32 * 1024  # the record log's block size (LevelDB's log format, which wandb's datastore follows)
HEADER = struct.Struct("<IHB")  # crc32, length, type of each record fragment
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    """Every protobuf Record of a .wandb file: a 7-byte file header (":W&B", 0xBEE1, version 0), then records cut
    into fragments that never cross a 32 KiB block (a block's tail shorter than a fragment header is zero-padded)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, offset = [], b"", 7
    while offset + HEADER.size <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER.size:
            offset += room
            continue
        crc, length, kind = HEADER.unpack_from(data, offset)
        if length == 0 and kind == 0:  # zero padding at the end of a block
            offset += room
            continue
        if offset + HEADER.size + length > len(data):  # the writer is still appending this one
            break
        payload = data[offset + HEADER.size : offset + HEADER.size + length]
        assert zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF == crc, f"bad crc at {offset}"
        offset += HEADER.size + length
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def finished_records(path: Path, timeout_s: float = 120) -> list:
    """The file's records once its run has ended: `run.finish()` returns when the exit is sent to wandb's service
    process, whose writer may still be appending (seen under load); its last record is then `exit`."""
    deadline = time.monotonic() + timeout_s  # a hang guard only
    while True:
        records = read_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.2)


def records_of(run_dir: Path, kind: str) -> list:
    return [getattr(r, kind) for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
            for r in finished_records(path) if r.WhichOneof("record_type") == kind]


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def test_an_offline_run_writes_its_metrics_config_and_reports_under_the_run_folder(tmp_path, tiny_model, tokenizer):
    from trainer.run.wandb_logger import attach_run_reports

    cfg = tiny_config(tmp_path, "train.iterations=2", "logging.wandb.mode=offline", "logging.wandb.project=emapg-test",
                      "logging.wandb.tags=[unit]")
    history = make_trainer(cfg, tiny_model, tokenizer).run()
    run_dir = cfg.run_dir

    logged = [{item_key(item): json.loads(item.value_json) for item in h.item} for h in records_of(run_dir, "history")]
    assert [row["iteration"] for row in logged] == [1, 2]
    for row, metrics in zip(logged, history, strict=True):
        for key, value in metrics.items():
            assert row[key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), key  # grad/ ratios may be NaN

    (run,) = records_of(run_dir, "run")  # the run's header, with the config it started with
    config = {item_key(item): json.loads(item.value_json) for item in run.config.update}
    assert config["kl"]["estimator"] == "topk" and config["logging"]["wandb"]["mode"] == "offline"
    assert run.project == "emapg-test" and list(run.tags) == ["unit"] and run.display_name == "run"

    (run_dir / "report.json").write_text(json.dumps({"em": 0.25}))
    attach_run_reports(cfg, [run_dir / "report.json", run_dir / "no-such-plot.png"])  # missing files are skipped
    (artifact,) = records_of(run_dir, "artifact")
    assert artifact.type == "report" and [entry.path for entry in artifact.manifest.contents] == ["report.json"]
    # Folders are offline-run-<YYYYMMDD_HHMMSS>-<run id>, with "-1" appended when the report's resume of the run falls
    # in the same second as its start (seen on a fast machine).
    ids = {path.name.split("-")[3] for path in (run_dir / "wandb").glob("offline-run-*")}
    assert ids == {(run_dir / "wandb_id.txt").read_text()}  # one W&B run: the report joins the training run


def test_wandb_is_off_by_default(tmp_path, tiny_model, tokenizer):
    cfg = tiny_config(tmp_path, "train.iterations=1")
    make_trainer(cfg, tiny_model, tokenizer).run()
    assert (cfg.run_dir / "metrics.jsonl").exists() and not (cfg.run_dir / "wandb").exists()
