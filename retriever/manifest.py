"""The manifest of an index folder: what built it, so a server never searches with the wrong encoder or corpus."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError, field_validator, model_validator

from retriever.encoder import Encoder, EncoderSpec
from retriever.kinds import index_kind

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
# bf16 or int8 query encoding moves the probe embedding by ~1e-3 to 1e-2 in cosine; another model by far more.
PROBE_MIN_COSINE = 0.98


class EncoderManifest(BaseModel):
    name: str
    source: str
    dim: int
    pooling: str
    normalize: bool = True
    query_prefix: str
    passage_prefix: str
    max_length: int
    passage_dtype: str = "float32"
    # The backend that encoded the passages (retriever/encoder.py BACKENDS); manifests from before it were torch's.
    # Queries may be encoded by another backend of the same model: the probe check below is what must hold.
    passage_backend: str = "torch"
    probe_embedding: list[float]


class BM25Manifest(BaseModel):
    stopwords: str = "en"
    k1: float = 1.5
    b: float = 0.75
    method: str = "lucene"


class CorpusManifest(BaseModel):
    path: str  # relative to the index folder when the corpus was copied in, else absolute
    sha256: str
    num_bytes: int
    num_docs: int


class IndexFileManifest(BaseModel):
    """The backend's main file as it was written, so a truncated, replaced or corrupted file is refused at load by
    name instead of being searched (or crashing FAISS)."""

    name: str  # relative to the index folder
    num_bytes: int
    # sha256 of the first and last MiB: reading a 64 GB file whole at every start would take minutes; a truncated
    # file fails the size check, an overwritten one (another index, garbage) its header or tail.
    ends_sha256: str


class SearchTuning(BaseModel):
    """The search parameters chosen at build time for a target recall, and the recall measured with them."""

    params: str  # FAISS ParameterSpace string the server applies at load ("nprobe=32,k_factor_rf=4"; "" for none)
    k: int
    target_recall: float
    recall: float  # mean recall@k against exact inner-product search over the same vectors, at `params`
    reached: bool  # False: even the most expensive setting tried stayed below the target; `params` is that setting
    queries: int
    query_source: str  # how the tuning queries were made


class Manifest(BaseModel):
    format_version: int = FORMAT_VERSION
    kind: str  # a name of retriever/kinds.py's INDEX_KINDS
    metric: str  # that kind's
    index_factory: str | None = None
    encoder: EncoderManifest | None = None
    bm25: BM25Manifest | None = None
    params: dict[str, Any] | None = None  # a newer backend's own settings (dense and BM25 have typed sections above)
    index_file: IndexFileManifest | None = None  # absent in manifests written before it was recorded
    tuning: SearchTuning | None = None
    corpus: CorpusManifest
    created: str = ""

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        index_kind(kind)
        return kind

    @model_validator(mode="after")
    def _kinds_metric(self) -> Manifest:
        if self.metric != index_kind(self.kind).metric:
            raise ValueError(f"a {self.kind} index scores by {index_kind(self.kind).metric}, not {self.metric}")
        return self

    def write(self, folder: Path) -> None:
        self.created = self.created or datetime.now(UTC).isoformat(timespec="seconds")
        tmp = Path(folder) / (MANIFEST_FILE + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        tmp.replace(Path(folder) / MANIFEST_FILE)

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = Path(folder) / MANIFEST_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is not an index folder: no {MANIFEST_FILE} (build one with `emapg index`)")
        try:
            manifest = cls.model_validate(json.loads(path.read_text()))
        except (json.JSONDecodeError, ValidationError) as e:
            raise ValueError(f"{path} is corrupt or from another tool: {e}") from e
        if manifest.format_version != FORMAT_VERSION:
            raise ValueError(f"{path}: index format {manifest.format_version}, this version reads {FORMAT_VERSION}")
        return manifest


def encoder_manifest(encoder: Encoder) -> EncoderManifest:
    return EncoderManifest(
        **encoder.spec.model_dump(),
        dim=encoder.dim,
        pooling=encoder.pooling,
        passage_dtype=encoder.dtype,
        passage_backend=encoder.backend,
        probe_embedding=encoder.probe_embedding(),
    )


def spec_from_manifest(m: EncoderManifest) -> EncoderSpec:
    return EncoderSpec(**m.model_dump(include=set(EncoderSpec.model_fields)))


class EncoderMismatchError(ValueError):
    """The encoder asked for is not the one the index was built with."""


def check_requested_encoder(index_encoder: EncoderManifest, requested: EncoderSpec) -> None:
    """Refuse before loading any weights when the name or prefixes differ from the index's."""
    for field in ("name", "query_prefix", "passage_prefix"):
        want, have = getattr(index_encoder, field), getattr(requested, field)
        if want != have:
            raise EncoderMismatchError(
                f"encoder mismatch on {field}: the index was built with {want!r}, the server was asked for {have!r}; "
                "queries would be embedded in a different space than the passages. Serve with the index's "
                "encoder or rebuild the index."
            )


def check_loaded_encoder(index_encoder: EncoderManifest, encoder: Encoder) -> None:
    """Refuse a loaded model whose dimension, pooling or probe embedding differ from what built the index."""
    if encoder.dim != index_encoder.dim or encoder.pooling != index_encoder.pooling:
        raise EncoderMismatchError(
            f"encoder mismatch: index has dim={index_encoder.dim} pooling={index_encoder.pooling}, "
            f"loaded {encoder.spec.source!r} has dim={encoder.dim} pooling={encoder.pooling}"
        )
    a, b = index_encoder.probe_embedding, encoder.probe_embedding()
    cosine = sum(x * y for x, y in zip(a, b, strict=True)) / (
        math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    )
    if cosine < PROBE_MIN_COSINE:
        raise EncoderMismatchError(
            f"encoder mismatch: {encoder.spec.source!r} embeds the probe text differently from the model that built "
            f"the index (cosine {cosine:.3f} < {PROBE_MIN_COSINE}); same name, different weights?"
        )
