"""Trainer checkpoints: written durably, found again after a crash, verified before they are loaded.

A checkpoint is a directory under a store URL (a local path by default; any
fsspec URL, e.g. ``memory://`` or ``s3://bucket/prefix`` with its fsspec
package installed), named by its step and its writer (one id per ``CheckpointStore``,
so two processes writing the same step never touch each other's files)::

    <store>/step-00000042.<writer>/
        model.safetensors        the weights
        optimizer.safetensors    the optimizer's tensors; the rest of its state is in meta.json
        trainer.safetensors      RNG states and the ids of every unit trained so far (uint64 hashes)
        meta.json                step, policy version, offsets, algorithm state, metrics, ...
        MANIFEST.json            every file above with its size and sha256 -- written LAST

A checkpoint is complete once its ``MANIFEST.json`` exists: the manifest is written after
every other file is complete (and, on a local disk, fsynced, as is the directory), so a crash
mid-write leaves a directory without a manifest, which readers ignore. A complete checkpoint
*counts* only once its ``Checkpoint`` event is committed to ``<ns>.checkpoints``: the trainer
resumes from that event, never from a listing, and a fenced or crashed writer's directory is
garbage that ``prune`` removes. The checkpoint's ``sha256`` (the one the event carries) is the
sha256 of the manifest's bytes; the manifest in turn pins every file, so checking the manifest
against the event and each file against the manifest verifies everything (``verify``).

Files are written as they are serialised, tensor by tensor from the tensors' own memory
(``write_safetensors``), and a local checkpoint is loaded from its files without their
bytes in memory (``_Files``): writing takes no more memory than about one tensor beyond
the tensors themselves, loading the tensors alone (reading every file as bytes first took
two to three times the checkpoint's size).

Nothing here unpickles: tensors are safetensors, everything else JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save as st_save

from reef_stream.core.errors import FatalError, ReefError
from reef_stream.core.events import TopicOffset
from reef_stream.core.failpoints import failpoint

__all__ = ["CheckpointContents", "CheckpointError", "CheckpointStore", "StoredCheckpoint",
           "default_store_url", "load", "load_weights", "remove_tree", "storage_errors",
           "store_unreachable",
           "unit_hash", "verify",
           "write_durably",
           "safetensors_chunks", "safetensors_sha256", "write_safetensors"]

MANIFEST = "MANIFEST.json"
#: A checkpoint's directory: its step, then its writer (absent in stores written before
#: writers had ids).
_STEP_DIR = re.compile(r"step-(\d{8,})(?:\.[0-9a-f]+)?\Z")


class CheckpointError(ReefError):
    """A checkpoint is missing, unreadable or does not match its checksum: do not load it."""


def unit_hash(unit_id: str) -> int:
    """The 64-bit hash a checkpoint stores for a trained unit id (first 8 bytes of its sha256)."""
    return int.from_bytes(hashlib.sha256(unit_id.encode()).digest()[:8], "little")


@dataclass(frozen=True, slots=True, eq=False)
class CheckpointContents:
    """Everything a trainer needs to continue exactly where a step left it.

    ``weights``: the model's state dict. ``optimizer``: the optimizer's
    ``state_dict()``. ``rng``: named RNG state tensors (``torch.get_rng_state()``,
    ...). ``algorithm_state``: the objective's state as a ``state_record``.
    ``offsets``: the next offset to consume per partition. ``trained_units``:
    sorted unique ``unit_hash`` values of every unit trained up to this step.
    ``step_units``: the ids of the units trained since the previous checkpoint (this step's
    alone when every step is checkpointed, ``schedule.checkpoint_every``), in training order.
    ``rolled_back_to``: set on a rollback checkpoint (no step trained: the weights, optimizer
    and algorithm state of that promoted version, under this checkpoint's new version).
    """

    step: int
    policy_version: int
    model: str
    recipe: str
    trainer_group: str
    weights: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, Any]
    rng: Mapping[str, torch.Tensor]
    algorithm_state: Mapping[str, Any]
    offsets: tuple[TopicOffset, ...]
    trained_units: np.ndarray
    step_units: tuple[str, ...] = ()
    metrics: Mapping[str, float] = field(default_factory=dict)
    created_at: int = 0
    rolled_back_to: int | None = None


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    """A durable checkpoint: where it is and the checksum that pins it."""

    step: int
    uri: str
    sha256: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.sha256[:16]}-step{self.step}"


class CheckpointStore:
    """The checkpoints of one trainer group under ``url``. Not shared between groups. Every
    directory this instance writes carries ``writer`` (a fresh random id by default), so two
    instances never write the same directory."""

    def __init__(self, url: str | os.PathLike[str], *, writer: str | None = None) -> None:
        url = os.fspath(url)
        self.writer = writer or uuid.uuid4().hex[:12]
        if not re.fullmatch(r"[0-9a-f]+", self.writer):
            raise ValueError(f"a checkpoint writer id is lowercase hex, not {self.writer!r}")
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")
        self.local = "file" in _protocols(self.fs)
        self.url = url

    # ----------------------------------------------------------------- writing

    def write(self, contents: CheckpointContents) -> StoredCheckpoint:
        """Write ``contents`` as step ``contents.step``, durably; returns where and its sha256.

        Blocks until every file (and, locally, the directory) is on disk. This writer's own
        leftover directory of the same step is replaced; no other writer's is touched. Raises
        ``CheckpointError`` when the store cannot be written; nothing readable
        is left behind then.
        """
        final = self._step_path(contents.step)
        staging = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.makedirs(staging, exist_ok=True)
            entries = {}
            for name, tensors in _tensor_files(contents):  # one file's tensors at a time
                entries[name] = write_safetensors(self.fs, f"{staging}/{name}", tensors,
                                                  local=self.local)
                del tensors
                failpoint("checkpoint.mid-write", step=contents.step)
            meta = _meta_json(contents)
            self._write_file(f"{staging}/meta.json", meta)
            entries["meta.json"] = {"sha256": hashlib.sha256(meta).hexdigest(),
                                    "bytes": len(meta)}
            failpoint("checkpoint.mid-write", step=contents.step)
            manifest = json.dumps({"format": 1, "step": contents.step, "files": entries},
                                  sort_keys=True, indent=1).encode()
            if self.fs.exists(final):  # this writer's earlier attempt at this step
                remove_tree(self.fs, final)
            if self.local:
                self._write_file(f"{staging}/{MANIFEST}", manifest)
                os.rename(staging, final)
                fsync_dir(self.root)
            else:  # object stores have no rename: copy the files, the manifest last
                for name in entries:
                    self.fs.copy(f"{staging}/{name}", f"{final}/{name}")
                self._write_file(f"{final}/{MANIFEST}", manifest)
                remove_tree(self.fs, staging)
        except storage_errors() as exc:
            raise CheckpointError(f"could not write checkpoint step {contents.step} to "
                                  f"{self.url}: {exc}") from exc
        return StoredCheckpoint(step=contents.step, uri=self._uri(final),
                                sha256=hashlib.sha256(manifest).hexdigest())

    def _write_file(self, path: str, data: bytes) -> None:
        write_durably(self.fs, path, data, local=self.local)

    # ----------------------------------------------------------------- reading

    def steps(self) -> list[StoredCheckpoint]:
        """Every complete checkpoint in the store, oldest first (incomplete ones are skipped)."""
        if not self.fs.exists(self.root):
            return []
        found = []
        for path in self.fs.ls(self.root, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            match = _STEP_DIR.match(name)
            if not match or not self.fs.exists(f"{path}/{MANIFEST}"):
                continue
            manifest = self.fs.cat_file(f"{path}/{MANIFEST}")
            found.append(StoredCheckpoint(step=int(match.group(1)), uri=self._uri(path),
                                          sha256=hashlib.sha256(manifest).hexdigest()))
        return sorted(found, key=lambda c: (c.step, c.uri))

    def latest(self) -> StoredCheckpoint | None:
        """The newest complete checkpoint by listing, or None. A listing also finds checkpoints
        whose event never committed (a crash, a fenced writer): the trainer resumes from its
        newest committed ``Checkpoint`` event instead."""
        steps = self.steps()
        return steps[-1] if steps else None

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` complete checkpoints, and stale staging
        directories; returns the steps deleted. ``keep`` 0 keeps everything."""
        if keep <= 0 or not self.fs.exists(self.root):
            return []
        steps = self.steps()
        doomed = steps[:-keep]
        for stored in doomed:
            remove_tree(self.fs, _path_of(stored.uri))
        newest = steps[-1].step if steps else -1
        for path in self.fs.ls(self.root, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if ".tmp-" in name and int(name.split("-")[1].split(".")[0]) <= newest:
                remove_tree(self.fs, path)
        return [stored.step for stored in doomed]

    def _step_path(self, step: int) -> str:
        return f"{self.root}/step-{step:08d}.{self.writer}"

    def _uri(self, path: str) -> str:
        protocol = _protocols(self.fs)[0]
        return path if protocol == "file" else f"{protocol}://{path}"


def verify(uri: str, sha256: str | None = None) -> dict[str, bytes]:
    """Every file of the checkpoint at ``uri``, checked against its manifest, and the
    manifest against ``sha256`` when given. Raises ``CheckpointError`` naming what is wrong.
    Holds every file's bytes in memory (``load`` does not, on a local disk)."""
    fs, path, entries = _manifest(uri, sha256)
    files = {}
    for name, entry in entries.items():
        try:
            data = fs.cat_file(f"{path}/{name}")
        except storage_errors() as exc:
            raise CheckpointError(f"checkpoint {uri}: {name} cannot be read: {exc}") from exc
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"checkpoint {uri}: {name} does not match its sha256 in the "
                                  "manifest (tampered with or corrupted)")
        files[name] = data
    return files


def _manifest(uri: str, sha256: str | None) -> tuple[Any, str, dict[str, Any]]:
    """The filesystem, path and manifest entries of the checkpoint at ``uri``, its manifest
    checked against ``sha256`` when given."""
    try:
        fs, path = fsspec.core.url_to_fs(uri)
        manifest_bytes = fs.cat_file(f"{path}/{MANIFEST}")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {uri} cannot be read: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - e.g. s3:// without s3fs (ImportError)
        raise CheckpointError(f"checkpoint {uri} cannot be opened: {type(exc).__name__}: "
                              f"{exc}") from exc
    actual = hashlib.sha256(manifest_bytes).hexdigest()
    if sha256 is not None and actual != sha256:
        raise CheckpointError(f"checkpoint {uri}: manifest sha256 is {actual}, expected {sha256} "
                              "(changed or replaced since it was announced)")
    try:
        manifest = json.loads(manifest_bytes)
        entries = manifest["files"]
        if not isinstance(entries, dict):
            raise TypeError("files is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {uri}: unreadable manifest: {exc}") from exc
    return fs, path, entries


class _Files:
    """The verified files of a checkpoint, read as they are needed.

    On a local disk every file is first hashed in chunks against the manifest, then each
    safetensors file is loaded from its path (``safetensors.torch.load_file``): the tensors,
    never their bytes beside them (``verify`` would hold both). ``load_file`` maps the file
    copy-on-write: the tensors may be changed in place (an optimizer's moments are), the
    file never is, and pages are read as they are touched. A file changed between the two
    reads is not caught, and one truncated in place while its tensors live would fault: the
    store never rewrites a file in place (a step is renamed into place whole; pruning
    unlinks). Elsewhere (an object store) each file is read once, as bytes, by ``verify``."""

    def __init__(self, uri: str, sha256: str | None) -> None:
        self.uri = uri
        fs, self.path, entries = _manifest(uri, sha256)
        self.local = "file" in _protocols(fs)
        if not self.local:
            self.data = verify(uri, sha256)
            return
        for name, entry in entries.items():
            digest = hashlib.sha256()
            try:
                with open(f"{self.path}/{name}", "rb") as file:
                    while chunk := file.read(_WRITE_CHUNK):
                        digest.update(chunk)
            except storage_errors() as exc:
                raise CheckpointError(f"checkpoint {uri}: {name} cannot be read: {exc}") from exc
            if digest.hexdigest() != entry["sha256"]:
                raise CheckpointError(f"checkpoint {uri}: {name} does not match its sha256 in "
                                      "the manifest (tampered with or corrupted)")
        self.names = set(entries)

    def bytes(self, name: str) -> bytes:
        if not self.local:
            return self.data[name]
        if name not in self.names:
            raise KeyError(name)
        with open(f"{self.path}/{name}", "rb") as file:
            return file.read()

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The file's tensors by name, in sorted order (``_tensors``)."""
        if not self.local:
            return _tensors(self.data[name])
        if name not in self.names:
            raise KeyError(name)
        return dict(sorted(st_load_file(f"{self.path}/{name}").items()))


def load(uri: str, sha256: str | None = None) -> CheckpointContents:
    """The verified contents of the checkpoint at ``uri`` (see ``verify``; on a local disk
    without holding the files' bytes beside the tensors, ``_Files``)."""
    files = _Files(uri, sha256)
    try:
        meta = json.loads(files.bytes("meta.json"))
        trainer = files.tensors("trainer.safetensors")
        optimizer_tensors = files.tensors("optimizer.safetensors")
        return CheckpointContents(
            step=meta["step"], policy_version=meta["policy_version"], model=meta["model"],
            recipe=meta["recipe"], trainer_group=meta["trainer_group"],
            weights=files.tensors("model.safetensors"),
            optimizer=_optimizer_from(meta["optimizer"], optimizer_tensors),
            rng={name[len("rng."):]: t for name, t in trainer.items() if name.startswith("rng.")},
            algorithm_state=meta["algorithm_state"],
            offsets=tuple(TopicOffset(**o) for o in meta["offsets"]),
            trained_units=trainer["trained_units"].numpy().view(np.uint64).copy(),
            step_units=tuple(meta["step_units"]), metrics=meta["metrics"],
            created_at=meta["created_at"], rolled_back_to=meta.get("rolled_back_to"))
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {uri} is not a reef-stream checkpoint: {exc}") from exc
    except storage_errors() as exc:
        raise CheckpointError(f"checkpoint {uri} cannot be read: {exc}") from exc


def load_weights(uri: str, sha256: str) -> dict[str, torch.Tensor]:
    """Only the weights of a checkpoint, after verifying all of it against ``sha256``.

    What a serving replica calls before swapping weights in; raises
    ``CheckpointError`` on any mismatch, so the caller keeps what it serves.
    """
    files = _Files(uri, sha256)
    try:
        return files.tensors("model.safetensors")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
        raise CheckpointError(f"checkpoint {uri}: model.safetensors is unreadable: {exc}") from exc


def _tensors(data: bytes) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, by name in sorted order: safetensors hands them over in
    an order that changes from process to process, and ranks that load a checkpoint and
    then shard it (one collective per tensor) must go through it in the same order."""
    return dict(sorted(st_load(data).items()))


# --------------------------------------------------------------------------- serialisation


def _tensor_files(contents: CheckpointContents) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """The checkpoint's safetensors files, each as its name and tensors, in writing order
    (views of the caller's tensors where they are on the CPU; nothing is serialised here)."""
    yield "model.safetensors", dict(contents.weights)
    _, optimizer_tensors = _optimizer_to(contents.optimizer)
    yield "optimizer.safetensors", optimizer_tensors
    units = np.ascontiguousarray(np.asarray(contents.trained_units, dtype=np.uint64))
    trainer = {f"rng.{name}": t for name, t in contents.rng.items()}
    trainer["trained_units"] = torch.from_numpy(units.view(np.int64).copy())
    yield "trainer.safetensors", trainer


def _meta_json(contents: CheckpointContents) -> bytes:
    optimizer_meta, _ = _optimizer_to(contents.optimizer)
    meta = {
        "step": contents.step, "policy_version": contents.policy_version, "model": contents.model,
        "recipe": contents.recipe, "trainer_group": contents.trainer_group,
        "optimizer": optimizer_meta, "algorithm_state": dict(contents.algorithm_state),
        "offsets": [{"topic": o.topic, "partition": o.partition, "offset": o.offset}
                    for o in contents.offsets],
        "step_units": list(contents.step_units), "metrics": dict(contents.metrics),
        "created_at": contents.created_at or int(time.time() * 1000),
    }
    if contents.rolled_back_to is not None:  # absent otherwise: a step's meta is unchanged
        meta["rolled_back_to"] = contents.rolled_back_to
    return json.dumps(meta, sort_keys=True).encode()


def _serialise(contents: CheckpointContents) -> dict[str, bytes]:
    """Every file of the checkpoint as bytes, in memory (for tests and small checkpoints;
    ``CheckpointStore.write`` streams them instead, ``write_safetensors``)."""
    files = {name: st_save({k: t.detach().cpu().contiguous() for k, t in tensors.items()})
             for name, tensors in _tensor_files(contents)}
    files["meta.json"] = _meta_json(contents)
    return files


# safetensors' dtype names, and the order its writer lays tensors out in (by dtype, the last
# of this list first, then by name): the bytes ``write_safetensors`` writes are those of
# ``safetensors.torch.save`` for the same tensors.
_ST_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8",
              torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16",
              torch.uint16: "U16", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
              torch.complex64: "C64", torch.float64: "F64", torch.int64: "I64",
              torch.uint64: "U64"}
_ST_RANK = {dtype: rank for rank, dtype in enumerate(_ST_DTYPES)}
_WRITE_CHUNK = 64 << 20


def write_safetensors(fs: Any, path: str, tensors: Mapping[str, torch.Tensor], *,
                      local: bool) -> dict[str, Any]:
    """Write ``tensors`` as a safetensors file at ``path``, one tensor at a time, hashing as it
    writes; returns its manifest entry (``sha256``, ``bytes``). On a local disk the file is
    fsynced before this returns (blocks).

    The bytes are ``safetensors.torch.save(tensors)``'s, but never all in memory: a CPU tensor
    is written from its own memory (a GPU or non-contiguous one through a copy of that tensor
    alone), so a checkpoint of any size is written with no more extra memory than its largest
    tensor. ``FatalError`` for a sparse tensor or a dtype safetensors has no name for.
    """
    digest, size = hashlib.sha256(), 0
    with (open(path, "wb") if local else fs.open(path, "wb")) as out:
        for chunk in safetensors_chunks(tensors):
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
        if local:
            out.flush()
            os.fsync(out.fileno())
    return {"sha256": digest.hexdigest(), "bytes": size}


def safetensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """The sha256 of ``safetensors.torch.save(tensors)``, computed without those bytes in
    memory (``safetensors_chunks``): what a checkpoint's manifest says of its
    ``model.safetensors`` when ``tensors`` are its weights."""
    digest = hashlib.sha256()
    for chunk in safetensors_chunks(tensors):
        digest.update(chunk)
    return digest.hexdigest()


def safetensors_chunks(tensors: Mapping[str, torch.Tensor]) -> Iterator[Any]:
    """The bytes of ``safetensors.torch.save(tensors)``, in pieces of at most 64 MiB (buffers:
    the header as ``bytes``, then views of each tensor's own memory, valid until the next
    piece is asked for). ``FatalError`` for a sparse tensor or a dtype safetensors has no
    name for."""
    layout = []
    for name, tensor in tensors.items():
        if tensor.layout != torch.strided or tensor.dtype not in _ST_DTYPES:
            raise FatalError(f"checkpoint tensor {name!r} ({tensor.dtype}, {tensor.layout}) "
                             "cannot be stored in safetensors")
        layout.append((name, tensor))
    layout.sort(key=lambda item: (-_ST_RANK[item[1].dtype], item[0]))
    header, offset = {}, 0
    for name, tensor in layout:
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    yield len(head).to_bytes(8, "little") + head
    for _, tensor in layout:
        if tensor.numel() == 0:
            continue
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        view = memoryview(data)
        for start in range(0, len(view), _WRITE_CHUNK):
            yield view[start:start + _WRITE_CHUNK]
        del data, view


def _optimizer_to(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A torch optimizer state dict as JSON (param groups, scalars) + named tensors.

    ``optimizer.state_dict()`` keys its state by parameter index; a full state dict gathered
    from sharded ranks (``torch.distributed.checkpoint.state_dict.get_state_dict``, as FSDP
    needs) keys it by parameter name, dots and all: those names are kept in order in
    ``param_keys`` and the tensors named by their position (``state.<i>.<name>``)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    state = state_dict.get("state", {})
    by_name = not all(isinstance(param, int) for param in state)
    keys = list(state)
    for index, (param, values) in enumerate(state.items()):
        slot = index if by_name else param
        for name, value in values.items():
            if isinstance(value, torch.Tensor):  # written from its own memory, no copy
                tensors[f"state.{slot}.{name}"] = value.detach()
            else:
                scalars.setdefault(str(slot), {})[name] = value
    meta = {"param_groups": _jsonable(state_dict.get("param_groups", [])), "scalars": scalars}
    if by_name:
        meta["param_keys"] = [str(key) for key in keys]
    return meta, tensors


def _optimizer_from(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    names = meta.get("param_keys")
    key = (lambda slot: names[int(slot)]) if names is not None else int
    state: dict[Any, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        _, slot, entry = name.split(".", 2)
        state.setdefault(key(slot), {})[entry] = tensor
    for slot, values in meta["scalars"].items():
        state.setdefault(key(slot), {}).update(values)
    if names is not None:  # the state in the order it was given
        state = {name: state[name] for name in names if name in state}
    return {"state": state, "param_groups": meta["param_groups"]}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        return value.item()
    raise FatalError(f"optimizer state holds a {type(value).__name__}, which a checkpoint "
                     "cannot store as JSON")


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _path_of(uri: str) -> str:
    return fsspec.core.url_to_fs(uri)[1]


def storage_errors() -> tuple[type[BaseException], ...]:
    """What a store's failure raises: ``OSError``, and botocore's own errors (a refused
    connection, a timeout, an error response) once an S3 filesystem has loaded botocore, which
    raises them outside ``OSError``. For ``except storage_errors():`` around store calls."""
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is None:
        return (OSError,)
    return (OSError, botocore.BotoCoreError, botocore.ClientError)


def store_unreachable(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) says the store could not be reached: a
    refused or dropped connection, a timeout, botocore's connection and HTTP client errors.
    Such a failure may pass; a missing or corrupt checkpoint will not."""
    botocore = sys.modules.get("botocore.exceptions")
    transient: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)
    if botocore is not None:
        transient += (botocore.ConnectionError, botocore.HTTPClientError)
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, transient):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


#: fsspec protocols whose batch delete (DeleteObjects) some S3-compatible stores refuse.
_S3_PROTOCOLS = frozenset({"s3", "s3a"})


def remove_tree(fs: Any, path: str) -> None:
    """Remove ``path`` and everything under it (blocks). On S3 one object at a time
    (DeleteObject): not every S3-compatible store implements the batch delete with the
    checksum headers current clients send (S3Proxy answers "not implemented")."""
    if _S3_PROTOCOLS.isdisjoint(_protocols(fs)):
        fs.rm(path, recursive=True)
        return
    for name in fs.find(path):
        fs.rm_file(name)
    fs.invalidate_cache(path)


def write_durably(fs: Any, path: str, data: bytes, *, local: bool) -> None:
    """Write ``data`` to ``path``; on a local disk, fsynced before returning (blocks)."""
    if local:
        with open(path, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    else:
        with fs.open(path, "wb") as out:
            out.write(data)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_store_url(home: Path, namespace: str, recipe: str, group: str) -> str:
    """``$REEF_HOME/checkpoints/<ns>/<recipe>/<group>``: where ``reef train`` writes by default."""
    return str(home / "checkpoints" / namespace / recipe / group)
