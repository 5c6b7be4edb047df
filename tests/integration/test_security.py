"""SASL/SCRAM over TLS between reef-stream's clients and a broker that accepts nothing else.

The test starts its own single KRaft node (the jars of ``reef kafka up``,
``infra/kafka/server-sasl-ssl.properties.template``) whose only client listener
is SASL_SSL: it makes a CA and the broker's certificate with openssl, creates
the SCRAM users when it formats the storage, and stops the node at the end.
Clients are configured only through ``REEF_KAFKA_*``, as a deployment would be:
``reef topics create`` (admin client), ``reef produce`` (the idempotent
RecordProducer), ``reef tail`` (a consumer) and a transactional producer (the
processor's kind) work with the right password; a wrong password or an
untrusted CA is refused with an error that says what to check and never shows
the password, and on the admin path of ``reef lag`` / ``reef replay`` /
``reef topics create`` (``connect.list_topics``, ``connect.await_answer``) that
error comes within seconds, not after a
request's 30 s timeout as "broker transport failure".
"""

from __future__ import annotations

import json
import os
import re
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient

from reef_stream.core.processes import free_ports, log_tail, reap
from reef_stream.core.settings import KAFKA_ENV_PREFIX, KAFKA_INFRA_DIR, load_settings
from reef_stream.servers.kafka_local import _kafka_cluster_id, check_java, kafka_classpath
from reef_stream.topics.connect import client_config
from tests.helpers import wait_until

USER, PASSWORD = "reef-trainer", "s3cret-Trainer-pw"
BROKER_USER, BROKER_PASSWORD = "broker", "s3cret-Broker-pw"
WRONG_PASSWORD = "not-the-Password-42"


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


