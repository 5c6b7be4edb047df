"""A processor's process runs with the collector thresholds ``GC_THRESHOLDS`` (its state's
live objects made the default's full collections 17% of its Python work per generation)."""

from __future__ import annotations

import gc

from reef_stream.consumers.processor.runtime import GC_THRESHOLDS, tune_collector


def test_tune_collector_sets_the_thresholds_a_processor_runs_with():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        tune_collector()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert GC_THRESHOLDS[0] > 700  # fewer young collections than the default
    finally:
        gc.set_threshold(*before)
