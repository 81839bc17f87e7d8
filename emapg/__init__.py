"""The `emapg` command line: one entry point for index, serve, search and the demo."""
