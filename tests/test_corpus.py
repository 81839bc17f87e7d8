import json

import pytest

from data.corpus import Passage, make_contents, packaged_wiki_passages, read_jsonl, split_contents, write_jsonl


def test_packaged_wikipedia_is_10033_search_r1_passages(tmp_path):
    path = tmp_path / "wiki.jsonl"
    assert write_jsonl(packaged_wiki_passages(), path) == 10_033
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({r["id"] for r in rows}) == 10_033
    austen = next(r for r in rows if r["contents"].startswith('"Jane Austen"\n'))
    assert "English writer" in austen["contents"]
    assert all(r["contents"].startswith('"') and '"\n' in r["contents"] for r in rows)


def test_contents_round_trip():
    contents = make_contents('Title with "quotes"', "line one\nline two")
    assert split_contents(contents) == ('Title with "quotes"', "line one\nline two")
    assert split_contents("no newline") == ("no newline", "")
    assert Passage("1", contents).title == 'Title with "quotes"'


def test_read_jsonl_streams_and_names_the_bad_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "contents": "\\"A\\"\\ntext"}\n\n{"id": "b"}\n')
    stream = read_jsonl(path)
    assert next(stream).id == "a"  # a generator: the first line is read before the bad one is seen
    with pytest.raises(ValueError, match=r"c\.jsonl:3"):
        next(stream)