def _certificates(directory: Path, name: str) -> tuple[Path, Path]:
    """A CA, and a key + certificate it signed for 127.0.0.1: (CA file, keystore file)."""
    directory.mkdir(parents=True)
    _openssl(directory, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-keyout", "ca.key", "-out", "ca.pem", "-subj", f"/CN={name} CA")
    _openssl(directory, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key",
             "-out", "broker.csr", "-subj", "/CN=127.0.0.1")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(directory, "x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-out", "broker.pem", "-extfile", "san.cnf")
    keystore = directory / "keystore.pem"  # PKCS#8 key, then the certificate
    keystore.write_text((directory / "broker.key").read_text() + (directory / "broker.pem").read_text())
    keystore.chmod(0o600)
    return directory / "ca.pem", keystore


class SecureBroker:
    """One KRaft node listening only on SASL_SSL, with SCRAM users made at format time."""

    def __init__(self, directory: Path):
        settings = load_settings({k: v for k, v in os.environ.items()
                                  if not k.startswith(KAFKA_ENV_PREFIX)})
        self.directory = directory
        self.ca, keystore = _certificates(directory / "tls", "reef test")
        self.port, controller_port = free_ports(2)
        self.bootstrap = f"127.0.0.1:{self.port}"
        properties = directory / "server.properties"
        template = (KAFKA_INFRA_DIR / "server-sasl-ssl.properties.template").read_text()
        properties.write_text(string.Template(template).substitute(
            port=self.port, controller_port=controller_port, log_dir=directory / "log",
            broker_user=BROKER_USER, broker_password=BROKER_PASSWORD,
            keystore=keystore, truststore=self.ca))
        properties.chmod(0o600)  # it holds the broker's password
        java, classpath = check_java(), kafka_classpath(settings.cache_dir)
        jvm = ["-Xms256m", "-Xmx512m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
               f"-Dlog4j.configuration=file:{KAFKA_INFRA_DIR / 'log4j.properties'}",
               f"-Dkafka.logs.dir={directory}"]
        formatted = subprocess.run(
            [java, *jvm, "-cp", classpath, "kafka.tools.StorageTool", "format",
             f"--cluster-id={_kafka_cluster_id()}", "-c", str(properties),
             "--add-scram", f"SCRAM-SHA-256=[name={BROKER_USER},password={BROKER_PASSWORD}]",
             "--add-scram", f"SCRAM-SHA-256=[name={USER},password={PASSWORD}]",
             "--add-scram", f"SCRAM-SHA-512=[name={USER},password={PASSWORD}]"],
            capture_output=True, text=True)
        assert formatted.returncode == 0, formatted.stdout + formatted.stderr
        with open(directory / "stdout.log", "ab") as out:
            self.process = subprocess.Popen(
                [java, *jvm, "-cp", classpath, "kafka.Kafka", str(properties)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=directory)

    def env(self, namespace: str, home: Path, password: str = PASSWORD, ca: Path | None = None,
            mechanism: str = "SCRAM-SHA-256") -> dict[str, str]:
        """A `reef` environment that reaches this broker only through REEF_KAFKA_*."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(KAFKA_ENV_PREFIX)}
        env.update(REEF_BOOTSTRAP_SERVERS=self.bootstrap, REEF_NAMESPACE=namespace,
                   REEF_HOME=str(home), REEF_KAFKA_SECURITY_PROTOCOL="SASL_SSL",
                   REEF_KAFKA_SASL_MECHANISM=mechanism, REEF_KAFKA_SASL_USERNAME=USER,
                   REEF_KAFKA_SASL_PASSWORD=password, REEF_KAFKA_SSL_CA_LOCATION=str(ca or self.ca))
        return env

    def wait_ready(self, timeout: float = 60.0) -> None:
        settings = load_settings(self.env("ready", self.directory))
        admin = AdminClient(client_config(self.bootstrap,
                                          {"socket.connection.setup.timeout.ms": 2000},
                                          settings=settings))

        def answering() -> bool:
            assert self.process.poll() is None, (
                f"the SASL_SSL broker exited:\n{log_tail(self.directory / 'server.log')}")
            try:
                return bool(admin.list_topics(timeout=2).brokers)
            except Exception:  # noqa: BLE001 - not answering yet
                return False

        wait_until(answering, timeout, lambda: "the SASL_SSL broker to answer:\n"
                   f"{log_tail(self.directory / 'server.log')}", poll_s=0.3)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        reap(self.process.pid)


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    server = SecureBroker(tmp_path_factory.mktemp("sasl-ssl"))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _reef(env: dict[str, str], *args: str, timeout: float = 60,
          stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reef_stream.cli", *args], env=env, text=True,
                          capture_output=True, timeout=timeout, input=stdin)


def _count(summary: str, label: str) -> int:
    """A count from the table `reef produce` prints at the end."""
    match = re.search(rf"^\W*{re.escape(label)}\s*\W\s*(\d+)", summary, re.MULTILINE)
    assert match, summary
    return int(match.group(1))


def _generation(generation_id: str) -> dict:
    return {"generation_id": generation_id, "request_id": f"r-{generation_id}",
            "prompt_id": "p-1", "model": "m", "policy_version": 0, "replica_id": "replica-a",
            "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4],
            "completion_logprobs": [-0.1, -0.2], "finish_reason": "stop",
            "sampling": {"temperature": 1.0, "max_tokens": 8}}


def test_the_right_credentials_work_through_every_kind_of_client(broker, namespace, tmp_path):
    env = broker.env(namespace, tmp_path / "home")

    created = _reef(env, "topics", "create")  # admin client
    assert created.returncode == 0, created.stderr
    assert f"created {namespace}.generations" in created.stderr + created.stdout

    lines = "".join(json.dumps(_generation(f"g-{i}")) + "\n" for i in range(3))
    produced = _reef(env, "produce", "generations", "-", "--flush-timeout", "30", stdin=lines)
    assert produced.returncode == 0, produced.stderr  # the idempotent RecordProducer
    assert _count(produced.stdout, "acknowledged") == 3, produced.stdout

    tailed = _reef(env, "tail", "generations", "--from", "earliest", "-n", "3")  # a consumer
    assert tailed.returncode == 0, tailed.stderr
    ids = {json.loads(line)["value"]["generation_id"] for line in tailed.stdout.splitlines()
           if line.startswith("{")}
    assert ids == {"g-0", "g-1", "g-2"}, tailed.stdout

    # A transactional producer, as the processor runs one: its commit markers travel
    # broker-to-broker over the same SASL_SSL listener.
    settings = load_settings({**env, "REEF_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512"})
    producer = Producer(client_config(broker.bootstrap, {
        "transactional.id": f"{namespace}.processor.test", "enable.idempotence": True},
        settings=settings))
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(f"{namespace}.dead-letters", b"transactional")
    producer.commit_transaction(30)


def test_a_wrong_password_is_refused_with_a_clear_error(broker, namespace, tmp_path):
    env = broker.env(namespace, tmp_path / "home", password=WRONG_PASSWORD)

    lines = json.dumps(_generation("g-refused")) + "\n"
    produced = _reef(env, "produce", "generations", "-", "--flush-timeout", "3", stdin=lines)
    output = produced.stdout + produced.stderr
    assert "refused to authenticate" in output, output
    assert f"SCRAM-SHA-256 as '{USER}'" in output
    assert "REEF_KAFKA_SASL_PASSWORD" in output
    assert WRONG_PASSWORD not in output and PASSWORD not in output
    assert _count(produced.stdout, "acknowledged") == 0  # held in the spool, not lost
    assert _count(produced.stdout, "not yet acknowledged (spooled)") == 1

    settings = load_settings(env)
    admin = AdminClient(client_config(broker.bootstrap, settings=settings))
    # librdkafka's error says only "transport failure"; the error callback names the cause.
    with pytest.raises(KafkaException, match="ransport"):
        admin.list_topics(timeout=3)
    admin.poll(0)  # serves the error callback, which names the cause
    from reef_stream.topics.connect import last_refusal
    refusal = last_refusal()
    assert refusal is not None and "refused to authenticate" in refusal
    assert WRONG_PASSWORD not in refusal


def test_an_untrusted_broker_certificate_is_refused(broker, namespace, tmp_path):
    other_ca, _ = _certificates(tmp_path / "other", "another")
    env = broker.env(namespace, tmp_path / "home", ca=other_ca)
    settings = load_settings(env)
    admin = AdminClient(client_config(broker.bootstrap, settings=settings))
    with pytest.raises(KafkaException, match="ransport"):
        admin.list_topics(timeout=3)
    admin.poll(0)
    from reef_stream.topics.connect import last_refusal
    refusal = last_refusal()
    assert refusal is not None and "TLS connection" in refusal, refusal
    assert "REEF_KAFKA_SSL_CA_LOCATION" in refusal


def test_a_plaintext_client_gets_nothing(broker):
    admin = AdminClient(client_config(broker.bootstrap, security=False))
    with pytest.raises(KafkaException, match="ransport|timed out"):
        admin.list_topics(timeout=3)


def _error_line(result: subprocess.CompletedProcess) -> str:
    """The one `error: ...` message the `reef` command ends with, unwrapped (not the log line
    the client's error callback printed before it)."""
    found = re.search(r"^error: .*", result.stderr, re.MULTILINE | re.DOTALL)
    assert found, result.stdout + result.stderr
    return " ".join(found.group(0).split())


@pytest.mark.parametrize("args", [
    ("lag",),
    ("lag", "--group", "trainers"),
    ("replay", "--group", "trainers", "--topic", "generations", "--to-earliest"),
    ("topics", "create"),
], ids=["lag", "lag-group", "replay", "topics-create"])
def test_a_wrong_password_on_the_admin_path_says_why(broker, namespace,
                                                                       tmp_path, args):
    env = broker.env(namespace, tmp_path / "home", password=WRONG_PASSWORD)
    started = time.monotonic()
    result = _reef(env, *args)
    elapsed = time.monotonic() - started
    error = _error_line(result)
    assert result.returncode == 2, (result.returncode, result.stderr)  # a configuration problem
    assert "refused to authenticate" in error, error
    assert f"SCRAM-SHA-256 as '{USER}'" in error and "REEF_KAFKA_SASL_PASSWORD" in error, error
    assert "transport failure" not in error.split("The client said:")[0], error
    assert WRONG_PASSWORD not in result.stdout + result.stderr
    # The refusal is reported within a second or so (2-4 s in all, on an idle machine); a
    # command that waited out a request's timeout would take 30 s or more.
    assert elapsed < 25, f"`reef {' '.join(args)}` took {elapsed:.1f} s to say why"
