"""The quiet console (emapg/console.py): vLLM's logs, in our process and in a process it starts, go to the run
folder's emapg.log and not to the console; ours stay on the console; --verbose / EMAPG_VERBOSE=1 change nothing.
And the weight-sync warnings vLLM gives for layers no checkpoint holds are explained once, then dropped."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from agent.vllm_backend import RELOAD_LOGGER, RELOAD_WARNING, ExpectedReloadWarnings, quiet_expected_reload_warnings

# How vLLM sets its logging up, in the process that makes the engine (EngineArgs.create_engine_config) and in the
# EngineCore process it starts: from a LoggingConfig whose defaults come from the environment (VLLM_LOGGING_*).
CONFIGURE_VLLM_LOGGING = ("from vllm.config.logging import LoggingConfig; "
                          "from vllm.logger import configure_logging_if_needed, init_logger; "
                          "configure_logging_if_needed(LoggingConfig())")
ENGINE_PROCESS = CONFIGURE_VLLM_LOGGING + "; init_logger('vllm.v1.engine.core').info('engine process INFO line')"

QUIET_RUN = textwrap.dedent(f"""
    import logging, subprocess, sys
    from pathlib import Path
    from emapg.console import setup, log_to

    run = Path(sys.argv[1])
    verbose = setup(False, log_file=run.parent / "before-the-run.log")
    run.mkdir()
    print("log file:", log_to(run), "verbose:", verbose, flush=True)
    {CONFIGURE_VLLM_LOGGING}  # after setup, as in the CLI

    engine = init_logger("vllm.v1.engine.async_llm")
    engine.info("engine INFO line")
    engine.warning("libtcmalloc is not found in LD_PRELOAD.")
    engine.error("engine ERROR line")
    logging.getLogger("emapg.guard").warning("our warning")
    print("iter    1  reward 0.500", flush=True)
    subprocess.run([sys.executable, "-c", {ENGINE_PROCESS!r}], check=True)
""")


def run_python(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_LOGGING", "EMAPG_VERBOSE"))}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**environ, **(env or {})})


def test_engine_logs_go_to_the_run_log_and_ours_stay_on_the_console(tmp_path):
    result = run_python(QUIET_RUN, str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    console = result.stdout + result.stderr
    log = (tmp_path / "run" / "emapg.log").read_text()
    assert "engine INFO line" in log and "libtcmalloc" in log and "engine process INFO line" in log
    assert "engine ERROR line" in log and "our warning" in log
    assert "INFO" not in console and "libtcmalloc" not in console and "engine process" not in console
    assert "iter    1  reward 0.500" in console and "our warning" in console
    assert "engine ERROR line" in console  # the engine's errors still show
    assert "verbose: False" in console


OTHER_LIBRARY = textwrap.dedent("""
    import logging, sys
    from pathlib import Path
    from emapg.console import setup, log_to

    class FakeLibraryHandler(logging.Handler):  # a fake: stands for absl's, which closes its stream when closed
        closed = False
        def emit(self, record): pass
        def close(self):
            FakeLibraryHandler.closed = True
            super().close()

    library = logging.getLogger("some_library")
    library.addHandler(FakeLibraryHandler())
    engine = logging.getLogger("vllm")
    engine.addHandler(logging.StreamHandler(sys.stdout))  # vLLM's own console handler, set up before ours
    run = Path(sys.argv[1])
    setup(False, log_file=run.parent / "before.log")
    run.mkdir()
    log_to(run)
    engine.info("engine INFO line")
    print("other library's handler closed:", FakeLibraryHandler.closed, len(library.handlers), flush=True)
