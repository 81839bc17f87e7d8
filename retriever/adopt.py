"""Adopting a FAISS index built elsewhere (Search-R1's `e5_Flat.index` over wiki-18): our manifest is written beside
it without re-encoding the corpus, after the checks that are cheap enough to run on a 60 GB index.

Row i of the FAISS file must be line i of the corpus, embedded by the named encoder. What is checked, in order, each
refusing by name: the metric (inner product), the vector count against the corpus's lines, the dimension against
the encoder's, the norms of sampled vectors (unit length), then a sample of passages re-encoded here: the cosine
between each stored vector and its re-encoding, and whether each re-encoded passage finds its own row first. The
stored values also say the precision the passages were encoded in (Search-R1's builder runs e5 in fp16).

The FAISS file is not copied unless asked: `index.faiss` in the folder is a symlink to it (or a hard link), and the
manifest's `adopted` section says which. The corpus is referenced by its absolute path unless copied, as with
`emapg index --no-copy-corpus`.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import faiss
import numpy as np
from pydantic import BaseModel

from retriever.build import add_corpus, building_folder, finish_build
from retriever.dense import FAISS_FILE
from retriever.docstore import DocStore
from retriever.encoder import PRESETS, Encoder, EncoderSpec, resolve_encoder
from retriever.faiss_file import read_faiss_file
from retriever.manifest import Manifest, encoder_manifest

Link = Literal["symlink", "hardlink", "copy"]
LINKS: tuple[str, ...] = ("symlink", "hardlink", "copy")
DEFAULT_SAMPLE = 64
# `--sample all`: every corpus row re-encoded and checked (as long as encoding the corpus: docs/retriever.md).
ALL_ROWS = "all"
# The packaged encoder's other common names (sentence-transformers' short and full ones), adopted as the preset.
ENCODER_ALIASES = {"all-minilm-l6-v2": "minilm", "sentence-transformers/all-minilm-l6-v2": "minilm"}
# One look-up of a hub id that is not cached locally: the hub answers in well under a second where it is reachable.
HUB_TIMEOUT_S = 10.0
# Rows whose norms are read: random rows cost one page each even when the index is memory-mapped.
NORM_SAMPLE = 1024
# Unit vectors stored in fp16 are off by < 1e-3; an encoder without normalisation is off by far more.
NORM_TOLERANCE = 1e-2
# Same model, same text: >= 0.99999 from passages encoded in fp16 (MiniLM on the CPU), >= 0.998 from our bf16 ones.
# The next row's passage scores <= 0.80 (400 packaged); a dropped prefix ("passage: " on e5) is subtler: MiniLM
# with and without one gives a median 0.995 but a min of 0.965 over 400 passages, so every sampled passage must pass,
# not their median.
PASSAGE_MIN_COSINE = 0.99
# Search-R1's server adds these when its retriever's name contains the key (search_r1/search/retrieval_server.py,
# Encoder.encode); its index builder adds the e5 passage prefix for retrieval_method "e5".
SEARCH_R1_PREFIXES: dict[str, tuple[str, str]] = {
    "e5": ("query: ", "passage: "),
    "bge": ("Represent this sentence for searching relevant passages: ", ""),
}
# The field our adopted manifests give `encoder.passage_backend`: the passages were encoded by another program.
EXTERNAL_BACKEND = "external"


class Check(BaseModel):
    """One check of the FAISS file against the corpus and the encoder, and what it found."""

    name: str  # "metric", "vector count", "dimension", "normalisation", "precision", "passage cosine", "top-1"
    ok: bool
    found: str


class Adoption(BaseModel):
    """How an adopted index folder holds its FAISS file, and what was checked before the manifest was written."""

    source: str  # the FAISS file's absolute path when adopted
    link: Link  # symlink: index.faiss points at `source`; hardlink: the same file under two names; copy: a copy
    num_bytes: int
    faiss_type: str
    sample: int  # passages re-encoded
    checks: list[Check]


class AdoptedManifest(Manifest):
    """Our manifest plus the `adopted` section. The server reads it as a plain Manifest (pydantic ignores the extra
    section), so an adopted folder serves like any other."""

    adopted: Adoption


class AdoptionRefused(ValueError):
    """A check failed: the FAISS file is not this corpus embedded by this encoder. Carries the checks so far."""

    def __init__(self, check: Check, checks: list[Check]):
        super().__init__(f"refused: {check.name}: {check.found}")
        self.check = check
        self.checks = checks


class EncoderUnavailable(ValueError):
    """The named encoder cannot be loaded here: not a local folder, not packaged, not in the local Hugging Face cache,
    and the hub cannot be reached (or HF_HUB_OFFLINE is set)."""


def encoder_alias(name: str) -> str:
    """`name`, or the preset key of the packaged encoder it is a common name of (any case)."""
    return ENCODER_ALIASES.get(name.lower(), name)


def local_encoders() -> list[str]:
    """Encoder names that load without the network here: the packaged presets and the hub models already cached."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    packaged = [key for key, spec in PRESETS.items() if spec.source.startswith("package:") and key != spec.name]
    try:
        cached = sorted(repo.repo_id for repo in scan_cache_dir().repos if repo.repo_type == "model")
    except CacheNotFound:
        cached = []
    return packaged + cached


