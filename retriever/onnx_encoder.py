"""A sentence-transformers model exported to ONNX and run on the CPU: by ONNX Runtime (fp32, or dynamically quantized
to int8) or by OpenVINO (fp32, or its bf16 mixed precision on CPUs that have bf16).

The ONNX file is exported here from the loaded PyTorch model (no download: works with HF_HUB_OFFLINE=1) and cached
beside the model, or under ~/.cache/emapg/onnx when that folder is read-only. The graph holds the transformer, the
pooling and the L2 normalisation, so one `run` gives the final embeddings. sentence-transformers' own ONNX backend
needs optimum-onnx, which pins transformers < 4.58 (this project runs 5.x), hence the export is done here.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

# Bump when the exported graph changes, so stale cached files are not reused. 2: eager attention (was SDPA).
EXPORT_VERSION = 2
ONNX_OPSET = 17
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class _PooledModel(torch.nn.Module):
    """transformer -> mean or CLS pooling over real tokens -> L2 normalisation, as sentence-transformers does it."""

    def __init__(self, transformer: torch.nn.Module, pooling: str, input_names: list[str]):
        super().__init__()
        self.transformer = transformer
        self.pooling = pooling
        self.input_names = input_names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        named = dict(zip(self.input_names, inputs, strict=True))
        hidden = self.transformer(**named).last_hidden_state
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            mask = named["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)


def pooling_mode(model) -> str:
    """The one pooling the exported graph can reproduce ("mean" or "cls"), else a clear error."""
    kinds = [type(m).__name__ for m in model]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise ValueError(f"the onnx backends take Transformer -> Pooling [-> Normalize] models, this one is {kinds}")
    mode = str(model[1].pooling_mode)
    if mode not in ("mean", "cls"):
        raise ValueError(f"the onnx backends support mean or cls pooling, this model pools with {mode!r}")
    return mode


def cache_folder(model_dir: str) -> Path:
    """`<model>/onnx/` when the model is a writable local folder, else a per-model folder under ~/.cache/emapg."""
    local = Path(model_dir)
    if local.is_dir() and os.access(local, os.W_OK):
        return local / "onnx"
    key = hashlib.sha256(model_dir.encode()).hexdigest()[:16]
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "emapg" / "onnx" / key


def _write_atomically(path: Path, write) -> None:
    """Write through a temp file in the same folder, then rename: concurrent server workers never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".onnx.tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def export_onnx(model, path: Path) -> None:
    """Trace the fp32 model with dynamic batch and sequence axes (the legacy exporter: the dynamo one needs
    onnxscript, which nothing else here uses). Attention is traced in its eager form: plain MatMul / Softmax
    nodes, which ONNX Runtime runs ~20% faster on a CPU than the graph traced from PyTorch's SDPA
    (docs/benchmarks.md, "Encoder backends"); the embeddings are the same to 1e-7."""
    sample = model.tokenizer(["an example", "a longer example sentence"], padding=True, return_tensors="pt")
    names = [n for n in TOKEN_INPUTS if n in sample]
    transformer = model[0].auto_model
    wrapped = _PooledModel(transformer, pooling_mode(model), names).float().eval()
    dynamic = {n: {0: "batch", 1: "tokens"} for n in names} | {"embedding": {0: "batch"}}

    def write(tmp: Path) -> None:
        with torch.inference_mode():
            torch.onnx.export(
                wrapped, tuple(sample[n] for n in names), str(tmp), input_names=names, output_names=["embedding"],
                dynamic_axes=dynamic, opset_version=ONNX_OPSET, dynamo=False,
            )

    previous = transformer.config._attn_implementation
    transformer.set_attn_implementation("eager")
    try:
        _write_atomically(path, write)
    finally:
        transformer.set_attn_implementation(previous)


