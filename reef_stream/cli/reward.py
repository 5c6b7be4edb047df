"""``reef reward --recipe X``: run a recipe's reward function over generations as a consumer group.

    reef reward --recipe reef_stream.demo.recipes:sao --concurrency 16 --timeout 20 --retries 2
    python -m reef_stream.cli reward --recipe reef_stream.demo.recipes:sao   # without the reef script

The worker is ``reef_stream.consumers.reward.worker.RewardWorker``; this command
loads and checks the recipe, installs SIGTERM/SIGINT handlers that stop it
cleanly (a second signal stops without waiting for running calls), runs it and
prints its one-line summary on exit. Errors are ``reef_stream.core.errors``
exceptions, which the ``reef`` group turns into one-line messages. ``COMMANDS`` lists the command for
``main.add_command``. The recipe machinery is imported only when the command runs.
"""

from __future__ import annotations

import logging

import click

from reef_stream.cli.common import run_stage
from reef_stream.cli.metrics_port import metrics_port_option, serve_metrics
from reef_stream.cli.recipe_options import set_option


@click.command()
@click.option("--recipe", "path", required=True, metavar="MODULE[:ATTRIBUTE]",
              help="The recipe whose reward function runs: a dotted module path exposing "
                   "`recipe`, or module:attribute (reef_stream.demo.recipes:sao). It must have a "
                   "reward function.")
@set_option
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=8, show_default=True,
              help="Reward calls in flight at once (threads for a sync function, tasks on one "
                   "asyncio loop for an async one).")
@click.option("--backlog", type=click.IntRange(min=1), default=None,
              help="Generations taken and not yet settled at most (waiting for a call slot, "
                   "running, or waiting for the broker); beyond it the partitions pause "
                   "[default: 1024, or 2 x --concurrency if more].")
@click.option("--group", "-g", default=None,
              help="The consumer group; workers in one group share the partitions "
                   "[default: <namespace>.reward.<recipe name>].")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Seconds one try of the reward function may take.")
@click.option("--retries", type=click.IntRange(min=0), default=2, show_default=True,
              help="Tries after a failed one (raised or timed out), at most. A failure that "
                   "repeats the try before's (same error and message, or a second timeout) is "
                   "not tried again, unless the reward raised reef_stream.Transient (or a "
                   "ConnectionError). A generation whose every try failed goes to dead "
                   "letters, never to feedback.")
@click.option("--backoff", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="Seconds before the first retry; doubled before each further one (at most "
                   "30). A retry waits on a timer, not in a call slot.")
@click.option("--grace", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On stop, seconds running calls get to finish before their generations are "
                   "left uncommitted (the group reads them again).")
@click.option("--max-records", type=click.IntRange(min=1), default=None,
              help="Stop after taking this many generations (for tests and batch runs).")
@click.option("--idle-exit", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS",
              help="Stop after this many seconds without a new generation and nothing in flight "
                   "(at least 30 s while the worker holds no partition: a rebalance may be "
                   "under way) [default: run until stopped].")
@click.option("--slow-concurrency", type=click.IntRange(min=0), default=None,
              help="Slots of the slow lane, apart from the --concurrency fast ones: tries again "
                   "after a timeout, and calls that ran past the fast lane's deadline "
                   "[default: a quarter of --concurrency, at least 1; 0: no slow lane].")
@click.option("--adaptive-timeout/--fixed-timeout", default=True, show_default=True,
              help="Whether the fast lane follows the observed latency: a call past the p99 of "
                   "the calls that returned is replaced in the fast lane at once (it goes on), "
                   "and past 1.5 x that p99 (at least --fast-lane-floor) it moves to the slow "
                   "lane while it has room, else times out (docs/benchmarks.md, the sandbox).")
# default: reward_calls.ADAPT_FLOOR_S, not imported here (--help stays light; a test checks it)
@click.option("--fast-lane-floor", type=click.FloatRange(min=0, min_open=True), default=0.1,
              show_default=True, metavar="SECONDS",
              help="The shortest time a fast-lane call runs before it moves to the slow lane "
                   "(raise it for a reward whose healthy calls are often far slower than most).")
@click.option("--sandbox", type=click.Choice(["thread", "process"]), default="thread",
              show_default=True,
              help="Where the reward function runs: on a thread of the worker, or in a pool of "
                   "sandbox processes (killed at the timeout; CPU, memory, file size, open "
                   "files and process limits; a fresh directory per call; no network where "
                   "the kernel allows it). A sandbox failure is a dead letter with its "
                   "category (error type sandbox.<category>), never a reward.")
@click.option("--sandbox-workers", type=click.IntRange(min=1), default=None,
              help="Sandbox worker processes [default: every lane's slots + 2].")
@click.option("--sandbox-cpu", type=click.IntRange(min=1), default=10, show_default=True,
              metavar="SECONDS", help="CPU seconds of one sandboxed call.")
@click.option("--sandbox-memory", type=click.IntRange(min=1), default=1024, show_default=True,
              metavar="MB", help="Address space of one sandboxed call, beyond the worker's.")
@click.option("--sandbox-file-size", type=click.IntRange(min=1), default=64, show_default=True,
              metavar="MB", help="The largest file one sandboxed call may write.")
@click.option("--sandbox-open-files", type=click.IntRange(min=1), default=256,
              show_default=True, help="Open files of one sandboxed call.")
