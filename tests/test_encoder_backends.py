"""The encoder backends: torch, and the packaged MiniLM exported to ONNX Runtime in fp32 and int8."""

import json
import os

import numpy as np
import pytest

from retriever import encoder as encoder_module
from retriever.encoder import CPU_DEFAULT_BACKEND, Encoder, resolve_backend, resolve_dtype, resolve_encoder
from retriever.index import load_index
from retriever.manifest import Manifest
from retriever.onnx_encoder import EXPORT_VERSION, cache_folder

TEXTS = [
    "who wrote pride and prejudice?",
    "x",
    "  leading and trailing spaces  ",
    "a long passage " * 200,  # past max_length: truncated the same way by both backends
]


def test_auto_backend_is_the_measured_cpu_default_and_torch_on_a_gpu(monkeypatch):
    assert resolve_backend("auto", "cpu") == CPU_DEFAULT_BACKEND == "openvino"
    assert resolve_backend("auto", "cuda") == "torch"
    assert resolve_backend("onnx-int8") == "onnx-int8"
    for native in (True, False):
        monkeypatch.setattr(encoder_module, "native_bf16", lambda device="cpu", native=native: native)
        # bf16 asked for: openvino runs it where the CPU has bf16, torch (which emulates it) elsewhere
        assert resolve_backend("auto", "cpu", "bfloat16") == ("openvino" if native else "torch")
        assert resolve_backend("auto", "cpu", "auto") == "openvino"


def test_bad_backends_are_refused_by_name():
    with pytest.raises(ValueError, match="encoder backend must be auto or one of torch, onnx, onnx-int8, openvino, got 'tensorrt'"):
        resolve_backend("tensorrt")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_backend("onnx", "cuda")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_backend("openvino", "cuda")


def test_auto_dtype_is_bf16_where_native_for_torch_and_openvino_only(monkeypatch):
    monkeypatch.setattr(encoder_module, "native_bf16", lambda device="cpu": True)
    assert resolve_dtype("auto", backend="torch") == "bfloat16"
    assert resolve_dtype("auto", backend="openvino") == "bfloat16"
    assert resolve_dtype("auto", backend="onnx") == "float32"
    monkeypatch.setattr(encoder_module, "native_bf16", lambda device="cpu": False)
    assert resolve_dtype("auto", backend="openvino") == "float32"


def test_bf16_is_refused_for_an_onnx_backend_and_for_openvino_without_native_bf16(monkeypatch):
    with pytest.raises(ValueError, match="dtype 'bfloat16' is a torch or openvino option"):
        resolve_backend("onnx", "cpu", "bfloat16")
    monkeypatch.setattr(encoder_module, "native_bf16", lambda device="cpu": False)
    with pytest.raises(ValueError, match="needs a CPU with AVX512-BF16 or AMX"):
        resolve_backend("openvino", "cpu", "bfloat16")
    monkeypatch.setattr(encoder_module, "native_bf16", lambda device="cpu": True)
    assert resolve_backend("openvino", "cpu", "bfloat16") == "openvino"


@pytest.fixture(scope="module")
def torch_encoder():
    return Encoder(resolve_encoder("minilm"), backend="torch")


@pytest.mark.slow
def test_onnx_fp32_matches_torch_and_exports_offline(torch_encoder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    onnx = Encoder(resolve_encoder("minilm"), backend="onnx")
    assert (onnx.dim, onnx.pooling) == (torch_encoder.dim, torch_encoder.pooling)
    got, want = onnx.encode_queries(TEXTS, batch_size=3), torch_encoder.encode_queries(TEXTS)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


@pytest.mark.slow
def test_openvino_runs_the_same_graph_in_fp32_and_matches_torch(torch_encoder, monkeypatch):
    import openvino as ov

    from retriever.onnx_encoder import openvino_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    openvino = Encoder(resolve_encoder("minilm"), backend="openvino")
    assert openvino.onnx.path.name == f"emapg-v{EXPORT_VERSION}-fp32.onnx"  # the file ONNX Runtime runs
    # OpenVINO's own default is bf16 on CPUs that have it: fp32 must be what the compiled model runs.
    compiled = ov.Core().compile_model(str(openvino.onnx.path), "CPU", openvino_config("float32"))
    assert compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
    assert compiled.get_property("ENABLE_CPU_PINNING") is False  # pinned threads crawl on a shared machine
    got, want = openvino.encode_queries(TEXTS, batch_size=3), torch_encoder.encode_queries(TEXTS)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not encoder_module.native_bf16("cpu"), reason="bf16 with openvino needs a CPU with AVX512-BF16/AMX")
def test_openvino_bf16_runs_in_bf16_and_stays_close_to_torch_fp32(torch_encoder):
    import openvino as ov

    from retriever.onnx_encoder import openvino_config

    bf16 = Encoder(resolve_encoder("minilm"), dtype="bfloat16", backend="openvino")
    assert bf16.onnx.path.name == f"emapg-v{EXPORT_VERSION}-fp32.onnx"  # OpenVINO lowers the fp32 graph itself
    compiled = ov.Core().compile_model(str(bf16.onnx.path), "CPU", openvino_config("bfloat16"))
    assert compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.bf16
    got, want = bf16.encode_passages(TEXTS), torch_encoder.encode_passages(TEXTS)
    assert not np.array_equal(got, want)  # it really ran in bf16
    cosine = (got * want).sum(axis=1)
    assert cosine.min() > 0.9999, cosine  # fp32 normalisation and softmax: torch's all-bf16 model gives ~0.998