def quantize_int8(fp32_path: Path, path: Path) -> None:
    """Dynamic int8 quantization of the weights of every MatMul with a constant weight (activations are quantized
    per batch at run time); per-channel scales keep the embeddings closest to fp32 (docs/benchmarks.md)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    _write_atomically(
        path,
        lambda tmp: quantize_dynamic(
            fp32_path, tmp, weight_type=QuantType.QInt8, per_channel=True, extra_options={"MatMulConstBOnly": True}
        ),
    )


def onnx_model_file(model, model_dir: str, int8: bool) -> Path:
    """The cached ONNX file for this model (exported, and quantized, on first use)."""
    folder = cache_folder(model_dir)
    fp32 = folder / f"emapg-v{EXPORT_VERSION}-fp32.onnx"
    if not fp32.exists():
        export_onnx(model, fp32)
    if not int8:
        return fp32
    quantized = folder / f"emapg-v{EXPORT_VERSION}-int8.onnx"
    if not quantized.exists():
        quantize_int8(fp32, quantized)
    return quantized


def onnxruntime_session(path: Path, dtype: str = "float32"):
    """(input names, run(feed) -> embeddings) for ONNX Runtime's CPU provider; `run` is thread-safe."""
    if dtype != "float32":  # retriever.encoder.resolve_backend refuses it first, with the CLI's wording
        raise ValueError(f"ONNX Runtime runs this graph in float32 only, got {dtype!r}")
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.inter_op_num_threads = 1
    # Threads that spin after each run take the CPU from the server's event loop on small machines.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return [i.name for i in session.get_inputs()], lambda feed: session.run(None, feed)[0]


def openvino_config(dtype: str) -> dict[str, str]:
    """OpenVINO's CPU plugin computes in bf16 by default on CPUs with AVX512-BF16 or AMX, so the precision is always
    asked for. bf16 is its mixed precision (bf16 matmuls, fp32 LayerNorm / Softmax / accumulation), which keeps
    retrieval where torch's all-bf16 model does not (docs/benchmarks.md). LATENCY: one stream on all cores, what both
    a lone query and a sorted index-build batch want on a small machine. No thread pinning: its threads pinned to
    cores that a trainer or rollout engine also uses encoded 12x slower (1.9 against 23 passages/s on 2 busy cores),
    each parallel step waiting for its preempted thread."""
    return {
        "INFERENCE_PRECISION_HINT": "bf16" if dtype == "bfloat16" else "f32",
        "PERFORMANCE_HINT": "LATENCY",
        "ENABLE_CPU_PINNING": "NO",
    }


def openvino_session(path: Path, dtype: str = "float32"):
    """(input names, run(feed) -> embeddings) for OpenVINO's CPU plugin. An infer request serves one call at a time,
    so each thread that encodes (the server's search threads) gets its own."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(path), "CPU", openvino_config(dtype))
    per_thread = threading.local()

    def run(feed: dict[str, np.ndarray]) -> np.ndarray:
        if not hasattr(per_thread, "request"):
            per_thread.request = compiled.create_infer_request()
        return per_thread.request.infer(feed)[0]  # the request's buffer: `encode` copies it out before the next call

    return [i.get_any_name() for i in compiled.inputs], run


RUNTIMES = {"onnxruntime": onnxruntime_session, "openvino": openvino_session}


class OnnxEncoder:
    """Runs the exported graph; tokenizes with the model's own tokenizer, so inputs match the PyTorch path."""

    def __init__(
        self, model, model_dir: str, int8: bool, dim: int, runtime: str = "onnxruntime", dtype: str = "float32"
    ):
        self.model = model
        self.dim = dim
        self.path = onnx_model_file(model, model_dir, int8)
        self.input_names, self._run = RUNTIMES[runtime](self.path, dtype)

    def encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        # Longest first and padded per batch, like sentence-transformers: short texts are not padded to long ones.
        order = np.argsort([-len(t) for t in texts], kind="stable")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(texts), batch_size):
            rows = order[start : start + batch_size]
            features = self.model.preprocess([texts[i] for i in rows])
            feed = {n: features[n].numpy().astype(np.int64, copy=False) for n in self.input_names}
            out[rows] = self._run(feed)
        return out
