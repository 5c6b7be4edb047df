"""A bench's figures for another revision beside this tree's, in one invocation (``--before``).

    from trees import add_before, before_and_after
    add_before(parser)
    args = parser.parse_args()
    if args.before:
        return before_and_after(__file__, args.before, args.rounds)

``before_and_after`` extracts the revision (``git archive``, nothing in the repository
changes), then runs the same bench with the same arguments (less ``--before`` and
``--rounds``) in that tree and in this one, alternating, ``rounds`` times each, as
subprocesses with each tree first on ``PYTHONPATH``, and prints their output under a header
naming the tree. The revision's bench must take the same arguments.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_before(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", metavar="REV", default=None,
                        help="also run this bench as revision REV has it (its tree extracted "
                             "with git archive), alternating with this tree's")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --before: how many times each tree runs (default 1)")


def _without_before(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--before", "--rounds"):
            skip = True
        elif not arg.startswith(("--before=", "--rounds=")):
            kept.append(arg)
    return kept


def before_and_after(script: str, revision: str, rounds: int) -> int:
    """Run ``script`` (a bench's ``__file__``) in ``revision``'s tree and in this one, as the
    module docstring says; 0, or the first non-zero exit status."""
    relative = Path(script).resolve().relative_to(ROOT)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", revision],
                            check=True, capture_output=True, text=True).stdout.strip()
    old = Path(tempfile.mkdtemp(prefix=f"reef-bench-{commit}-"))
    try:
        archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit],
                                   stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(old)], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise SystemExit(f"git archive {commit} failed")
        argv = _without_before(sys.argv[1:])
        status = 0
        for round_ in range(1, rounds + 1):
            for label, tree in ((f"before: {commit}", old), ("after: this tree", ROOT)):
                print(f"\n===== {label} (round {round_}/{rounds}): python {relative} "
                      f"{' '.join(argv)}", flush=True)
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                    [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
                done = subprocess.run([sys.executable, str(tree / relative), *argv], cwd=tree,
                                      env=env)
                status = status or done.returncode
        return status
    finally:
        shutil.rmtree(old, ignore_errors=True)
