"""QA data: the real packaged NQ/TriviaQA splits, FlashRAG JSONL on small local files, answerable subsets."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from data import qa
from data.qa import (
    FLASHRAG_DATASETS,
    AnswerableSubset,
    QAExample,
    load_flashrag,
    load_flashrag_jsonl,
    load_packaged,
    normalize_question,
)
from eval.answerable import answer_in_passages, filter_answerable

REPO_ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def packaged(dataset: str, split: str) -> tuple[QAExample, ...]:
    """Each real split parsed once per test session (all four take about 2 s)."""
    return tuple(load_packaged(dataset, split))


def by_id(dataset: str, split: str, index: int) -> QAExample:
    ex = packaged(dataset, split)[index]
    assert ex.id == f"{dataset}/{split}/{index}"
    return ex


def raw_line(dataset: str, split: str, index: int) -> str:
    """The line as stored in the jar (DPR files have one record per "\\r\\n" line)."""
    with zipfile.ZipFile(qa.packaged_jar()) as zf:
        text = zf.read(qa.packaged_member(dataset, split)).decode("utf-8")
    return text.split("\r\n")[index]


def write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def flashrag_rows(n: int, tag: str) -> list[dict]:
    return [{"id": f"{tag}_{i}", "question": f"{tag} question {i}", "golden_answers": [f"{tag} {i}"]} for i in range(n)]


# --- packaged NQ-open / TriviaQA -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dataset", "split", "count"),
    [("nq", "dev", 8_757), ("nq", "test", 3_610), ("triviaqa", "dev", 8_837), ("triviaqa", "test", 11_313)],
)
def test_packaged_counts_ids_and_normalised_questions(dataset, split, count):
    examples = packaged(dataset, split)
    assert len(examples) == count
    assert [ex.id for ex in examples] == [f"{dataset}/{split}/{i}" for i in range(count)]
    assert all(ex.dataset == dataset and ex.split == split for ex in examples)
    assert all(ex.question.endswith("?") and ex.question == ex.question.strip() for ex in examples)
    assert all(ex.golden_answers and all(isinstance(a, str) and a for a in ex.golden_answers) for ex in examples)
    assert all(ex.source.endswith(f"!{qa.packaged_member(dataset, split)}") for ex in examples)


def test_packaged_spot_checks():
    # NQ questions are lowercase without "?": normalisation adds it.
    assert by_id("nq", "test", 0).question == "who got the first nobel prize in physics?"
    assert by_id("nq", "test", 0).golden_answers == ("Wilhelm Conrad Röntgen",)
    assert by_id("nq", "test", 1).golden_answers == ("May 18 , 2018",)  # NQ's tokenised spacing is kept
    assert by_id("nq", "dev", 0).question == "who sings does he love me with reba?"
    assert by_id("nq", "dev", 0).golden_answers == ("Linda Davis",)
    assert by_id("triviaqa", "test", 0).question == "Who was the man behind The Chipmunks?"
    assert by_id("triviaqa", "test", 0).golden_answers == ("David Seville",)
    dev0 = by_id("triviaqa", "dev", 0)
    assert dev0.question == "The VS-300 was a type of what?"
    assert dev0.golden_answers[:2] == ("🚁", "Helicopters") and len(dev0.golden_answers) == 14


def test_csv_quoted_lines_parse_right():
    # Singly quoted question: one CSV decode gives the text.
    assert raw_line("triviaqa", "dev", 385).startswith('"On what piece of equipment would you perform a ""Smith')
    assert by_id("triviaqa", "dev", 385).question == 'On what piece of equipment would you perform a "Smith Grind"?'
    # Doubly quoted question (DPR's file CSV-encoded these twice): both layers are undone.
    assert raw_line("triviaqa", "test", 17).startswith('"""How many different animal shapes are there in the """"')
    assert by_id("triviaqa", "test", 17).question == (
        'How many different animal shapes are there in the "Animal Crackers" cookie zoo?'
    )
    assert by_id("triviaqa", "dev", 26).question == (
        'What was the name of the "girl with kaleidoscope eyes" in a Beatles song?'
    )
    assert by_id("triviaqa", "dev", 26).golden_answers == ("Lucy Lucia", "Lucy", "LUCY")
    # A question that merely starts with a quote is not "unquoted".
    assert any(ex.question.startswith('"Rodney you plonka" and "This time') for ex in packaged("triviaqa", "test"))
    # CSV-quoted answers column: a list literal holding "..." strings with apostrophes.
    assert raw_line("nq", "test", 36).endswith("\t\"['Solange Knowles', \"\"Destiny 's Child\"\"]\"")
    assert by_id("nq", "test", 36).golden_answers == ("Solange Knowles", "Destiny 's Child")
    # An answer that was itself double-quoted, and one whose text ends in a quote character.
    assert '"Babe" Ruth' in by_id("triviaqa", "dev", 4966).golden_answers
    assert "John Cage after the premiere of 4'33\"" in by_id("triviaqa", "test", 8473).golden_answers
    # No doubled quote survives anywhere.
    for split in ("dev", "test"):
        assert not any('""' in ex.question for ex in packaged("triviaqa", split))


def test_c1_control_characters_stay_inside_their_question():
    # Some TriviaQA questions hold cp1252 bytes decoded as C1 controls (U+0091 for a left quote, U+0085 for an
    # ellipsis); kept as they are. U+0085 is a line break for str.splitlines: splitting the file that way would
    # cut 3 dev and 3 test questions in two.
    assert sum("\u0085" in ex.question for ex in packaged("triviaqa", "dev")) == 3
    assert sum("\u0085" in ex.question for ex in packaged("triviaqa", "test")) == 3
    ex = by_id("triviaqa", "dev", 477)
    assert ex.question == (
        "Which ancient, fierce warrior nation, upon attacking ancient Israel, \u0091\u0085. came down like a wolf"
        " on the fold'?"
    )
    assert "Assyrians" in ex.golden_answers
    assert by_id("triviaqa", "test", 735).question == "Who was the author of \u0091Pygmalion'?"


def test_missing_pyserini_names_the_install_line(monkeypatch):
    real_find_spec = qa.importlib.util.find_spec
    monkeypatch.setattr(
        qa.importlib.util, "find_spec", lambda name, *a: None if name == "pyserini" else real_find_spec(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps pyserini==0\.17\.0"):
        load_packaged("nq", "test")


def test_packaged_rejects_unknown_names():
    with pytest.raises(ValueError, match="nq"):
        load_packaged("trivia", "test")
    with pytest.raises(ValueError, match="dev"):
        load_packaged("nq", "train")


def test_normalize_question():
    assert normalize_question("  who wrote hamlet \n") == "who wrote hamlet?"
    assert normalize_question("Who wrote Hamlet?") == "Who wrote Hamlet?"
    assert normalize_question('Who said "why not?"') == 'Who said "why not?"?'  # Search-R1's rule, literally


# --- FlashRAG JSONL ------------------------------------------------------------------------------------------


def test_flashrag_jsonl_reads_records_and_ignores_extra_keys(tmp_path):
    path = write_jsonl(
        tmp_path / "bamboogle" / "test.jsonl",
        [
            {"id": "test_0", "question": " Who was president of the U.S. when superconductivity was discovered ",
             "golden_answers": ["William Howard Taft"], "metadata": {"x": 1}},
            "",  # a blank line is skipped and does not take an index
            {"id": "test_1", "question": "What is 2+2?", "golden_answers": ["4", "four"]},
        ],
    )
    examples = load_flashrag_jsonl(path, "bamboogle", "test")
    assert examples == [
        QAExample("bamboogle/test/0", "bamboogle", "test",
                  "Who was president of the U.S. when superconductivity was discovered?",
                  ("William Howard Taft",), str(path)),
        QAExample("bamboogle/test/1", "bamboogle", "test", "What is 2+2?", ("4", "four"), str(path)),
    ]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"question": "q", "golden_answers": ["a"]', "not JSON"),
        ('["q", ["a"]]', "JSON object"),
        ('{"question": "q"}', "golden_answers"),
        ('{"question": "q", "golden_answers": []}', "golden_answers"),
        ('{"question": "q", "golden_answers": "a"}', "golden_answers"),
        ('{"question": "q", "golden_answers": [1]}', "golden_answers"),
        ('{"question": "  ", "golden_answers": ["a"]}', "question"),
    ],
)
def test_flashrag_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "nq" / "dev.jsonl", [*flashrag_rows(1, "nq"), "", bad_line])
    with pytest.raises(ValueError, match=rf"dev\.jsonl:3: .*{message}"):
        load_flashrag_jsonl(path, "nq", "dev")


def test_flashrag_split_selection_from_a_local_root(tmp_path):
    write_jsonl(tmp_path / "hotpotqa" / "dev.jsonl", flashrag_rows(3, "hotpot"))  # no test split, as on the hub
    write_jsonl(tmp_path / "popqa" / "test.jsonl", flashrag_rows(2, "popqa-test"))
    write_jsonl(tmp_path / "popqa" / "dev.jsonl", flashrag_rows(5, "popqa-dev"))

    hotpot = load_flashrag("hotpotqa", root=tmp_path)
    assert [ex.id for ex in hotpot] == ["hotpotqa/dev/0", "hotpotqa/dev/1", "hotpotqa/dev/2"]
    assert hotpot[0].source == str(tmp_path / "hotpotqa" / "dev.jsonl")
    assert {ex.split for ex in load_flashrag("popqa", root=tmp_path)} == {"test"}  # test preferred
    assert len(load_flashrag("popqa", split="dev", root=tmp_path)) == 5
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        load_flashrag("hotpotqa", split="test", root=tmp_path)
    with pytest.raises(FileNotFoundError, match="musique"):
        load_flashrag("musique", root=tmp_path)


def test_flashrag_unknown_dataset_lists_the_seven(tmp_path):
    with pytest.raises(ValueError) as err:
        load_flashrag("webq", root=tmp_path)
    assert all(name in str(err.value) for name in FLASHRAG_DATASETS) and len(FLASHRAG_DATASETS) == 7


def test_a_set_of_ones_own_loads_from_a_local_root_in_flashrags_format(tmp_path):
    write_jsonl(tmp_path / "kb2hop" / "test.jsonl", flashrag_rows(3, "kb"))
    assert [ex.id for ex in load_flashrag("kb2hop", "test", root=tmp_path)] == [f"kb2hop/test/{i}" for i in range(3)]
    with pytest.raises(ValueError, match="unknown FlashRAG dataset 'kb1hop'"):  # no such folder: not a set
        load_flashrag("kb1hop", "test", root=tmp_path)


def test_flashrag_hub_falls_back_to_dev_when_test_is_absent(tmp_path, monkeypatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub.errors import RemoteEntryNotFoundError

    local = write_jsonl(tmp_path / "musique" / "dev.jsonl", flashrag_rows(2, "musique"))
    asked = []

    def fake_hf_hub_download(*, repo_id, repo_type, filename):
        asked.append((repo_id, repo_type, filename))
        if filename.endswith("test.jsonl"):
            response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/x"))
            raise RemoteEntryNotFoundError("404 Entry Not Found", response=response)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hf_hub_download)
    examples = load_flashrag("musique")
    assert [ex.id for ex in examples] == ["musique/dev/0", "musique/dev/1"]
    assert asked == [
        ("RUC-NLPIR/FlashRAG_datasets", "dataset", "musique/test.jsonl"),
        ("RUC-NLPIR/FlashRAG_datasets", "dataset", "musique/dev.jsonl"),
    ]


def test_flashrag_hub_offline_raises_a_clear_error(tmp_path):
    # HF_HUB_OFFLINE is read when huggingface_hub is imported, hence a fresh interpreter.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run(
        [sys.executable, "-c", "from data.qa import load_flashrag; load_flashrag('nq')"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,  # a hang guard
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: could not download nq/test.jsonl from the hub dataset RUC-NLPIR/")
    assert "pass root=" in last
    # The traceback is ours only: no chained huggingface_hub internals.
    frames = [line for line in proc.stderr.splitlines() if line.startswith('  File "')]
    assert frames and not any("site-packages" in f for f in frames), proc.stderr


# --- ids across datasets -------------------------------------------------------------------------------------


def test_ids_never_collide_across_datasets(tmp_path):
    write_jsonl(tmp_path / "hotpotqa" / "test.jsonl", flashrag_rows(10, "hotpot"))
    write_jsonl(tmp_path / "bamboogle" / "test.jsonl", flashrag_rows(10, "bamboogle"))
    examples = [
        *packaged("nq", "test"),
        *packaged("triviaqa", "test"),
        *load_flashrag("hotpotqa", split="test", root=tmp_path),
        *load_flashrag("bamboogle", root=tmp_path),
    ]
    ids = [ex.id for ex in examples]
    assert len(ids) == 3_610 + 11_313 + 10 + 10
    assert len(set(ids)) == len(ids)
    assert {"nq/test/7", "triviaqa/test/7", "hotpotqa/test/7", "bamboogle/test/7"} <= set(ids)


# --- answerable ----------------------------------------------------------------------------------------------

TRICKY = [
    ("U.S.A.", "He moved to the USA in 1990.", True),  # punctuation deleted on both sides
    ("The Beatles", "beatles were a band", True),  # leading article dropped
    ("Beatles", "THE BEATLES!", True),  # case
    ("Wilhelm Conrad Röntgen", "WILHELM CONRAD RÖNTGEN won it.", True),  # unicode lowercasing
    ("Hitler's", "Hitlers rise", True),  # apostrophe is ASCII punctuation
    ("1930s", "in the 1930’s", False),  # ’ is not ASCII punctuation: kept
    ("atre", "the theatre", True),  # plain substring: "the" inside "theatre" is not a whole word
    ("art of war", "The Art of War", True),
    ("May 18 , 2018", "released on May 18, 2018", True),  # NQ's spaced comma collapses
    ("Deadpool 2", "deadpool", False),
]


@pytest.mark.parametrize(("answer", "passage", "expected"), TRICKY)
def test_answer_in_passages_on_tricky_strings(answer, passage, expected):
    assert answer_in_passages([answer], ["unrelated text", passage]) is expected


def test_answers_that_normalise_to_nothing_match_nothing():
    assert not answer_in_passages(["The", ",", "?!"], ["any passage at all"])
    assert not answer_in_passages(["Paris"], [])
    # Real case: the TriviaQA comma question lists "," among its answers.
    comma = next(ex for ex in packaged("triviaqa", "dev") if ex.question.startswith("What is the name of a butterfly"))
    assert "," in comma.golden_answers
    assert not answer_in_passages(comma.golden_answers, ["A passage about rivers, lakes, and seas."])
    assert answer_in_passages(comma.golden_answers, ["The comma butterfly is named for a white mark."])


def make_examples(n: int) -> list[QAExample]:
    return [QAExample(f"nq/test/{i}", "nq", "test", f"question {i}?", (f"answer {i}",), "mem") for i in range(n)]


def test_filter_answerable_with_a_fake_search():
    examples = make_examples(5)
    calls: list[list[str]] = []

    def fake_search(questions: list[str]) -> list[list[str]]:
        calls.append(questions)
        # Even-numbered questions get a passage holding their answer, odd ones do not.
        return [
            [f"passage with The ANSWER {q.split()[1].rstrip('?')}." if int(q.split()[1].rstrip("?")) % 2 == 0
             else "nothing useful", "filler"]
            for q in questions
        ]

    subset = filter_answerable(examples, fake_search, k=2, index_name="wiki-bm25", batch_size=2, show_progress=False)
    assert [ex.id for ex in subset.examples] == ["nq/test/0", "nq/test/2", "nq/test/4"]
    assert (subset.index, subset.k, subset.count, subset.total) == ("wiki-bm25", 2, 3, 5)
    assert calls == [["question 0?", "question 1?"], ["question 2?", "question 3?"], ["question 4?"]]


def test_filter_answerable_refuses_a_miswired_search():
    examples = make_examples(3)

    def fake_search_too_many(questions):
        return [["a", "b", "c"] for _ in questions]

    def fake_search_misaligned(questions):
        return [["a"]]

    with pytest.raises(ValueError, match="3 passages for k=2"):
        filter_answerable(examples, fake_search_too_many, k=2, index_name="x", show_progress=False)
    with pytest.raises(ValueError, match="1 result lists for 3 questions"):
        filter_answerable(examples, fake_search_misaligned, k=2, index_name="x", show_progress=False)


def test_answerable_subset_save_load_round_trip(tmp_path):
    examples = [*make_examples(2), by_id("triviaqa", "dev", 0)]  # emoji answers survive the round trip
    subset = AnswerableSubset(examples=examples, index="wiki-minilm-flat", k=5, count=3, total=40)
    path = tmp_path / "subsets" / "nq-test.jsonl"
    subset.save(path)

    meta_path = tmp_path / "subsets" / "nq-test.meta.json"
    assert json.loads(meta_path.read_text()) == {"index": "wiki-minilm-flat", "k": 5, "count": 3, "total": 40}
    assert len(path.read_text(encoding="utf-8").splitlines()) == 3
    assert AnswerableSubset.load(path) == subset

    path.write_text(path.read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="1 examples but its meta says 3"):
        AnswerableSubset.load(path)
    meta_path.unlink()
    with pytest.raises(FileNotFoundError, match="provenance"):
        AnswerableSubset.load(path)


def test_answerable_subset_checks_its_count():
    with pytest.raises(ValueError, match="inconsistent"):
        AnswerableSubset(examples=make_examples(2), index="x", k=3, count=3, total=10)