def check_encoder_loads(spec: EncoderSpec) -> None:
    """Raise EncoderUnavailable, at once, for an encoder that would not load: a hub id neither cached locally nor on a
    hub that answers now. Without this the loader retries the network for over a minute and ends in a traceback."""
    from huggingface_hub import constants, model_info, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if spec.source.startswith("package:") or Path(spec.source).exists():
        return
    try:
        snapshot_download(spec.source, local_files_only=True)
        return
    except (LocalEntryNotFoundError, ValueError):  # ValueError: not a valid hub id either
        pass
    if constants.HF_HUB_OFFLINE:
        reason = "HF_HUB_OFFLINE is set"
    else:
        try:
            model_info(spec.source, timeout=HUB_TIMEOUT_S)
            return  # on the hub: the loader downloads it
        except Exception as e:  # noqa: BLE001 - whatever the hub answers (no network, no such repo), it will not load
            reason = f"the hub cannot be reached or has no such model ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e})"
    raise EncoderUnavailable(
        f"encoder {spec.name!r} is neither a local folder, a packaged encoder, nor a model in the local Hugging Face "
        f"cache ({constants.HF_HUB_CACHE}), and {reason}; encoders that load here: {', '.join(local_encoders())} "
        "(or a local folder of a sentence-transformers model)")


def search_r1_encoder(name: str, query_prefix: str | None = None, passage_prefix: str | None = None) -> EncoderSpec:
    """The encoder spec for an index Search-R1 built: a preset (e5-base-v2 carries e5's prefixes) or a folder or hub
    id whose last path part names e5 or bge gets the prefixes Search-R1 gives that family; explicit prefixes win."""
    name = encoder_alias(name)
    spec = resolve_encoder(name, query_prefix, passage_prefix)
    if name in PRESETS:
        return spec
    family = Path(name.rstrip("/")).name.lower()
    for key, (query, passage) in SEARCH_R1_PREFIXES.items():
        if key in family:
            updates = {"query_prefix": query, "passage_prefix": passage}
            updates |= {k: v for k, v in (("query_prefix", query_prefix), ("passage_prefix", passage_prefix))
                        if v is not None}
            return spec.model_copy(update=updates)
    return spec


def stored_precision(vectors: np.ndarray) -> Literal["float32", "float16", "bfloat16"]:
    """The precision the stored vectors were computed in: fp16 or bf16 values cast to fp32 are exactly
    representable in fp16 (bf16: the low 16 bits are zero); fp32 ones almost never all are."""
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    if not np.any(v.view(np.uint32) & 0xFFFF):
        return "bfloat16"
    if np.array_equal(v.astype(np.float16).astype(np.float32), v):
        return "float16"
    return "float32"


def faiss_type(index: faiss.Index) -> str:
    """`Flat` for a flat index, as our own builds record it; else FAISS's class name (IndexHNSWFlat, ...)."""
    name = type(faiss.downcast_index(index)).__name__
    return "Flat" if name in ("IndexFlatIP", "IndexFlat", "IndexFlatL2") else name


