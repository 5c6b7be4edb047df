"""The README's commands are the ones that run: CI's, and the main job's."""

from __future__ import annotations

import re
import subprocess

import pytest

from reef_stream.config import PROJECT_ROOT
from reef_stream.kafka_local import DEFAULT_PORT as KAFKA_PORT
from reef_stream.processes import port_is_free
from reef_stream.redis_local import DEFAULT_PORT as REDIS_PORT
from tests.helpers import reef

README = (PROJECT_ROOT / "README.md").read_text()


def _setup_commands() -> list[str]:
    section = README.split("## On a fresh machine", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_readme_gives_exactly_two_commands_and_ci_runs_the_test_one():
    main_job, tests = _setup_commands()
    assert main_job == "bash scripts/up.sh"
    assert tests == "bash scripts/test.sh"
    assert "exec bash scripts/test.sh" in (PROJECT_ROOT / ".ci" / "run").read_text()


def test_the_main_job_command_brings_up_broker_redis_and_topics(cli_env, tmp_path):
    if not (port_is_free(KAFKA_PORT) and port_is_free(REDIS_PORT)):
        pytest.skip(f"ports {KAFKA_PORT}/{REDIS_PORT} are in use here (a local reef is running?)")
    env = {k: v for k, v in cli_env.items()
           if k not in ("REEF_BOOTSTRAP_SERVERS", "REEF_REDIS_URL")}
    env["COLUMNS"] = "200"  # tables one row per node
    try:
        result = subprocess.run(_setup_commands()[0], shell=True, cwd=PROJECT_ROOT, env=env,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"127.0.0.1:{KAFKA_PORT}" in result.stdout
        assert f"redis://127.0.0.1:{REDIS_PORT}/0" in result.stdout
        assert "active controller" in result.stdout
        assert f"{env['REEF_NAMESPACE']}.generations" in result.stdout
    finally:
        reef("kafka", "down", env=env)
        reef("redis", "down", env=env)


@pytest.mark.parametrize("command", [
    [], ["up"], ["kafka"], ["kafka", "up"], ["kafka", "down"], ["kafka", "status"],
    ["kafka", "fetch"], ["redis", "up"], ["redis", "status"], ["topics", "create"],
    ["topics", "verify"], ["replay"], ["tail"], ["lag"],
    ["produce"], ["intake"], ["intake", "serve"], ["reward"], ["process"], ["train"], ["evaluate"], ["follow"], ["fleet"], ["demo"], ["check"],
])
def test_every_command_explains_itself(command, cli_env):
    result = reef(*command, "--help", env=cli_env)
    assert result.stdout.startswith("Usage: ")
    assert len(result.stdout.splitlines()) > 4
