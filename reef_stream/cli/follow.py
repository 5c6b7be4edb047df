"""``reef follow --model M``: a replica following a model's publications, reporting what it loads.

    reef follow --model sao-small                       # until SIGTERM / Ctrl-C
    reef follow --model sao-small --once                # load the newest promoted version, exit
    reef follow --model sao-small --until-version 12 --timeout 600
    reef follow --model llm --engine vllm --url http://127.0.0.1:18000
    reef follow --model llm --engine command --exec 'my-reload --dir {path} --version {version}'
    reef follow --model llm --engine vllm --url http://127.0.0.1:18000 \
        --version-file /run/reef/served-version     # for `reef intake proxy --version-file`

It runs ``reef_stream.serving.follower.Follower`` with a callback that only
reports each verified version (tensor count and size); serving code uses the
Python API and swaps the weights into its model instead. With ``--engine`` the
follower loads serving artifacts (a Hugging Face model's, written by the
evaluator) and an engine adapter (``reef_stream.serving.adapters``) makes a
running engine serve each one. While it runs, the
replica heartbeats into the Redis fleet projection (when Redis is
configured) and into ``<ns>.metrics``, so ``reef fleet`` lists it.
``COMMANDS`` lists the command for ``main.add_command``.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from reef_stream.cli.common import stop_on_signals
from reef_stream.cli.metrics_port import metrics_port_option, serve_metrics


@click.command()
@click.option("--model", "-m", required=True, help="The model whose promoted versions to follow.")
@click.option("--replica-id", default=None,
              help="This replica's name in the fleet [default: <host>-<pid>-<random>].")
@click.option("--once", is_flag=True,
              help="Read the publications, load the newest promoted version, report it and exit "
                   "(status 1 if it was refused or nothing is published).")
@click.option("--until-version", type=click.IntRange(min=0), default=None, metavar="VERSION",
              help="Exit once this version (or a newer one) is loaded.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS", help="Give up after this long (status 1) [default: no limit].")
@click.option("--heartbeat", type=click.FloatRange(min=0, min_open=True), default=5.0,
              show_default=True, metavar="SECONDS",
              help="Seconds between two heartbeats to the fleet projection.")
@click.option("--retry", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, metavar="SECONDS",
              help="Seconds between two tries of a refused version that is still the newest.")
@click.option("--engine", type=click.Choice(["none", "vllm", "command"]), default="none",
              show_default=True,
              help="Make a running inference engine serve each version's serving artifact: "
                   "vllm (a vLLM server at --url: `reef engine up vllm`), or command (any "
                   "engine, through --exec). none: only verify and report the weights.")
@click.option("--url", default=None, metavar="URL",
              help="With --engine vllm: the server's base URL, e.g. http://127.0.0.1:18000.")
@click.option("--exec", "command", default=None, metavar="COMMAND",
              help="With --engine command: the command run for each version, split as a shell "
                   "would (no shell runs it); {path}, {version} and {kind} are replaced by the "
                   "artifact directory, the version and full|lora. Exit status 0: served.")
@click.option("--lora-name", default="reef-lora", show_default=True,
              help="With --engine vllm and LoRA artifacts: the adapter name requests use.")
@click.option("--canary-slot", type=click.FloatRange(0, 1, max_open=True), default=None,
              metavar="SLOT",
              help="This replica's place in [0, 1) for canary cohorts: a canary of share s "
                   "is taken by the replicas whose slot falls in an arc of length s that each "
                   "version places anew (replica i of n at i/n: each canary takes an exact "
                   "share) [default: $REEF_CANARY_SLOT, else derived from the replica id].")
@click.option("--version-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="PATH",
              help="Keep PATH naming the version the engine serves (JSON, replaced atomically), "
                   "for `reef intake proxy --version-file PATH`: 'reloading' (no "
                   "version) from before each load until the engine serves the new one.")
@metrics_port_option
@click.pass_context
def follow(ctx: click.Context, model: str, replica_id: str | None, once: bool,
           until_version: int | None, timeout: float | None, heartbeat: float,
           retry: float, engine: str, url: str | None, command: str | None, lora_name: str,
           canary_slot: float | None, version_file: Path | None,
           metrics_port: int | None) -> None:
    """Follow a model's publications: load and verify the newest promoted version.

    Reads <namespace>.publications from the start, loads the newest PROMOTED
    version of the model (never a rejected one, never an older one: a
    replica started late goes straight to the newest) and verifies its files
    against the published sha256 before reporting it as loaded. A checksum
    mismatch or an unreadable checkpoint is refused with an error naming the
    cause, and the previous version keeps serving. Each load prints one
    line: the version, its checkpoint, evaluator and size.

    The replica heartbeats replica -> version, host, last seen into Redis
    (REEF_REDIS_URL or `reef redis up`; expiring entries) and into
    <namespace>.metrics; `reef fleet` shows it. Stops on SIGTERM or Ctrl-C,
    --once, --until-version or --timeout.

    With --engine, each version's serving artifact (written by the evaluator
    for a Hugging Face model: the weights in the serving dtype, or a LoRA
    adapter) is verified against its sha256 and loaded into the engine; a
    version the engine does not load is refused and the engine keeps serving
    the previous one. A version published without an artifact is refused.

    With --version-file, PATH says which version is served (docs/proxy.md):
    a recording proxy in front of the engine stamps what it records with it.
    """
    from reef_stream.core.settings import load_settings
    from reef_stream.serving.follower import ARTIFACT, WEIGHTS, Follower

    settings = ctx.obj if ctx.obj is not None else load_settings()
    adapter = _adapter(engine, url, command, lora_name)

    def report(loaded) -> None:
        publication = loaded.publication
        evaluated = "" if publication.evaluated else ", UNEVALUATED"
        if adapter is not None:
            adapter(loaded)
            click.echo(f"model {model}: {engine} serves version {loaded.policy_version} "
                       f"({publication.artifact_kind} artifact {loaded.artifact}, reloaded in "
                       f"{adapter.last.seconds:.2f} s, evaluator {publication.evaluator}"
                       f"{evaluated})")
            return
        size = sum(t.numel() * t.element_size() for t in loaded.weights.values())
        click.echo(f"model {model}: loaded version {loaded.policy_version} (checkpoint "
                   f"{publication.checkpoint_id}, {len(loaded.weights)} tensors, "
                   f"{size / 1e6:.2f} MB, evaluator {publication.evaluator}{evaluated})")

    # Refusals are logged as errors by the follower itself (the version, the cause, and what
    # keeps serving).
    follower = Follower(model, on_version=report, settings=settings, replica_id=replica_id,
                        heartbeat_s=heartbeat, retry_s=retry,
                        loads=WEIGHTS if adapter is None else ARTIFACT, canary_slot=canary_slot,
                        version_file=version_file)
    click.echo(f"replica {follower.replica_id} following {model} in "
               f"{follower.namespace}.publications")
    serve_metrics(metrics_port)
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    # SIGTERM/SIGINT stop the follower (after a load in progress).
    with stop_on_signals(lambda: follower.stop(timeout=0)):
        try:
            follower.start()
            version = follower.wait_ready(_left(deadline))
            if once:
                code = 0 if version is not None and not follower.refused else 1
                if version is None and not follower.refused:
                    click.echo(f"no promoted version of {model} is published yet", err=True)
            elif until_version is not None:
                follower.wait_for_version(until_version, _left(deadline))
            else:
                while follower.error is None and not follower.stopping:
                    if deadline is not None and time.monotonic() > deadline:
                        code = 1
                        break
                    time.sleep(0.2)
        except TimeoutError as error:
            click.secho(f"error: {error}", fg="red", err=True)
            code = 1
        finally:
            follower.stop()
    if follower.error is not None:
        raise follower.error
    version = follower.policy_version
    click.echo(f"replica {follower.replica_id}: serving "
               f"{'nothing' if version is None else f'version {version}'} of {model}")
    ctx.exit(code)


def _adapter(engine: str, url: str | None, command: str | None, lora_name: str):
    """The engine adapter the options ask for (None for ``none``); a usage error names what is
    missing or superfluous."""
    from reef_stream.serving.adapters import CommandEngine, VllmEngine

    if engine != "vllm" and url is not None:
        raise click.UsageError("--url goes with --engine vllm")
    if engine != "command" and command is not None:
        raise click.UsageError("--exec goes with --engine command")
    if engine == "vllm":
        if url is None:
            raise click.UsageError("--engine vllm needs --url (the server's base URL; "
                                   "`reef engine up vllm` prints it)")
        return VllmEngine(url, lora_name=lora_name)
    if engine == "command":
        if not command:
            raise click.UsageError("--engine command needs --exec COMMAND")
        return CommandEngine(command)
    return None


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


COMMANDS = [follow]


if __name__ == "__main__":
    from reef_stream.cli.common import run_standalone

    run_standalone(follow, "reef follow", "reef_stream.serving.follower")
