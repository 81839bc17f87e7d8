import pytest

from retriever.index import load_index


@pytest.fixture(scope="module")
def bm25(bm25_index_dir):
    return load_index(bm25_index_dir)


def test_exact_title_query_ranks_that_page_first(bm25):
    store = bm25.docstore
    titles = [store.get(i).title for i in range(0, len(store), 37)]
    for title in titles:
        (hits,) = bm25.search([title], 5)
        top_titles = [h.contents.partition("\n")[0].strip('"') for h in hits]
        assert top_titles[0] == title or (hits[0].score == hits[1].score and title in top_titles), (title, top_titles)


def test_no_shared_term_means_no_hit(bm25):
    (hits,) = bm25.search(["zzqxj wvvkp"], 5)
    assert hits == []
    (hits,) = bm25.search(["jane austen"], 1000)  # k above the corpus size is clamped, not an error
    assert 0 < len(hits) <= len(bm25.docstore)
    assert all(a.score >= b.score > 0 for a, b in zip(hits, hits[1:]))


def test_bm25_index_takes_no_encoder(bm25_index_dir):
    with pytest.raises(ValueError, match="takes no encoder"):
        load_index(bm25_index_dir, encoder="minilm")
