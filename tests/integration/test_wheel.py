"""The built wheel works outside the checkout: broker up, topics, a record in and back out.

The wheel is built from a copy of the checkout's sources (so no stale ``build/`` and
nothing written into the checkout), installed with ``pip install --target`` into a
directory of its own, and run with that directory first on ``PYTHONPATH`` from a
working directory outside the checkout: the interpreter is this one (its
dependencies are installed), but ``reef_stream`` comes from the wheel, which the test
checks before it starts anything. The broker is the CLI's own (``reef kafka up`` in
a REEF_HOME of the test's), never the session's.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CHECKOUT = Path(__file__).resolve().parents[2]
#: What the build reads from the checkout.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "reef_stream", "methods", "schemas",
           "infra")
#: The broker's files reef_stream.servers.kafka_local reads at run time.
KAFKA_RUNTIME_FILES = ("pom.xml", "server.properties.template", "log4j.properties")


def _run(args: list[str], *, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {result.returncode}\n"
                             f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built offline (no build isolation) from a copy of the sources."""
    source = tmp_path_factory.mktemp("source")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in SOURCES:
        origin = CHECKOUT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(origin, source / name)
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-cache-dir", "--quiet", "--wheel-dir", str(dist), "."], cwd=source)
    wheels = list(dist.glob("reef_stream-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_holds_the_schemas_templates_and_methods_and_no_top_level_methods(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"reef_stream", wheel.name.split("-py3")[0] + ".dist-info"}, top_level

    schemas = {path.relative_to(CHECKOUT / "schemas").as_posix()
               for path in (CHECKOUT / "schemas").rglob("*.avsc")}
    assert "history" in {Path(s).parts[0] for s in schemas}
    missing = [s for s in schemas if f"reef_stream/_data/schemas/{s}" not in names]
    assert missing == [], missing
    for name in KAFKA_RUNTIME_FILES:
        assert f"reef_stream/_data/kafka/{name}" in names, name
    for name in ("reef_stream/methods/__init__.py", "reef_stream/methods/sao/__init__.py",
                 "reef_stream/methods/grpo/__init__.py", "reef_stream/py.typed",
                 "reef_stream/ops/dashboard/static/index.html"):
        assert name in names, name

    metadata = email.parser.Parser().parsestr(
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        .decode())
    requires = metadata.get_all("Requires-Dist")
    faust = [r for r in requires if r.startswith("faust-streaming")]
    assert faust and all('extra == "faust"' in r for r in faust), faust
    assert any(r.startswith("aiohttp") and "extra" not in r for r in requires), requires
    assert "faust" in metadata.get_all("Provides-Extra")


def test_the_installed_wheel_produces_and_tails_a_record_outside_the_checkout(wheel, tmp_path):
    target, work, home = tmp_path / "site", tmp_path / "work", tmp_path / "home"
    work.mkdir()
    assert not work.resolve().is_relative_to(CHECKOUT)
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--quiet",
          "--target", str(target), str(wheel)], cwd=work)

    # The environment of a user's shell, with none of the test session's REEF_* servers.
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("REEF_") or key == "REEF_CACHE_DIR"}
    env.update(PYTHONPATH=str(target), REEF_HOME=str(home), COLUMNS="200",
               PATH=os.pathsep.join([str(target / "bin"), env.get("PATH", "")]))
    reef_script = target / "bin" / "reef"
    assert reef_script.is_file()

    probe = _run([sys.executable, "-c",
                  "import json, importlib.util, reef_stream, reef_stream.methods.sao\n"
                  "from reef_stream.core.settings import SCHEMAS_DIR, KAFKA_INFRA_DIR\n"
                  "print(json.dumps({'package': reef_stream.__file__,\n"
                  "  'sao': reef_stream.methods.sao.__file__, 'schemas': str(SCHEMAS_DIR),\n"
                  "  'kafka': str(KAFKA_INFRA_DIR),\n"
                  "  'methods': importlib.util.find_spec('methods') is not None}))"],
                 cwd=work, env=env)
    found = json.loads(probe.stdout)
    for key in ("package", "sao", "schemas", "kafka"):
        assert Path(found[key]).resolve().is_relative_to(target.resolve()), (key, found)
    assert found["methods"] is False, "a top-level package `methods` is importable"

    def reef(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return _run([str(reef_script), *args], cwd=work, env=env, timeout=timeout)

    started = reef("kafka", "up", "--port", "0")
    try:
        assert "bootstrap: 127.0.0.1:" in started.stdout, started.stdout
        reef("topics", "create")
        generation_id = f"wheel-{uuid.uuid4().hex[:8]}"
        records = work / "generations.jsonl"
        records.write_text(json.dumps({
            "generation_id": generation_id, "request_id": "r-1", "prompt_id": "p-1",
            "model": "tiny", "policy_version": 1, "replica_id": "replica-a",
            "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5],
            "completion_logprobs": [-0.5, -1.25], "finish_reason": "stop",
            "sampling": {"temperature": 1.0, "max_tokens": 16},
        }) + "\n")
        reef("produce", "generations", str(records))
        tailed = reef("tail", "generations", "-n", "1").stdout.splitlines()
        assert len(tailed) == 1, tailed
        record = json.loads(tailed[0])
        assert record["topic"] == "reef.generations"
        assert record["value"]["generation_id"] == generation_id
        assert record["value"]["completion_token_ids"] == [4, 5]
    finally:
        reef("kafka", "down")