@pytest.mark.slow
@pytest.mark.skipif(not encoder_module.native_bf16("cpu"), reason="bf16 with openvino needs a CPU with AVX512-BF16/AMX")
def test_the_default_build_here_is_openvino_bf16_and_serves_fp32_queries(small_corpus, dense_index_dir, tmp_path):
    from retriever.dense import build_dense_index

    folder = tmp_path / "bf16"
    build_dense_index(small_corpus, folder, encoder="minilm", dtype=resolve_dtype("auto", backend="openvino"))
    manifest = Manifest.read(folder)
    assert (manifest.encoder.passage_backend, manifest.encoder.passage_dtype) == ("openvino", "bfloat16")
    questions = ["who wrote pride and prejudice", "famous english novelist"]
    served = load_index(folder).search(questions, 1)  # fp32 openvino queries: the probe check passes
    assert [h[0].id for h in served] == [h[0].id for h in load_index(dense_index_dir).search(questions, 1)]


@pytest.mark.slow
def test_openvino_gives_each_encoding_thread_its_own_request():
    from concurrent.futures import ThreadPoolExecutor

    openvino = Encoder(resolve_encoder("minilm"), backend="openvino")
    want = openvino.encode_queries(TEXTS)
    with ThreadPoolExecutor(4) as pool:  # an InferRequest shared across threads fails or mixes results
        results = list(pool.map(lambda _: openvino.encode_queries(TEXTS), range(16)))
    for got in results:
        np.testing.assert_array_equal(got, want)


def test_the_export_traces_eager_attention_and_leaves_the_model_as_it_was(torch_encoder, tmp_path, monkeypatch):
    from retriever import onnx_encoder

    transformer = torch_encoder.model[0].auto_model
    before = transformer.config._attn_implementation
    traced_with = []

    def fake_export(*args, **kwargs):  # a fake exporter: records the attention the real one would trace
        traced_with.append(transformer.config._attn_implementation)
        raise RuntimeError("fake export failed")

    monkeypatch.setattr(onnx_encoder.torch.onnx, "export", fake_export)
    with pytest.raises(RuntimeError, match="fake export failed"):
        onnx_encoder.export_onnx(torch_encoder.model, tmp_path / "m.onnx")
    assert traced_with == ["eager"]  # ONNX Runtime runs it faster than SDPA's trace (docs/benchmarks.md)
    assert transformer.config._attn_implementation == before  # restored, even when the export fails
    assert not (tmp_path / "m.onnx").exists() and not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
def test_onnx_int8_stays_close_to_torch_and_is_cached_beside_the_model(torch_encoder):
    int8 = Encoder(resolve_encoder("minilm"), backend="onnx-int8")
    assert int8.onnx.path.parent == cache_folder(encoder_module._load_path(encoder_module.PACKAGED_MINILM))
    assert int8.onnx.path.name.endswith("int8.onnx")
    cosine = (int8.encode_passages(TEXTS) * torch_encoder.encode_passages(TEXTS)).sum(axis=1)
    assert cosine.min() > 0.97, cosine
    mtime = int8.onnx.path.stat().st_mtime_ns
    again = Encoder(resolve_encoder("minilm"), backend="onnx-int8")
    assert again.onnx.path == int8.onnx.path and again.onnx.path.stat().st_mtime_ns == mtime  # not re-exported


def test_a_read_only_model_folder_caches_under_the_user_cache(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assert cache_folder(str(model_dir)) == model_dir / "onnx"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if os.geteuid() != 0:  # root may write anywhere: only the hub-id case can be checked then
        model_dir.chmod(0o500)
        assert cache_folder(str(model_dir)).parent == tmp_path / "cache" / "emapg" / "onnx"
    assert cache_folder("intfloat/e5-base-v2").parent == tmp_path / "cache" / "emapg" / "onnx"


@pytest.mark.slow
def test_manifest_records_the_passage_backend_and_any_backend_may_encode_queries(dense_index_dir):
    manifest = Manifest.read(dense_index_dir)
    assert manifest.encoder.passage_backend == CPU_DEFAULT_BACKEND
    questions = ["who wrote pride and prejudice", "famous english novelist"]
    by_backend = {b: load_index(dense_index_dir, query_backend=b).search(questions, 3) for b in ("torch", "onnx")}
    assert [[h.id for h in hits] for hits in by_backend["torch"]] == [[h.id for h in hits] for hits in by_backend["onnx"]]


@pytest.mark.slow
def test_an_index_from_before_backends_loads_as_torch_and_serves(dense_index_dir, tmp_path):
    from conftest import copy_index

    folder = copy_index(dense_index_dir, tmp_path / "old")
    raw = json.loads((folder / "manifest.json").read_text())
    del raw["encoder"]["passage_backend"]
    (folder / "manifest.json").write_text(json.dumps(raw))
    assert Manifest.read(folder).encoder.passage_backend == "torch"
    hits = load_index(folder).search(["who wrote pride and prejudice"], 1)
    assert hits[0][0].contents.startswith('"Pride and Prejudice"')
