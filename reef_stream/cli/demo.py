"""``reef demo``: the project's main job (``reef_stream.demo.run``).

    reef demo                                   SAO on the toy task, until 0.9 held-out accuracy
    reef demo --recipe methods.grpo --chaos     GRPO, with the trainer and processor SIGKILLed
    reef demo --engine vllm                     a Hugging Face policy served by a real vLLM
    reef demo --engine vllm --via-proxy         ... recorded by `reef intake proxy` in front of it
    reef demo --task tool                       multi-turn: a tool call, its output, the answer

Brings up the local broker and Redis if they are not running (or uses
REEF_BOOTSTRAP_SERVERS / REEF_REDIS_URL), then runs every stage as a separate
process and shows live progress. ``COMMANDS`` lists the command for
``main.add_command``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from reef_stream.cli.recipe_options import set_option


@click.command()
@click.option("--recipe", "path", default="methods.sao", show_default=True,
              metavar="MODULE[:ATTRIBUTE]",
              help="The method to run, bound to the demo task (reef_stream.demo.recipes): "
                   "methods.sao (ungrouped) or methods.grpo (grouped); or any bound recipe.")
@set_option
@click.option("--engine", type=click.Choice(["toy", "vllm"]), default="toy", show_default=True,
              help="What serves the policy: the toy transformer in the project's replica "
                   "processes, or a tiny Qwen2-style Hugging Face model (built once under "
                   "$REEF_HOME/models) served by a real vLLM server that the demo starts (its "
                   "environment installed once if missing) and stops, reloaded with every "
                   "promoted version by the one replica process that samples it.")
@click.option("--via-proxy", is_flag=True,
              help="With --engine vllm: the replica's requests go through a recording proxy "
                   "(reef intake proxy) in front of the vLLM server, which records them as "
                   "generations, stamped with the version the replica's follower writes to "
                   "its --version-file; the replica produces nothing (docs/proxy.md).")
@click.option("--task", type=click.Choice(["arithmetic", "tool"]), default="arithmetic",
              show_default=True,
              help="The toy task: one-token answers to a+b=, or a multi-turn one (the policy "
                   "calls a tool, add, gets its output as environment tokens, which are never "
                   "trained, then answers; reef_stream.demo.tool_task). With the toy engine.")
@click.option("--replicas", type=click.IntRange(1, 8), default=None,
              help="Serving replicas sampling from the newest promoted version [default: 2; "
                   "with --engine vllm 1, the only choice: one process drives the server's "
                   "reloads and orders its requests against them].")
@click.option("--rate", type=click.FloatRange(min=1), default=None,
              metavar="PER_SECOND", help="Generations per second per replica (2 x 400 is a little "
                                         "more than the trainer trains on two cores: the "
                                         "recipe's max_backlog_steps sheds the surplus) "
                                         "[default: 400; with --engine vllm or --sandbox "
                                         "process 100].")
@click.option("--partitions", type=click.IntRange(1, 64), default=2, show_default=True,
              help="Partitions of the run's generations, feedback and units topics (one "
                   "processor and one trainer need no more; each partition a replica spreads "
                   "its records over costs the broker a produce request per batch).")
@click.option("--target-accuracy", "target", type=click.FloatRange(0, 1), default=0.9,
              show_default=True, help="Stop once a promoted version reaches this held-out "
                                      "accuracy (greedy decoding).")
@click.option("--time-limit", type=click.FloatRange(min=10), default=900.0, show_default=True,
              metavar="SECONDS", help="Give up (exit status 1) after this long.")
@click.option("--chaos", is_flag=True,
              help="SIGKILL the trainer or the processor every 8-20 s and restart it; the run "
                   "must still converge and its unit ledger show nothing lost or trained twice.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where logs, checkpoints and report.html go "
                   "[default: $REEF_HOME/demo/<namespace>].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the chaos.")
@click.option("--canary", type=click.FloatRange(0, 1, min_open=True), default=None,
              metavar="SHARE",
              help="Canary publication: each version the evaluator promotes is first served by "
                   "this share of the replicas (replica i of n has the canary slot i/n), and "
                   "live feedback promotes or rolls it back (reef evaluate --canary-share); "
                   "report.html plots the online reward of canary vs incumbent per decision.")
@click.option("--sandbox", type=click.Choice(["thread", "process"]), default="thread",
              show_default=True,
              help="Where the reward worker runs the reward function: on a thread, or in a pool "
                   "of sandbox processes (reef reward --sandbox process).")
@click.option("--reward-faults", default=None, metavar="SPEC",
              help="Faults injected into the reward function (reef reward --faults): "
                   "raise=P,hang=P,hang_s=S,outage=START:SECONDS, every part optional; the "
                   "outage's START counts from the demo's start. Which generations fail is "
                   "fixed by their ids (e.g. raise=0.05,hang=0.01,hang_s=300).")
@click.option("--device-model", default=None, metavar="gen_ms=G,train_ms=T[,batch=B]",
              help="Model accelerators as wall-clock waits off the CPU: a batch of up to B "
                   "completions costs G ms of its replica's device, a trained sample T ms of "
                   "the trainer's, the toy's own sampling and training counted toward them "
                   "(reef_stream.demo.devices; default B 32). Changes no computation. "
                   "[default: none]")
@click.pass_context
def demo(ctx: click.Context, path: str, engine: str, replicas: int | None, rate: float | None,
         partitions: int, target: float, time_limit: float, chaos: bool, run_dir: Path | None,
         seed: int, overrides: tuple[str, ...] = (), task: str = "arithmetic",
         canary: float | None = None, sandbox: str = "thread",
         reward_faults: str | None = None, device_model: str | None = None,
         via_proxy: bool = False) -> None:
    """Run the whole loop until the policy learns the toy task from reward alone.

    Replicas sample answers to "a+b=" (the last digit of the sum) from the
    newest promoted version and emit generations through the SDK; a reward
    worker scores them by exact match; the processor builds units; the
    trainer trains; the evaluator measures held-out accuracy and promotes a
    checkpoint only if it does not regress. Each is a separate process; the
    replicas start once the others run, as traffic meets a running pipeline.
    Progress shows the published version, its held-out accuracy, the reward,
    the trainer's steps, rejected candidates, the mean staleness of the last
    step's samples (trainer version - behaviour version), the rates and, with
    --chaos, the kills; and says "stalled" when the trainer ran so far past the
    served version that no new generation can train, and "overloaded" when units
    arrive faster than the trainer trains them (what it trains is then nearly too
    stale: lower --rate). At the end report.html (accuracy
    per published version, reward over time, staleness, throughput) is
    written and its path printed; the unit ledger must show no unit lost or
    trained twice. Last comes the run's scorecard (time to target, samples
    generated / trained / shed / dead-lettered, goodput, staleness,
    checkpoint-to-serving latency, CPU seconds per stage; also in report.html).

    With --engine vllm the policy is a tiny Qwen2-style Hugging Face model
    (built once under $REEF_HOME/models) trained by the Hugging Face backend and
    served by a real vLLM server that the demo starts (installing its
    environment once, if missing) and stops at the end; one replica process
    samples it through the OpenAI-compatible API with token ids and logprobs
    and reloads it with every promoted version's serving artifact. With
    --via-proxy those requests go through `reef intake proxy` in front of the
    server, and the proxy, not the replica, records each completion: the path of
    a fleet that cannot change its code (docs/proxy.md).
    """
    from reef_stream.cli.servers import kafka_up, redis_up
    from reef_stream.core.processes import interrupt_on_sigterm
    from reef_stream.core.settings import load_settings
    from reef_stream.demo.run import DEFAULT_RATE, Demo, DemoOptions
    from reef_stream.topics.connect import bootstrap_servers, redis_url

    if task == "tool" and engine != "toy":
        raise click.UsageError("--task tool runs on the toy engine: leave --engine out")
    if via_proxy and engine != "vllm":
        raise click.UsageError("--via-proxy puts the recording proxy in front of the vLLM "
                               "server: give --engine vllm")
    if engine == "vllm" and replicas not in (None, 1):
        raise click.UsageError("--engine vllm runs one replica process (it drives the one vLLM "
                               "server's reloads and orders its requests against them): leave "
                               "--replicas out or give 1")
    replicas = replicas or (1 if engine == "vllm" else 2)
    rate = rate or (VLLM_RATE if engine == "vllm" else SANDBOX_RATE if sandbox == "process"
                    else DEFAULT_RATE)
    settings = load_settings()
    if not settings.bootstrap_servers:
        ctx.invoke(kafka_up)
    if not settings.redis_url:
        ctx.invoke(redis_up)
    options = DemoOptions(recipe=path, replicas=replicas, rate=rate, partitions=partitions,
                          target=target, time_limit=time_limit, chaos=chaos, run_dir=run_dir,
                          seed=seed, overrides=overrides, engine=engine, task=task,
                          canary=canary, sandbox=sandbox, reward_faults=reward_faults,
                          device_model=device_model, via_proxy=via_proxy)
    runner = Demo(options, settings=settings, bootstrap=bootstrap_servers(settings),
                  redis_url=redis_url(settings), show=DemoProgress())
    click.echo(f"demo {runner.ns}: {path}, {replicas} replicas"
               + (" on vLLM" if engine == "vllm" else "")
               + (" through the recording proxy" if via_proxy else "")
               + (", the tool task" if task == "tool" else "")
               + (f", canary share {canary:g}" if canary else "")
               + (", rewards in sandbox processes" if sandbox == "process" else "")
               + (f", reward faults {reward_faults}" if reward_faults else "")
               + (f", device model {device_model}" if device_model else "")
               + f", target {target:.2f}, logs in {runner.run_dir / 'logs'}")
    interrupt_on_sigterm()    # SIGTERM stops the stages (and nothing else) as Ctrl-C does
    result = runner.run()
    click.echo(result.line())
    if result.scorecard is not None:
        click.echo("\n".join(result.scorecard.lines()))
    if not (settings.bootstrap_servers and settings.redis_url):
        click.echo("the local broker and Redis keep running (their data too): "
                   "`reef kafka down` and `reef redis down` stop them")
    if result.ledger.get("trained_twice") or result.ledger.get("lost"):
        raise click.ClickException(f"the unit ledger is wrong: {result.ledger}")
    if not result.reached:
        sys.exit(1)


#: Generations per second of the vLLM replica by default (``--engine vllm``): the trainer takes
#: nearly every generation, and most samples are of the trainer's own version, so the
#: same-version logprob gap is measured (figures: ``docs/history.md``, "The demo's rates").
VLLM_RATE = 100.0
#: Generations per second per replica by default with ``--sandbox process``, which two idle
#: cores can score (a sandboxed call forks; figures: ``docs/history.md``, "The demo's rates").
SANDBOX_RATE = 100.0


class DemoProgress:
    """One status line every few seconds (a terminal sees it rewritten in place)."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s, self.last = every_s, 0.0
        self.tty = sys.stdout.isatty()

    def __call__(self, status: dict[str, Any]) -> None:
        if "line" in status:   # a progress line (the vLLM engine's install and start)
            click.echo(("\n" if self.tty else "") + status["line"])
            return
        if not self.tty and time.monotonic() - self.last < self.every_s:
            return
        self.last = time.monotonic()
        accuracy = status["accuracy"]
        reward = status["reward"]
        staleness = status.get("staleness")
        rates = status["rates"]
        line = (f"{status['elapsed']:6.0f} s  version {status['version'] or '-':>4}  "
                f"accuracy {'-' if accuracy is None else f'{accuracy:.3f}':>5}  "
                f"reward {'-' if reward is None else f'{reward:.2f}':>5}  "
                f"steps {status['steps']:>4}  rejected {status['rejected']:>3}  "
                f"staleness {'-' if staleness is None else f'{staleness:.1f}':>4}  "
                f"gen/s {rates.get('generations', 0):6.0f}  units/s {rates.get('units', 0):5.0f}"
                + (f"  kills {status['kills']}" if status["kills"] else "")
                + ("" if status.get("saturated") is None
                   else f"  reward slots past p99 {status['saturated']:.0f}")
                + (f"\n  {status['stalled']}" if status.get("stalled") else "")
                + (f"\n  {status['overloaded']}" if status.get("overloaded") else ""))
        if self.tty:
            click.echo("\r" + line, nl=False)
        else:
            click.echo(line)


COMMANDS = [demo]
