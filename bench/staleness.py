"""What staleness alone costs in samples, per off-policy correction: the synchronous loop,
sampling from weights a few steps old.

    python bench/staleness.py [--lags 0,1,2,4] [--seeds 5] [--target 0.5] [--only sao,grpo,...]
                              [--set backend.optimizer.lr=2e-3 ...]

A live loop's samples come from a version behind its trainer (the demo's staleness mean is
1.5 to 1.7), and ``bench/loop.py``'s ``samples_ratio`` compares its samples to the target
with the synchronous loop's. That ratio mixes what staleness costs with everything else of a
live run (the evaluator's cadence, the backlog's shedding, timing). Here the synchronous loop
(``reef_stream.demo.sync``, ``lag``) samples every step from the weights of ``lag`` steps
before, stamped with that version, and nothing else changes: the samples to the target, per
recipe variant and lag, median over ``--seeds`` seeds (0 to N-1), and their ratio to the same
variant at lag 0. One seed's samples to the target vary by more than two to one, hence the
medians. The variants, the corrections of issue 29 (``docs/design-notes.md``, "Off-policy
corrections"):

- ``sao``: the demo's SAO (its loss's truncated importance weight, at 1);
- ``grpo``: the demo's GRPO (PPO's clip at 0.2 against the behaviour policy);
- ``grpo-rloo``: GRPO with RLOO advantages;
- ``grpo-proximal``: GRPO with the decoupled proximal policy, its behaviour weight truncated
  at 2 per token (verl's default rollout correction);
- ``grpo-proximal-mask``: the same, tokens beyond 5 masked (AReaL's filter);
- ``grpo-proximal-seq``: the same as ``grpo-proximal`` with one weight per sequence.

It ends with one line per variant:

    STALENESS variant=NAME target=X seeds=N lag0=SAMPLES lag2=SAMPLES ... ratio_lag2=X ...

Figures, never assertions. Pure CPU (no broker), one torch thread, minutes.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable

from common import chosen, figure, run, say  # first: it puts the project on sys.path

from reef_stream.api.losses import ClippedPolicyGradient
from reef_stream.api.recipe import Recipe, apply_overrides, load_recipe
from reef_stream.api.variants import (
    AdvantageNormalisation, BehaviourWeightLevel, BehaviourWeightMode, DecoupledProximal,
)
from reef_stream.demo.recipes import bind, method
from reef_stream.demo.sync import run_synchronous


def _grpo(**options) -> Recipe:
    """The demo's GRPO built with ``options`` (the factory checks them)."""
    return bind(functools.partial(method("grpo").recipe, **options))


#: The variants, by name: each builds its bound recipe.
VARIANTS: dict[str, Callable[[], Recipe]] = {
    "sao": lambda: load_recipe("reef_stream.demo.recipes:sao", complete=True),
    "grpo": lambda: load_recipe("reef_stream.demo.recipes:grpo", complete=True),
    "grpo-rloo": lambda: _grpo(normalisation=AdvantageNormalisation.RLOO),
    "grpo-proximal": lambda: _grpo(loss=ClippedPolicyGradient(
        epsilon=0.2, proximal=DecoupledProximal())),
    "grpo-proximal-mask": lambda: _grpo(loss=ClippedPolicyGradient(
        epsilon=0.2, proximal=DecoupledProximal(weight_cap=5.0,
                                                weight_mode=BehaviourWeightMode.MASK))),
    "grpo-proximal-seq": lambda: _grpo(loss=ClippedPolicyGradient(
        epsilon=0.2, proximal=DecoupledProximal(weight_level=BehaviourWeightLevel.SEQUENCE))),
}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python bench/staleness.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lags", default="0,2,4",
                        help="comma-separated lags in steps, 0 first (default 0,2,4)")
    parser.add_argument("--seeds", type=int, default=5,
                        help="seeds per variant and lag, 0 to N-1 (default 5)")
    parser.add_argument("--target", type=float, default=0.5,
                        help="the held-out accuracy to reach (default 0.5)")
    parser.add_argument("--max-steps", type=int, default=400,
                        help="a run that has not reached the target by then stops and counts "
                             "its samples so far (default 400)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="FIELD=VALUE",
                        help="override a field of every variant's recipe, as reef's --set does "
                             "(e.g. --set backend.optimizer.lr=2e-3); repeatable")
    args, variants = chosen(parser, list(VARIANTS), "variants")
    lags = sorted({int(lag) for lag in args.lags.split(",") if lag.strip()})
    if not lags or lags[0] < 0:
        parser.error("--lags must name lags of 0 or more")
    if 0 not in lags:
        lags.insert(0, 0)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")

    lines = []
    for name in variants:
        recipe = apply_overrides(VARIANTS[name](), args.overrides)
        samples: dict[int, float] = {}
        for lag in lags:
            counts, steps, unreached = [], [], 0
            for seed in range(args.seeds):
                result = run_synchronous(recipe, target=args.target, time_limit=float("inf"),
                                         seed=seed, lag=lag, threads=1,
                                         max_steps=args.max_steps)
                counts.append(result.samples)
                steps.append(result.steps)
                unreached += not result.reached
            samples[lag] = statistics.median(counts)
            say(f"{name} lag {lag}: steps to {args.target:g} per seed {steps}"
                + (f" ({unreached} not reached in {args.max_steps})" if unreached else "")
                + f"; median {samples[lag]:g} samples, "
                  f"{samples[lag] / samples[0]:.2f} x lag 0")
        lines.append(f"STALENESS variant={name} target={args.target:g} seeds={args.seeds} "
                     + "".join(f"set={item} " for item in args.overrides)
                     + " ".join(f"lag{lag}={samples[lag]:g}" for lag in lags) + " "
                     + " ".join(f"ratio_lag{lag}={figure(samples[lag] / samples[0])}"
                                for lag in lags if lag))
    print()
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    run(main)
