"""The README's commands are the ones that run: CI's, the main job's, and every `reef ...`
command it shows, with its options. tests/integration/test_quickstart.py runs its five steps."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import click
import pytest

from reef_stream.api.recipe import load_recipe
from reef_stream.cli.main import main as reef_main
from reef_stream.core.events import Decision, Publication
from reef_stream.core.processes import free_ports
from reef_stream.core.settings import PROJECT_ROOT
from reef_stream.demo.task import accuracy, initial_policy, policy_model
from reef_stream.engine.checkpoints import CheckpointStore, load_weights
from reef_stream.topics.declarations import publications
from tests.helpers import consume_events, reef

README = (PROJECT_ROOT / "README.md").read_text()


def _setup_commands() -> list[str]:
    section = README.split("## On a fresh machine", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.DOTALL)


def _readme_reef_commands() -> list[str]:
    """Every `reef ...` command the README shows: inline code and the lines of its bash blocks
    (comments and a trailing ``&`` left off)."""
    commands = re.findall(r"`(reef [^`]+)`", README)
    for block in re.findall(r"```bash\n(.*?)\n```", README, flags=re.DOTALL):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip().removesuffix("&").strip()
            if line.startswith("reef "):
                commands.append(line)
    return sorted(set(commands))


def _command_and_flags(command: str) -> tuple[tuple[str, ...], set[str]]:
    """(the subcommand's words, the options it is shown with) of a README command, as the
    ``reef`` click group resolves them: ``reef kafka up [--nodes 1|3]`` -> (("kafka", "up"),
    {"--nodes"}); ``reef tail dead-letters`` -> (("tail",), set())."""
    path, group = [], reef_main
    for word in command.split()[1:]:
        if not isinstance(group, click.Group) or word not in group.commands:
            break
        path.append(word)
        group = group.commands[word]
    return tuple(path), set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", command)) - {"--help"}


def _readme_options() -> dict[tuple[str, ...], set[str]]:
    """The options the README gives each command, by the command's words."""
    options: dict[tuple[str, ...], set[str]] = {}
    for command in _readme_reef_commands():
        path, flags = _command_and_flags(command)
        options.setdefault(path, set()).update(flags)
    return options


README_OPTIONS = _readme_options()


def test_the_readme_shows_commands_and_their_options():
    """The extraction finds the five steps' commands and options (so the check of every
    command below cannot pass on nothing)."""
    assert {"--recipe", "--partitions"} <= README_OPTIONS[("topics", "create")]
    assert {"--recipe", "--group"} <= README_OPTIONS[("train",)]
    assert README_OPTIONS[("tail",)] == set()       # `reef tail dead-letters`: an argument


def test_readme_gives_exactly_two_commands_and_ci_runs_the_test_one():
    main_job, tests = _setup_commands()
    assert main_job == "bash scripts/demo.sh"
    assert tests == "bash scripts/test.sh"
    assert "exec bash scripts/test.sh" in (PROJECT_ROOT / ".ci" / "run").read_text()


def test_the_main_job_command_runs_the_demo_on_the_embedded_default(cli_env, tmp_path):
    """The README's first command, as written: it starts the local broker and Redis, the whole
    loop runs until a published version reaches the default target (0.9), and that version's
    weights, loaded from its publication and verified, do score it. A few minutes.

    It runs in a ``REEF_HOME`` of its own, where a broker and a Redis were first created on
    free ports and stopped (a cluster keeps the ports it was created with), so a reef already
    running on the default ports cannot make it skip or fail: it never skips."""
    env = {k: v for k, v in cli_env.items()
           if k not in ("REEF_BOOTSTRAP_SERVERS", "REEF_REDIS_URL")}
    assert Path(env["REEF_HOME"]).is_relative_to(tmp_path)
    try:
        created = reef("kafka", "up", "--port", "0", env=env).stdout
        bootstrap = re.search(r"bootstrap: (\S+)", created).group(1)
        created = reef("redis", "up", "--port", str(free_ports(1)[0]), env=env).stdout
        redis_url = re.search(r"redis: (\S+)", created).group(1)
        reef("kafka", "down", env=env)
        reef("redis", "down", env=env)
        result = subprocess.run(_setup_commands()[0], shell=True, cwd=PROJECT_ROOT, env=env,
                                capture_output=True, text=True, timeout=1500)
        print(result.stdout[-3000:])
        assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
        assert f"bootstrap: {bootstrap}" in result.stdout     # the demo started them itself
        assert f"redis: {redis_url}" in result.stdout
        assert "reached the target" in result.stdout
        namespace = re.search(r"^demo (\S+):", result.stdout, re.M).group(1)
        # The version the demo names: the evaluator may promote later ones (within its
        # tolerance) before the demo stops it.
        claimed = int(re.search(r"at published version (\d+)", result.stdout).group(1))
        chosen = [p for p in consume_events(bootstrap, publications(namespace), 1, Publication)
                  if p.decision is Decision.PROMOTED and p.policy_version == claimed]
        assert len(chosen) == 1, claimed
        # Its published copy may be pruned by now; the trainer's store keeps every checkpoint.
        run_dir = Path(re.search(r"logs in (\S+)", result.stdout).group(1)).parent
        stored = [c for c in CheckpointStore(run_dir / "checkpoints").steps()
                  if c.sha256 == chosen[0].sha256]
        assert len(stored) == 1
        model = policy_model()
        model.load_state_dict(load_weights(stored[0].uri, stored[0].sha256))
        assert accuracy(model) >= 0.9
        seed = load_recipe("reef_stream.demo.recipes:sao").schedule.seed
        assert accuracy(initial_policy(seed)) <= 0.1
    finally:
        reef("kafka", "down", env=env)
        reef("redis", "down", env=env)


#: Every command; those the README shows are among them (README_OPTIONS's keys are added).
COMMANDS = sorted({tuple(c) for c in [
    [], ["up"], ["kafka"], ["kafka", "up"], ["kafka", "down"], ["kafka", "status"],
    ["kafka", "fetch"], ["redis", "up"], ["redis", "status"], ["topics", "create"],
    ["topics", "verify"], ["replay"], ["tail"], ["lag"],
    ["produce"], ["intake"], ["intake", "serve"], ["reward"], ["process"], ["train"],
    ["evaluate"], ["follow"], ["fleet"], ["demo"], ["check"], ["trace"], ["top"], ["dashboard"],
    ["sink"], ["sink", "tensorboard"], ["sink", "wandb"], ["rescore"], ["approve"], ["reject"],
    ["rollback"], ["engine"], ["scorecard"],
]} | set(README_OPTIONS))


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "reef")
def test_every_command_explains_itself(command, cli_env):
    """Each command's --help explains it and lists every option the README gives it: a
    command or option renamed in the code fails here, not in a newcomer's shell."""
    result = reef(*command, "--help", env=cli_env)
    assert result.stdout.startswith("Usage: ")
    assert len(result.stdout.splitlines()) > 4
    missing = sorted(flag for flag in README_OPTIONS.get(command, ())
                     if not re.search(rf"(?<![\w-]){flag}(?![\w-])", result.stdout))
    assert not missing, f"the README shows reef {' '.join(command)} with {missing}"