@click.option("--sandbox-processes", type=click.IntRange(min=1), default=64, show_default=True,
              help="Processes one sandboxed call may run (its user's; docs/security.md).")
@click.option("--circuit/--no-circuit", default=True, show_default=True,
              help="Whether an outage holds the generations: when 4 in 5 of the last 50 "
                   "generations' first tries failed, no new generation is taken (the lag "
                   "grows), failing ones are held, not dead-lettered, and one is tried again "
                   "each second; the first success resumes (docs/stages.md).")
@click.option("--abandoned-limit", type=click.IntRange(min=1), default=4096, show_default=True,
              help="In-thread calls that timed out and still run, at most (a sync call cannot "
                   "be stopped; each costs a thread, about 16 KiB): at the limit no new call "
                   "starts until one returns. --sandbox process kills a hung call instead.")
@metrics_port_option
@click.option("--faults", default=None, metavar="SPEC",
              help="Inject reward faults, for tests and benches: comma-separated, each "
                   "optional: raise=P (that share of the generations raises on every try), "
                   "hang=P (sleeps hang_s=S seconds, default 300, then scores), "
                   "outage=START:SECONDS (every call raises Transient from START to "
                   "START+SECONDS seconds after this command starts; outage_at=T:SECONDS with "
                   "T a unix time). Which generations fail is fixed by their ids, the same in "
                   "every process and run. Works with either --sandbox.")
@click.pass_context
def reward(ctx: click.Context, path: str, concurrency: int, backlog: int | None,
           group: str | None, timeout: float, retries: int, backoff: float, grace: float,
           max_records: int | None, idle_exit: float | None, slow_concurrency: int | None,
           adaptive_timeout: bool, fast_lane_floor: float, sandbox: str,
           sandbox_workers: int | None, sandbox_cpu: int,
           sandbox_memory: int, sandbox_file_size: int, sandbox_open_files: int,
           sandbox_processes: int, circuit: bool, abandoned_limit: int,
           metrics_port: int | None,
           overrides: tuple[str, ...] = (), faults: str | None = None) -> None:
    """Score generations with a recipe's reward function and emit Feedback.

    Consumes <namespace>.generations as a consumer group and sends one
    Feedback per generation to <namespace>.feedback, keyed like the
    generation. A call that raises or times out on every try, or returns no
    finite reward, becomes a dead letter (stage "reward") with the reason, the
    number of tries and the original record; it is never scored 0. Offsets
    are committed only past generations whose outcome the broker acknowledged,
    so a killed worker re-reads at most its uncommitted tail (duplicate
    feedback has the same id; the processor drops it).

    A try that timed out is tried again only in the slow lane (--slow-concurrency
    slots of its own), never in the fast one; a fast-lane call past the observed
    p99 is replaced in the fast lane, and past 1.5 x the p99 moves to the slow lane
    (--adaptive-timeout), so a few hanging calls cannot fill the fast lane. A
    retry waits out its backoff on a timer, holding no slot. When most calls fail
    (the grading service is down) the circuit opens: the worker pauses and probes,
    and the outage's generations are scored once it is back (--circuit). With
    --sandbox process each call runs in a pre-started sandbox process and is
    killed (its whole process group) at --timeout; the start-up log says whether
    the calls' network is isolated.

    Stops on SIGTERM or Ctrl-C (running calls finish, up to --grace), on
    --max-records or --idle-exit, and prints a one-line summary: records,
    rewarded, failed, invalid, undecodable, retried, timed_out, dropped. The
    same counters go to <namespace>.metrics (stage "reward", at most once a
    second and at stop) and, with --metrics-port, to Prometheus.
    """
    from reef_stream.api.recipe import load_recipe
    from reef_stream.consumers.reward.sandbox.categories import Limits
    from reef_stream.consumers.reward.worker import RewardOptions, RewardWorker
    from reef_stream.core.settings import load_settings
    from reef_stream.demo import reward_faults

    logging.getLogger("reef_stream.consumers.reward").setLevel(logging.INFO)  # progress
    settings = ctx.obj if ctx.obj is not None else load_settings()
    recipe = load_recipe(path, overrides=overrides)
    options = RewardOptions(concurrency=concurrency, backlog=backlog, timeout=timeout,
                            retries=retries, backoff=backoff, grace=grace, group=group,
                            max_records=max_records, idle_exit=idle_exit,
                            slow_concurrency=slow_concurrency, adaptive=adaptive_timeout,
                            fast_lane_floor=fast_lane_floor, circuit=circuit,
                            abandoned_limit=abandoned_limit, sandbox=sandbox, sandbox_target=path,
                            sandbox_overrides=tuple(overrides), sandbox_size=sandbox_workers,
                            sandbox_limits=Limits(cpu_s=sandbox_cpu, memory_mb=sandbox_memory,
                                                  file_mb=sandbox_file_size,
                                                  open_files=sandbox_open_files,
                                                  processes=sandbox_processes))
    recipe, options = reward_faults.applied(faults, recipe, options, path, tuple(overrides))
    worker = RewardWorker(recipe, settings=settings, options=options)
    serve_metrics(metrics_port)
    # SIGTERM/SIGINT stop the worker cleanly; a second one stops it without the grace period.
    run_stage(worker, stop=lambda: worker.stop(now=worker.stopping))


COMMANDS = [reward]
