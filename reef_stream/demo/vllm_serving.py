"""The vLLM server of ``reef demo --engine vllm``: built, installed, started and stopped by the demo.

    serving = DemoEngine(settings, run_dir / "engine", progress=print)
    serving.prepare()           # the model under $REEF_HOME (built once), the engine env (installed once)
    serving.start()             # `vllm ... api_server` on the model, on a thread (~30-55 s on 2 cores)
    ...                         # the other stages start meanwhile
    url = serving.wait()        # the server answers /health; raises what stopped it
    argv = serving.replica_argv(url, model="policy", rate=300.0)
    # --via-proxy: serving.proxy_argv(url, "127.0.0.1:PORT", model="policy") first, then
    # serving.replica_argv(url, ..., via="http://127.0.0.1:PORT")
    serving.stop()              # the server's process group; idempotent

The server is ``reef_stream.servers.inference.LocalEngine`` (what ``reef engine up vllm`` starts) on
the demo's Hugging Face model (``reef_stream.demo.vllm_model``), on a free port, its state and
log (``vllm.log``) in the run's ``engine`` directory. The engine's environment is installed
when missing (``EngineEnv.install``: minutes once, with progress lines; cached after, like the
Kafka jars). ``cpu_seconds`` is the server's CPU time (the API server and its engine-core
process).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import psutil

from reef_stream.core.errors import FatalError
from reef_stream.core.settings import Settings
from reef_stream.demo.vllm_model import demo_model_dir, ensure_demo_model
from reef_stream.servers.inference import EngineEnv, LocalEngine

__all__ = ["DemoEngine", "REPLICA_ID"]

#: The replica id of the process that drives the demo's engine.
REPLICA_ID = "vllm-0"
#: The niceness of the server's processes (``DemoEngine._lower_priority``).
NICE = 10
#: The longest the server may take to answer after it was started.
START_TIMEOUT_S = 600.0


class DemoEngine:
    """The demo's vLLM server; see the module docstring. ``start`` runs ``LocalEngine.up`` on
    a thread; the other methods are called from the demo's thread."""

    def __init__(self, settings: Settings, data_dir: Path,
                 progress: Callable[[str], None] = lambda line: None) -> None:
        self.model_dir = demo_model_dir(settings.home)
        self.env = EngineEnv.for_engine("vllm", settings.cache_dir)
        self.local = LocalEngine(data_dir, self.env)
        self.progress = progress
        self._thread: threading.Thread | None = None
        self._url: str | None = None
        self._error: BaseException | None = None
        self._cpu: dict[int, float] = {}   # pid -> CPU seconds last sampled
        self._pid: int | None = None        # the server's, once it answers

    def prepare(self) -> None:
        """The model and the engine's environment, each made once and reused. Blocks."""
        ensure_demo_model(self.model_dir, self.progress)
        self.env.install(progress=self.progress)

    def start(self) -> None:
        """Start the server on a thread (``wait`` for it)."""
        self._thread = threading.Thread(target=self._up, name="demo-vllm", daemon=True)
        self._thread.start()

    def _up(self) -> None:
        try:
            self._url = self.local.up(self.model_dir, port=0, timeout=START_TIMEOUT_S,
                                      progress=self.progress)
            self._pid = self.local.status().pid
            self._lower_priority()
        except BaseException as error:  # noqa: BLE001 - handed to wait()
            self._error = error

    def _lower_priority(self) -> None:
        """Renice the server's processes to ``NICE``: after each request vLLM's worker spins
        (``sched_yield``) for a second waiting for the next (its shared-memory message queue),
        which at a request every ~0.2 s is a core's worth of CPU time; niced, the spin takes
        only the CPU that no stage wants (``docs/history.md``, "vLLM's spin, niced")."""
        for process in self._family():
            with contextlib.suppress(psutil.Error):
                process.nice(NICE)

    def _family(self) -> list[psutil.Process]:
        if not self._pid:
            return []
        try:
            root = psutil.Process(self._pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def wait(self, timeout: float | None = None) -> str:
        """The server's URL once it answers; raises what stopped it from starting."""
        if self._thread is None:
            raise FatalError("DemoEngine.wait before start")
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise FatalError(f"the vLLM server did not answer within {timeout} s; its log is "
                             f"{self.local.log_file}")
        if self._error is not None:
            raise self._error
        assert self._url is not None
        return self._url

    def replica_argv(self, url: str, *, model: str, rate: float, prompts: int = 32,
                     via: str | None = None) -> list[str]:
        """The command of the replica process that drives and samples the server (through
        the recording proxy at ``via``, keeping ``version_file`` for it, when given)."""
        argv = [sys.executable, "-m", "reef_stream.demo.vllm_replica", "--model", model,
                "--url", url, "--replica-id", REPLICA_ID, "--sample-seed", "1000",
                "--rate", str(rate), "--prompts", str(prompts)]
        if via is not None:
            argv += ["--via", via, "--version-file", str(self.version_file)]
        return argv

    def proxy_argv(self, url: str, listen: str, *, model: str) -> list[str]:
        """The command of ``reef intake proxy`` in front of the server at ``url``: it records
        what the replica is served, as ``model`` and the replica's id, stamped with the
        version the replica's follower writes to ``version_file``; a completion of unknown
        version (one a reload overlapped) is not recorded."""
        return [sys.executable, "-m", "reef_stream.cli", "intake", "proxy", "--upstream", url,
                "--listen", listen, "--model", model, "--replica-id", REPLICA_ID,
                "--version-file", str(self.version_file), "--unknown-version", "skip"]

    @property
    def version_file(self) -> Path:
        """The served-version file the replica keeps and the proxy reads (``--via-proxy``)."""
        return self.local.data_dir / "served-version.json"

    def sample_cpu(self) -> None:
        """Note the CPU time of the server's processes so far (any thread)."""
        for process in self._family():
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            self._cpu[process.pid] = times.user + times.system

    @property
    def cpu_seconds(self) -> float:
        return sum(self._cpu.values())

    def stop(self) -> None:
        """Stop the server (waits for ``start``'s thread first). Idempotent."""
        if self._thread is not None:
            self._thread.join(START_TIMEOUT_S)
        self.sample_cpu()
        self.local.down(progress=self.progress)