def stored_vectors(index: faiss.Index, rows: np.ndarray) -> np.ndarray:
    try:
        return index.reconstruct_batch(rows)
    except RuntimeError:
        pass
    try:  # IVF indexes reconstruct by id only through a direct map
        faiss.extract_index_ivf(index).make_direct_map()
        return index.reconstruct_batch(rows)
    except (RuntimeError, AttributeError) as e:
        raise ValueError(f"cannot read stored vectors back from a {faiss_type(index)} index, so it cannot be checked: "
                         f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}") from e


def sample_size(value: str) -> int | Literal["all"]:
    """`--sample`: a number of passages (>= 1) or `all`."""
    if value.strip().lower() == ALL_ROWS:
        return ALL_ROWS
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"--sample must be a number of passages (>= 1) or {ALL_ROWS!r}, got {value!r}")
    return size


def sample_rows(n: int, size: int, seed: int) -> np.ndarray:
    """`size` rows at random, always with the first and last: a corpus cut short or shifted by one shows at its ends."""
    rng = np.random.default_rng(seed)
    chosen = rng.choice(n, size=min(size, n), replace=False) if size < n else np.arange(n)
    return np.unique(np.concatenate([chosen, [0, n - 1]])).astype(np.int64)


def _place(source: Path, target: Path, link: Link) -> None:
    if link == "symlink":
        os.symlink(source, target)
    elif link == "hardlink":
        try:
            os.link(source, target)
        except OSError as e:
            if e.errno == errno.EXDEV:
                raise ValueError(f"cannot hard-link {source} into {target.parent}: another filesystem; use "
                                 "--link symlink (or copy)") from e
            raise
    else:
        shutil.copyfile(source, target)


def _inside(path: Path, folder: Path) -> bool:
    return folder.resolve() in path.resolve().parents