""")


def test_setup_touches_only_the_engine_loggers(tmp_path):
    """Python's dictConfig closes every handler of the process; setup and log_to must leave other libraries' alone
    and replace the engine loggers' own (a second log_to moves them, and nothing reaches the console)."""
    result = run_python(OTHER_LIBRARY, str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert "other library's handler closed: False 1" in result.stdout
    assert "engine INFO line" not in result.stdout + result.stderr
    assert "engine INFO line" in (tmp_path / "run" / "emapg.log").read_text()
    before = tmp_path / "before.log"
    assert not before.exists() or "engine INFO line" not in before.read_text()


def test_verbose_leaves_the_engine_logs_on_the_console(tmp_path):
    """EMAPG_VERBOSE=1 (what `emapg --verbose` passes to setup too: the test below)."""
    result = run_python(QUIET_RUN, str(tmp_path / "run"), env={"EMAPG_VERBOSE": "1"})
    assert result.returncode == 0, result.stderr
    console = result.stdout + result.stderr
    assert "engine INFO line" in console and "engine process INFO line" in console and "verbose: True" in console
    assert not (tmp_path / "run" / "emapg.log").exists()


def test_the_cli_option_and_the_environment_variable_reach_setup(monkeypatch):
    from typer.testing import CliRunner

    import emapg.console
    from emapg.cli import app

    calls = []
    monkeypatch.setattr(emapg.console, "setup", lambda verbose: calls.append(verbose))
    monkeypatch.delenv("EMAPG_VERBOSE", raising=False)
    for args, env in [(["--verbose", "tool-schema"], {}), (["tool-schema"], {"EMAPG_VERBOSE": "1"}),
                      (["tool-schema"], {})]:
        assert CliRunner().invoke(app, args, env=env).exit_code == 0
    assert calls == [True, True, False]


class TiedWithRotary(torch.nn.Module):
    """The shapes of the layers in question: an output layer tied to the embedding, a cache-only rotary layer."""

    class RotaryEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.zeros(4, 2), persistent=False)

    class ParallelLMHead(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 2)
        self.rotary = self.RotaryEmbedding()
        self.mlp = torch.nn.Linear(2, 2)
        self.lm_head = self.ParallelLMHead(self.embed.weight)


def reload_warning(layer: str) -> logging.LogRecord:
    return logging.LogRecord(RELOAD_LOGGER, logging.WARNING, __file__, 0, RELOAD_WARNING, (layer,), None)


def test_weight_sync_warnings_for_tied_and_cache_layers_are_explained_once():
    logger = logging.getLogger(RELOAD_LOGGER)
    before = list(logger.filters)
    try:
        for f in before:
            logger.removeFilter(f)
        quiet_expected_reload_warnings(TiedWithRotary())
        quiet_expected_reload_warnings(TiedWithRotary())  # once per process
        (f,) = logger.filters
        assert isinstance(f, ExpectedReloadWarnings) and f.layer_classes == {"ParallelLMHead", "RotaryEmbedding"}
        first = reload_warning("RotaryEmbedding")
        assert f.filter(first) and "expected at every weight sync" in first.getMessage()
        assert not f.filter(reload_warning("ParallelLMHead")) and not f.filter(reload_warning("RotaryEmbedding"))
        assert f.filter(reload_warning("Linear"))  # a layer that should have loaded: still warned about
        other = logging.LogRecord(RELOAD_LOGGER, logging.WARNING, __file__, 0, "%s: something else", ("X",), None)
        assert f.filter(other)
    finally:
        for f in list(logger.filters):
            logger.removeFilter(f)
        for f in before:
            logger.addFilter(f)


RAW_OUTPUT = textwrap.dedent("""
    import subprocess, sys
    from pathlib import Path
    from emapg.console import engine_output_to_log, log_to, setup

    setup(False, log_file=Path(sys.argv[1]) / "before.log")
    log_to(Path(sys.argv[1]))
    with engine_output_to_log():  # an engine process that prints around logging, started inside: inherits the log
        child = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(0.5); "
                                  "print('child stdout'); print('child progress bar', file=sys.stderr)"])
        print("start-up chatter", flush=True)
    print("our progress", flush=True)
    child.wait()
""")


def test_engine_processes_started_inside_write_their_raw_output_to_the_log(tmp_path):
    result = run_python(RAW_OUTPUT, str(tmp_path))
    assert result.returncode == 0, result.stderr
    console = result.stdout + result.stderr
    log = (tmp_path / "emapg.log").read_text()
    assert "child stdout" in log and "child progress bar" in log and "start-up chatter" in log
    assert "child" not in console and "start-up chatter" not in console and "our progress" in console
