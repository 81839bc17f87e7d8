"""A synthetic knowledge base whose answers can only be found by searching it.

Entities are people, cities and countries with made-up relations, drawn with a seed:

    person  --born in-->  city  --in-->  country

Every entity is a distinct 4-digit number (SmolLM2's tokenizer writes each digit as a token), so a tiny model
answers by copying four digits from what it read: ten tokens it sees everywhere, not a thousand rare names it would
have to learn one by one, and a held-out question's numbers are no harder than a trained one's. The relations are
random, so no model knows them: the answer must come from the corpus, which the retrieval server serves. Corpus
documents (Search-R1 JSONL, `"Title"\ntext`):

    "Person 4821"\nPerson 4821 was born in city 6317.
    "City 6317"\nCity 6317 is in country 9052.

(A city's document names its number twice, so BM25 ranks it above the people born there when the query is it.)

Questions, each with the ideal search strategy (`queries`):
    birthplace     Where was person 4821 born?              -> 6317  one search:   4821
    city_country   Which country is city 6317 in?           -> 9052  one search:   6317
    birth_country  In which country was person 4821 born?   -> 9052  two searches: 4821, then 6317 (the bridge)

The layout is chosen for a tiny model: in every question the number is followed by one word and "?", and every
answer or bridge ends its document, so with one document per search the digits to copy are always at the same
distance from where they are written.

Train and test questions use disjoint people and cities, so a policy that memorised relations during training gains
nothing on the test questions: only the search strategy carries over. The reworded test questions
(questions-reworded.jsonl, Study B's generalisation set, docs/study_b_plan.md) ask the same relations about the test
split in wordings no training question or demonstration uses (REWORDED).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from data.corpus import Passage, make_contents, write_jsonl
from data.qa import QAExample

KINDS = ("birthplace", "city_country", "birth_country")
HOPS = {"birthplace": 1, "city_country": 1, "birth_country": 2}
WORDINGS = {"birthplace": "Where was person {entity} born?", "city_country": "Which country is city {entity} in?",
            "birth_country": "In which country was person {entity} born?"}
REWORDED = {"birthplace": "What city was person {entity} born in?",
            "city_country": "Which country is city {entity} located in?",
            "birth_country": "Person {entity} was born in a city. Which country is that city in?"}


@dataclass(frozen=True)
class KBSpec:
    seed: int = 0
    train_people: int = 1200
    test_people: int = 200
    train_cities: int = 150
    test_cities: int = 50
    countries: int = 40
    # Share of each question kind among the generated questions (birthplace, city_country, birth_country).
    mix: tuple[float, float, float] = (0.25, 0.25, 0.5)
    train_questions: int = 2000
    test_questions: int = 200


@dataclass(frozen=True)
class KBQuestion:
    """A question with what the study needs besides the QA example: its kind and the ideal search strategy."""

    example: QAExample
    kind: str
    queries: tuple[str, ...]  # the ideal strategy's searches, in order
    bridge: str | None = None  # two-hop: the first search's answer (the city), which the weak strategy answers

    def to_dict(self) -> dict:
        return {"example": self.example.to_dict(), "kind": self.kind, "queries": list(self.queries),
                "bridge": self.bridge}

    @classmethod
    def from_dict(cls, row: dict) -> KBQuestion:
        return cls(QAExample.from_dict(row["example"]), row["kind"], tuple(row["queries"]), row["bridge"])


@dataclass
class KnowledgeBase:
    spec: KBSpec
    born_in: dict[str, str]  # person -> city
    country_of: dict[str, str]  # city -> country
    train_people: list[str]
    test_people: list[str]
    train_cities: list[str]
    test_cities: list[str]

    def passages(self) -> list[Passage]:
        docs = [make_contents(f"Person {p}", f"Person {p} was born in city {c}.") for p, c in self.born_in.items()]
        docs += [make_contents(f"City {c}", f"City {c} is in country {k}.") for c, k in self.country_of.items()]
        return [Passage(id=str(i), contents=text) for i, text in enumerate(docs)]

    def question(self, kind: str, entity: str, split: str, index: int,
                 wordings: dict[str, str] = WORDINGS) -> KBQuestion:
        if kind not in KINDS:
            raise ValueError(f"unknown question kind {kind!r}; expected one of {KINDS}")
        if kind == "birthplace":
            answer, queries, bridge = self.born_in[entity], (entity,), None
        elif kind == "city_country":
            answer, queries, bridge = self.country_of[entity], (entity,), None
        else:
            city = self.born_in[entity]
            answer, queries, bridge = self.country_of[city], (entity, city), city
        text = wordings[kind].format(entity=entity)
        example = QAExample(f"kb-{kind}/{split}/{index}", f"kb-{kind}", split, text, (answer,), "synthetic-kb")
        return KBQuestion(example, kind, queries, bridge)

    def questions(self, split: str, n: int, rng: np.random.Generator, *, reworded: bool = False) -> list[KBQuestion]:
        """n questions about this split's people and cities, kinds drawn by `spec.mix`, entities uniformly; in the
        REWORDED wordings (split named "<split>-reworded" in their ids) when `reworded`."""
        people = self.train_people if split == "train" else self.test_people
        cities = self.train_cities if split == "train" else self.test_cities
        kinds = rng.choice(len(KINDS), size=n, p=np.array(self.spec.mix) / sum(self.spec.mix))
        label, wordings = (f"{split}-reworded", REWORDED) if reworded else (split, WORDINGS)
        out = []
        for i, k in enumerate(kinds):
            kind = KINDS[k]
            entity = str(rng.choice(cities if kind == "city_country" else people))
            out.append(self.question(kind, entity, label, i, wordings))
        return out


def generate_kb(spec: KBSpec) -> KnowledgeBase:
    need = spec.train_people + spec.test_people + spec.train_cities + spec.test_cities + spec.countries
    if need > 9000:
        raise ValueError(f"the KB needs {need} distinct 4-digit numbers; there are 9000")
    rng = np.random.default_rng(spec.seed)
    drawn = [str(n) for n in rng.choice(np.arange(1000, 10000), size=need, replace=False)]
    cuts = np.cumsum([spec.train_people, spec.test_people, spec.train_cities, spec.test_cities])
    train_people, test_people, train_cities, test_cities, countries = (list(part) for part in np.split(drawn, cuts))
    country_of = {str(c): str(rng.choice(countries)) for c in [*train_cities, *test_cities]}
    # People are born only in cities of their own split: a test question's bridge city is never seen in training.
    born_in = {str(p): str(rng.choice(train_cities)) for p in train_people}
    born_in |= {str(p): str(rng.choice(test_cities)) for p in test_people}
    return KnowledgeBase(spec, born_in, country_of, [str(p) for p in train_people], [str(p) for p in test_people],
                         [str(c) for c in train_cities], [str(c) for c in test_cities])


def read_kb(folder: Path) -> KnowledgeBase:
    """The KB that write_kb wrote into `folder`, made again from its saved spec; refused when the saved relations are
    not what that spec generates (a KB from other code)."""
    saved = json.loads((folder / "kb.json").read_text())
    kb = generate_kb(KBSpec(**{**saved["spec"], "mix": tuple(saved["spec"]["mix"])}))
    if (kb.born_in, kb.country_of) != (saved["born_in"], saved["country_of"]):
        raise ValueError(f"{folder}: kb.json's relations are not those its spec generates")
    return kb


def write_reworded(kb: KnowledgeBase, out: Path) -> Path:
    """questions-reworded.jsonl: spec.test_questions test-split questions in the REWORDED wordings, drawn from a
    generator of their own (the train and test files do not change when this one is added to an older KB)."""
    path = out / "questions-reworded.jsonl"
    rng = np.random.default_rng([kb.spec.seed, 2])
    save_questions(kb.questions("test", kb.spec.test_questions, rng, reworded=True), path)
    return path


def write_kb(kb: KnowledgeBase, out: Path) -> dict[str, Path]:
    """corpus.jsonl, questions-train.jsonl, questions-test.jsonl, questions-reworded.jsonl and kb.json (the spec and
    the relations) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([kb.spec.seed, 1])
    paths = {"corpus": out / "corpus.jsonl", "train": out / "questions-train.jsonl", "test": out / "questions-test.jsonl"}
    write_jsonl(iter(kb.passages()), paths["corpus"])
    for split, n in (("train", kb.spec.train_questions), ("test", kb.spec.test_questions)):
        save_questions(kb.questions(split, n, rng), paths[split])
    paths["reworded"] = write_reworded(kb, out)
    (out / "kb.json").write_text(json.dumps({"spec": asdict(kb.spec), "born_in": kb.born_in,
                                             "country_of": kb.country_of}, indent=1))
    return paths


def save_questions(questions: list[KBQuestion], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(q.to_dict()) + "\n" for q in questions))
    tmp.replace(path)


def load_questions(path: Path) -> list[KBQuestion]:
    return [KBQuestion.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