def adopt_faiss_index(
    faiss_file: Path,
    corpus: Path,
    out: Path,
    *,
    encoder: str,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    link: Link = "symlink",
    copy_corpus: bool = False,
    sample: int | Literal["all"] = DEFAULT_SAMPLE,
    seed: int = 0,
    device: str = "cpu",
    backend: str = "auto",
    overwrite: bool = False,
    on_check: Callable[[Check], None] | None = None,
) -> AdoptedManifest:
    """Write an index folder at `out` around `faiss_file` (row i = line i of `corpus`, embedded by `encoder`),
    or raise AdoptionRefused naming the first check that failed; `out` is then left as it was."""
    faiss_file, out = Path(faiss_file).resolve(), Path(out)
    if link not in LINKS:
        raise ValueError(f"--link must be one of {', '.join(LINKS)}, got {link!r}")
    if not faiss_file.is_file():
        raise FileNotFoundError(f"FAISS file {faiss_file} does not exist")
    # The build replaces `out` whole: a source inside it would be deleted with it.
    for what, path in (("the FAISS file", faiss_file), ("the corpus", Path(corpus))):
        if out.exists() and _inside(path, out):
            raise ValueError(f"{what} {path} is inside --out {out}, which adopting replaces; choose another --out")
    spec = search_r1_encoder(encoder, query_prefix, passage_prefix)
    check_encoder_loads(spec)
    index = read_faiss_file(faiss_file.parent, faiss_file.name, None)  # memory-mapped: a 60 GB Flat is paged in as read
    checks: list[Check] = []

    def record(name: str, ok: bool, found: str) -> None:
        check = Check(name=name, ok=ok, found=found)
        checks.append(check)
        if on_check is not None:
            on_check(check)
        if not ok:
            raise AdoptionRefused(check, checks)

    metric = {faiss.METRIC_INNER_PRODUCT: "inner product", faiss.METRIC_L2: "L2"}.get(index.metric_type,
                                                                                         str(index.metric_type))
    record("metric", index.metric_type == faiss.METRIC_INNER_PRODUCT,
           f"{faiss_type(index)} index searched by {metric}" + (
               "" if index.metric_type == faiss.METRIC_INNER_PRODUCT else
               "; the server scores by inner product (cosine on unit vectors), as Search-R1's builder does"))
    tmp = building_folder(out, overwrite)
    docstore: DocStore | None = None
    try:
        corpus_manifest, docstore = add_corpus(tmp, corpus, copy_corpus)
        n = len(docstore)
        record("vector count", index.ntotal == n,
               f"{index.ntotal:,} vectors in {faiss_file.name}, {n:,} passages in {Path(corpus).name}"
               + ("" if index.ntotal == n else "; row i must be line i of the corpus the index was built from"))
        enc = Encoder(spec, device=device, dtype="float32", backend=backend)
        record("dimension", index.d == enc.dim,
               f"{index.d} in {faiss_file.name}, {enc.dim} from {spec.name}"
               + ("" if index.d == enc.dim else "; the index was built with another encoder"))

        rows = sample_rows(n, n if sample == ALL_ROWS else sample, seed)
        norm_rows = np.union1d(rows, np.random.default_rng(seed + 1).choice(n, size=min(NORM_SAMPLE, n), replace=False))
        vectors = stored_vectors(index, norm_rows)
        norms = np.linalg.norm(vectors, axis=1)
        worst = float(np.max(np.abs(norms - 1.0)))
        record("normalisation", worst <= NORM_TOLERANCE,
               f"norms of {len(norm_rows):,} sampled vectors in [{norms.min():.4f}, {norms.max():.4f}]"
               + ("" if worst <= NORM_TOLERANCE else
                  f", not unit length (tolerance {NORM_TOLERANCE}); our encoders return unit vectors"))
        precision = stored_precision(vectors)
        record("precision", True, f"passages stored as {precision} values" + (
            " (Search-R1's builder with --use_fp16)" if precision == "float16" else ""))

        passages = [docstore.get(int(r)).contents for r in rows]
        stored = stored_vectors(index, rows)
        fresh = enc.encode_passages(passages)
        cosine = np.sum(stored * fresh, axis=1) / np.maximum(np.linalg.norm(stored, axis=1), 1e-12)
        bad = rows[cosine < PASSAGE_MIN_COSINE]
        found = (f"stored vs re-encoded ({spec.name}, passage prefix {spec.passage_prefix!r}) over {len(rows)} "
                 f"passages: min {cosine.min():.5f}, median {np.median(cosine):.5f}")
        if len(bad):
            found += (f"; {len(bad)} below {PASSAGE_MIN_COSINE} (rows {', '.join(map(str, bad[:8]))}"
                      f"{', ...' if len(bad) > 8 else ''}): the rows are not these passages embedded by this encoder "
                      "(another corpus or order, another model, or another prefix)")
        record("passage cosine", not len(bad), found)

        _, top = index.search(np.ascontiguousarray(fresh), 1)
        # A duplicated passage may rank its twin first; same text counts as its own row.
        missed = [int(r) for r, t in zip(rows, top[:, 0], strict=True)
                  if t != r and (t < 0 or docstore.get(int(t)).contents != docstore.get(int(r)).contents)]
        found = f"{len(rows) - len(missed)} of {len(rows)} re-encoded passages find their own row first"
        if missed:
            found += (f"; missed rows {', '.join(map(str, missed[:8]))}{', ...' if len(missed) > 8 else ''}"
                      + ("" if faiss_type(index) == "Flat" else " (an approximate index: raise its search parameters "
                         "and adopt it again, or use a Flat index)"))
        record("top-1", not missed, found)

        _place(faiss_file, tmp / FAISS_FILE, link)
        manifest = AdoptedManifest(
            kind="dense",
            metric="inner_product",
            index_factory=faiss_type(index),
            encoder=encoder_manifest(enc).model_copy(
                update={"passage_dtype": precision, "passage_backend": EXTERNAL_BACKEND}),
            corpus=corpus_manifest,
            adopted=Adoption(source=str(faiss_file), link=link, num_bytes=faiss_file.stat().st_size,
                             faiss_type=faiss_type(index), sample=len(rows), checks=checks),
        )
        docstore.close()
        docstore = None
        finish_build(tmp, out, manifest)
        return manifest
    except BaseException:
        if docstore is not None:
            docstore.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
