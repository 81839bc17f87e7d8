"""Search-R1-compatible retrieval: dense (FAISS) and sparse (BM25) indexes, a FastAPI server, an HTTP client, an MCP
server; their contract in api.py."""
