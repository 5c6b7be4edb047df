"""Shared by the tests: run the real `reef` command line as a subprocess."""

from __future__ import annotations

import subprocess
import sys


def reef(*args: str, env: dict[str, str], timeout: float = 180,
         check: bool = True) -> subprocess.CompletedProcess:
    """Run `reef ARGS...`; with ``check``, fail the test showing its output on a non-zero exit."""
    result = subprocess.run(
        [sys.executable, "-m", "reef_stream.cli", *args],
        env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"reef {' '.join(args)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result
