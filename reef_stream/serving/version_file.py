"""The served-version file: which policy version a replica's engine serves, for a proxy beside it.

``Follower(version_file=PATH)`` (``reef follow --version-file PATH``) keeps PATH saying what
the engine serves; ``reef intake proxy --policy-version-file PATH`` stamps each recorded
Generation with it (``reef_stream.intake.proxy.Versions``). The content is one JSON object::

    {"policy_version": 12, "state": "serving", "model": "m", "replica_id": "r",
     "checkpoint_id": "...", "published_at": 1700000000000, "loaded_at": 1700000000500,
     "written": 3, "written_at": 1700000000500}

``policy_version`` is null while no version is known to be served: ``state`` ``starting``
(nothing loaded by this follower yet) or ``reloading`` (a load in progress; ``loading``
names its version). ``written`` counts the writes of this follower, so no two writes give
the same content.

The order is the promise: ``reloading`` is written before the engine is asked to load a
version, and the version only after the engine said it serves it (after a refused load,
the version served before, again). So the file never names a version the engine does not
serve, and a reader that finds the same content before and after a request knows that no
load began or ended in between: the request was served by the version it names. Each write
replaces the file whole (a temporary file in the same directory, fsync, ``os.replace``,
fsync of the directory): a reader sees the old content or the new, never a part. Blocks on
the disk; raises ``OSError`` when it cannot write.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from reef_stream.core.events import Publication, now_ms
from reef_stream.engine.checkpoints import fsync_dir

__all__ = ["RELOADING", "SERVING", "STARTING", "ServedVersionFile", "replace_atomically"]

#: ``state`` of a version file: nothing loaded by this follower yet / a load in progress /
#: the engine serves ``policy_version``.
STARTING, RELOADING, SERVING = "starting", "reloading", "serving"


def replace_atomically(path: Path, text: str) -> None:
    """Make ``path`` hold ``text``, whole or not at all: a temporary file in the same directory,
    written and fsynced, renamed over ``path`` (``os.replace``), then the directory fsynced.
    Blocks; raises ``OSError`` (the temporary file removed)."""
    directory = path.parent
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    fsync_dir(str(directory))


class ServedVersionFile:
    """The version file of one follower (see the module docstring). Not thread-safe: the
    follower writes it from its own thread only. Every method blocks on the disk and raises
    ``OSError`` when the file cannot be written."""

    def __init__(self, path: Path, *, model: str, replica_id: str) -> None:
        self.path = Path(path)
        self.model, self.replica_id = model, replica_id
        self.written = 0

    def starting(self, initial_version: int | None) -> None:
        """At the start: ``initial_version`` (the base weights) if given, else unknown."""
        if initial_version is None:
            self._write({"policy_version": None, "state": STARTING})
        else:
            self._write({"policy_version": initial_version, "state": SERVING,
                         "loaded_at": now_ms()})

    def reloading(self, publication: Publication, serving: int | None) -> None:
        """Before the engine is asked to load ``publication``'s version: unknown."""
        self._write({"policy_version": None, "state": RELOADING,
                     "loading": publication.policy_version, "serving_before": serving})

    def serving(self, version: int | None, publication: Publication | None) -> None:
        """Once the engine serves ``version`` (``publication``: what promoted it; None for the
        initial version). ``version`` None: nothing is known to be served (``starting``)."""
        if version is None:
            self._write({"policy_version": None, "state": STARTING})
            return
        content: dict = {"policy_version": version, "state": SERVING}
        if publication is not None:
            content.update(checkpoint_id=publication.checkpoint_id,
                           published_at=publication.created_at)
        content["loaded_at"] = now_ms()
        self._write(content)

    def _write(self, content: dict) -> None:
        self.written += 1
        text = json.dumps({**content, "model": self.model, "replica_id": self.replica_id,
                           "written": self.written, "written_at": now_ms()})
        replace_atomically(self.path, text + "\n")
