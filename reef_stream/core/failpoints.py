"""Named fault-injection points, for the fault tests that SIGKILL a process at a chosen moment.

``failpoint("trainer.after-checkpoint", step=3)`` does nothing unless the
environment variable ``REEF_FAILPOINTS`` names that point: a comma-separated
list of ``NAME`` or ``NAME@STEP``. When it matches, the process prints
``failpoint NAME reached (step N)`` on stderr and stops there (sleeps) until
it is killed, so a test can SIGKILL it at exactly that moment. With
``REEF_FAILPOINT_RELEASE`` naming a file, it waits only until that file exists
and then goes on (once per point), so a test can break something else at that
moment (stop the object store in the middle of a checkpoint) and let the
process meet it. In production the variable is unset and a failpoint costs one
dictionary lookup.
"""

from __future__ import annotations

import os
import sys
import time

ENV = "REEF_FAILPOINTS"
RELEASE_ENV = "REEF_FAILPOINT_RELEASE"


def _armed() -> dict[str, int | None]:
    points: dict[str, int | None] = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(ENV, "").split(","))):
        name, _, step = entry.partition("@")
        points[name] = int(step) if step else None
    return points


_ARMED = _armed()


def failpoint(name: str, *, step: int | None = None) -> None:
    """Hang here, announced on stderr, if ``REEF_FAILPOINTS`` arms ``name`` (at this ``step``)."""
    if name not in _ARMED:
        return
    wanted = _ARMED[name]
    if wanted is not None and wanted != step:
        return
    sys.stderr.write(f"failpoint {name} reached (step {step})\n")
    sys.stderr.flush()
    release = os.environ.get(RELEASE_ENV)
    if release:
        del _ARMED[name]
        while not os.path.exists(release):
            time.sleep(0.05)
        sys.stderr.write(f"failpoint {name} released\n")
        sys.stderr.flush()
        return
    while True:
        time.sleep(3600)
