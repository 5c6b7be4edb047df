"""Each way `reef kafka up` can fail gives its own clear message, not a stack trace."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

from reef_stream.servers.kafka_local import check_java
from tests.helpers import reef


def _local_env(cli_env, tmp_path, **extra):
    env = {k: v for k, v in cli_env.items() if k != "REEF_BOOTSTRAP_SERVERS"}
    env["REEF_HOME"] = str(tmp_path / "home")
    env.update(extra)
    return env


def test_port_already_taken(cli_env, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = reef("kafka", "up", "--port", str(port), env=_local_env(cli_env, tmp_path),
                      check=False)
    assert result.returncode == 2
    assert f"Port(s) {port}" in result.stderr and "already in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_broker_that_exits_during_start_shows_its_log(cli_env, tmp_path):
    env = _local_env(cli_env, tmp_path)
    reef("kafka", "up", "--port", "0", env=env)
    reef("kafka", "down", env=env)
    properties = tmp_path / "home" / "kafka" / "node-1" / "server.properties"
    properties.write_text(properties.read_text() + "\nnode.id=not-a-number\n")  # the last one wins

    result = reef("kafka", "up", env=env, check=False)

    assert result.returncode == 1
    assert "exited while starting" in result.stderr
    assert str(properties.parent / "server.log") in result.stderr.replace("\n", "")
    assert "Invalid value not-a-number" in result.stderr  # the log excerpt names the cause


def _fake_java(tmp_path: Path, version: str) -> Path:
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f'#!/bin/sh\necho \'openjdk version "{version}" 2020-01-01\' >&2\n')
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    return home


def test_java_older_than_17(cli_env, tmp_path):
    env = _local_env(cli_env, tmp_path, JAVA_HOME=str(_fake_java(tmp_path, "11.0.2")))
    result = reef("kafka", "up", env=env, check=False)
    assert result.returncode == 2
    assert "Java 11" in result.stderr and "17 or newer" in result.stderr


def test_java_missing(cli_env, tmp_path):
    env = _local_env(cli_env, tmp_path, JAVA_HOME=str(tmp_path / "no-jdk"))
    result = reef("kafka", "up", env=env, check=False)
    assert result.returncode == 2
    assert "Java was not found" in result.stderr


def test_maven_missing(cli_env, tmp_path):
    java_home = Path(check_java()).resolve().parents[1]
    env = _local_env(cli_env, tmp_path, JAVA_HOME=str(java_home), PATH=str(tmp_path / "empty"),
                     REEF_CACHE_DIR=str(tmp_path / "cache"))
    result = reef("kafka", "up", env=env, check=False)
    assert result.returncode == 2
    assert "Maven (mvn) was not found" in result.stderr


def test_maven_central_unreachable(cli_env, tmp_path):
    # A Maven home whose only mirror is a closed port on this machine, and an empty local repository.
    user_home = tmp_path / "user"
    (user_home / ".m2").mkdir(parents=True)
    (user_home / ".m2" / "settings.xml").write_text(f"""<settings>
  <localRepository>{user_home / 'repo'}</localRepository>
  <mirrors><mirror><id>closed</id><mirrorOf>*</mirrorOf><url>http://127.0.0.1:9/</url></mirror></mirrors>
</settings>""")
    env = _local_env(cli_env, tmp_path, MAVEN_OPTS=f"-Duser.home={user_home}",
                     REEF_CACHE_DIR=str(tmp_path / "cache"))
    result = reef("kafka", "up", env=env, check=False)
    assert result.returncode == 2
    assert "Maven Central looks unreachable" in result.stderr
