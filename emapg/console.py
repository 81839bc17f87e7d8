"""A quiet console: the engine's logs go to the run folder's log file, the console keeps ours.

vLLM logs hundreds of INFO and WARNING lines per run (engine start-up, every weight sync, platform notes such as
"libtcmalloc is not found" and "Triton is not installed"), in this process and in its EngineCore process. By
default they go to `<run folder>/emapg.log` (before a run folder is known: <temp dir>/emapg/emapg.log); only the
engine's errors still reach the console, beside our progress bars, stage headers and warnings.
`emapg --verbose ...` or EMAPG_VERBOSE=1 leaves the engine's logging as vLLM sets it (everything on the console).

How: vLLM configures its loggers from the JSON file named by VLLM_LOGGING_CONFIG_PATH (a `logging.config`
dictConfig) when it is imported, in every process it starts, and those processes inherit this one's environment.
`setup` writes that file and sets the variable, once, before anything imports vLLM; `log_to` points it (and the
loggers already configured in this process) at a run folder's log. What the engine's processes write around
logging (Python warnings, progress bars, C++ messages) goes to their stdout and stderr, inherited from this process
when they start: `engine_output_to_log` points those at the log while the engine starts.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

VERBOSE_ENV = "EMAPG_VERBOSE"
LOG_NAME = "emapg.log"
# The engines whose logs are kept off the console: vLLM (this process and its EngineCore) and Ray's driver side.
ENGINE_LOGGERS = ("vllm", "ray")
# Our own logger: its warnings stay on the console (Python's default) and are copied to the log file too.
OWN_LOGGER = "emapg"
LOG_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"

_config_path: str | None = None  # the dictConfig file VLLM_LOGGING_CONFIG_PATH names, once setup ran quiet
_log_file: Path | None = None  # where the engine's logs go now


def verbose_requested(flag: bool = False) -> bool:
    return flag or os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def logging_config(log_file: Path, level: str = "INFO") -> dict:
    """The dictConfig for the engine loggers: everything from `level` up to `log_file`, errors also to stderr."""
    return {
        "version": 1,
        "disable_existing_loggers": False,  # everyone else's loggers (ours included) stay as they are
        "formatters": {"plain": {"format": LOG_FORMAT}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(log_file), "mode": "a", "delay": True,
                     "encoding": "utf-8", "formatter": "plain", "level": "DEBUG"},
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "ERROR",
                        "formatter": "plain"},
        },
        "loggers": {name: {"handlers": ["file", "console"], "level": level, "propagate": False}
                    for name in ENGINE_LOGGERS},
    }


def setup(verbose: bool = False, log_file: Path | None = None) -> bool:
    """Called once by the CLI before any command runs. Quiet (the default): engine logs to `log_file` (default
    <temp dir>/emapg/emapg.log until `log_to` names the run's folder: a command that starts no run writes nothing in
    the working folder). Returns whether the console is verbose."""
    global _config_path
    if verbose_requested(verbose):
        return True
    if log_file is None:
        log_file = Path(tempfile.gettempdir()) / "emapg" / LOG_NAME
    if _config_path is None:
        fd, _config_path = tempfile.mkstemp(prefix="emapg-logging-", suffix=".json")
        os.close(fd)
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"  # a config file needs vLLM's logging configuration on
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = _config_path
    _apply(log_file)
    return False


def log_to(folder: Path) -> Path | None:
    """Send the engine's logs (from now on, in this process and in engines started later) to `folder`/emapg.log;
    call it once the run folder exists (a demo that clears its folder first: after that). Returns the log file, or
    None when the console is verbose (nothing is redirected)."""
    if _config_path is None:
        return None
    log_file = Path(folder) / LOG_NAME
    _apply(log_file)
    return log_file


@contextmanager
def engine_output_to_log() -> Iterator[None]:
    """While an engine starts (its imports, its processes' start): this process's stdout and stderr, which the
    engine's processes inherit for their whole life, go to the log file. What they write bypassing logging (Python
    warnings at import, progress bars, the C++ runtime's messages) then lands there too. A no-op when verbose."""
    if _log_file is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(_log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (log, *saved):
            os.close(fd)


def _apply(log_file: Path) -> None:
    global _log_file
    log_file = log_file.resolve()
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # e.g. `emapg mcp` started by a desktop app in a folder it cannot write
        log_file = Path(tempfile.gettempdir()) / LOG_NAME
    _log_file = log_file
    config = logging_config(log_file, os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    Path(_config_path).write_text(json.dumps(config))
    # The engine loggers of this process, now (vLLM may be imported already; its later processes read the file).
    _configure_engine_loggers(config)
    own = logging.getLogger(OWN_LOGGER)
    for handler in [h for h in own.handlers if getattr(h, "emapg_run_log", False)]:
        own.removeHandler(handler)
        handler.close()
    handler = logging.FileHandler(log_file, mode="a", encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.emapg_run_log = True
    own.addHandler(handler)
    if own.level == logging.NOTSET:
        own.setLevel(logging.INFO)
    # Our warnings keep reaching the console: with a handler of its own the logger no longer falls back to
    # Python's last-resort stderr handler, so it gets one for WARNING and up.
    if not any(getattr(h, "emapg_console", False) for h in own.handlers):
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        console.emapg_console = True
        own.addHandler(console)


def _configure_engine_loggers(config: dict) -> None:
    """What `config` does in the engine's processes, done here to the engine loggers only. dictConfig itself would
    first close every handler of this process, other libraries' too. absl's closes the stream it was given when that
    is no longer sys.stderr: a test's captured stderr, closed under pytest after OpenVINO imported absl."""
    spec = config["handlers"]
    formatter = logging.Formatter(config["formatters"]["plain"]["format"])
    to_file = logging.FileHandler(spec["file"]["filename"], mode="a", encoding="utf-8", delay=True)
    to_file.setLevel(spec["file"]["level"])
    to_console = logging.StreamHandler(sys.stderr)
    to_console.setLevel(spec["console"]["level"])
    for handler in (to_file, to_console):
        handler.setFormatter(formatter)
    for name, settings in config["loggers"].items():
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
            old.close()
        logger.addHandler(to_file)
        logger.addHandler(to_console)
        logger.setLevel(settings["level"])
        logger.propagate = settings["propagate"]
