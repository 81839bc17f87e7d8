"""CLI errors name the bad option or path and exit non-zero (2) without a traceback."""

from typer.testing import CliRunner

from emapg.cli import app
from retriever.process import free_port

runner = CliRunner()


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


def test_bad_option_values_name_the_option(tmp_path, dense_index_dir):
    code, out = invoke("serve", "--index", str(dense_index_dir), "--query-dtype", "fp8")
    assert code == 2 and "--query-dtype" in out
    code, out = invoke("index", "--kind", "faiss", "--out", str(tmp_path / "x"))
    assert code == 2 and "--kind: unknown index kind 'faiss'" in " ".join(out.split())
    code, out = invoke("serve", "--port", "0")
    assert code == 2 and "--port" in out


def test_bad_paths_and_encoders_are_named(tmp_path, dense_index_dir, small_corpus):
    code, out = invoke("serve", "--index", str(tmp_path))
    assert code == 2 and "not an index folder" in out
    code, out = invoke("serve", "--index", str(dense_index_dir), "--encoder", "e5-base-v2")
    assert code == 2 and "encoder mismatch on name" in out
    code, out = invoke("index", "--corpus", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "i"))
    assert code == 2 and "missing.jsonl does not exist" in out
    code, out = invoke("index", "--corpus", str(small_corpus), "--out", str(dense_index_dir))
    assert code == 2 and "exists; pass --overwrite" in out


def test_runs_refuse_a_missing_index_other_than_the_default_instead_of_building_one(tmp_path):
    missing = tmp_path / "no-index"
    for command in ("train", "sft"):
        code, out = invoke(command, f"retriever.index={missing}")
        assert code == 2 and f"no index at {missing}" in out
    code, out = invoke("eval", "--index", str(missing))
    assert code == 2 and f"no index at {missing}" in out
    assert not missing.exists()


def test_search_against_a_dead_server_names_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    code, out = invoke("search", "hello", "--url", url)
    assert code == 2 and f"{url}/retrieve unavailable" in out


def test_bm25_index_from_the_cli_serves_real_hits(tmp_path, small_corpus):
    code, out = invoke("index", "--kind", "bm25", "--corpus", str(small_corpus), "--out", str(tmp_path / "bm25"))
    assert code == 0, out
    from retriever.client import RetrieverClient
    from retriever.process import running_server

    with running_server(tmp_path / "bm25") as url, RetrieverClient(url) as client:
        (hits,) = client.search(["Pride and Prejudice"])
    assert hits[0].contents.startswith('"Pride and Prejudice"')
