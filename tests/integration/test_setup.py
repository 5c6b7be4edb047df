"""scripts/setup.sh installs an inference engine only when asked: the demo's setup (what
``bash scripts/demo.sh`` runs) leaves vLLM's ~6 GB environment out, the tests' setup names it.

Runs the real script in this checkout: it is idempotent, so here (after scripts/test.sh set the
checkout up) it only checks and says what it skips."""

from __future__ import annotations

import os
import re
import subprocess

from reef_stream.core.settings import PROJECT_ROOT

ENGINE_STEP = "Installing the vllm engine's environment"


def _tests_extras() -> str:
    """The extras scripts/test.sh installs, so this setup has nothing to install again."""
    match = re.search(r"REEF_SETUP_EXTRAS=(\S+)", (PROJECT_ROOT / "scripts" / "test.sh").read_text())
    assert match, "scripts/test.sh names no REEF_SETUP_EXTRAS"
    return match.group(1)


def _setup(**env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("REEF_SETUP_")}
    environ["REEF_SETUP_EXTRAS"] = _tests_extras()
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=PROJECT_ROOT, capture_output=True,
                            text=True, timeout=600, env={**environ, **env})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_the_demo_setup_installs_no_engine_and_the_tests_setup_does():
    demo_sh = (PROJECT_ROOT / "scripts" / "demo.sh").read_text()
    assert "bash scripts/setup.sh" in demo_sh and "REEF_SETUP_ENGINES" not in demo_sh
    assert ENGINE_STEP not in _setup()
    test_sh = (PROJECT_ROOT / "scripts" / "test.sh").read_text()
    assert "REEF_SETUP_ENGINES=vllm bash scripts/setup.sh" in test_sh
    assert ENGINE_STEP in _setup(REEF_SETUP_ENGINES="vllm")
