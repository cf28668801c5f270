"""The interpret tier: Pallas TPU calls run on CPU, fast or under the strict TPU simulator.

``interpret("fast")`` runs every Pallas call as an XLA loop on CPU (about XLA speed, for broad
sweeps); ``interpret("strict")`` runs the TPU simulator: uninitialised memory reads as NaN,
out-of-bounds reads raise, and races are detected.
"""

from __future__ import annotations

import contextlib
from typing import Any

from jax.experimental.pallas import tpu as pltpu


def strict_params(*, detect_races: bool = True) -> pltpu.InterpretParams:
    return pltpu.InterpretParams(
        out_of_bounds_reads="raise", uninitialized_memory="nan", detect_races=detect_races
    )


@contextlib.contextmanager
def interpret(mode: str = "fast", *, detect_races: bool = True):
    """Run every Pallas TPU call traced inside in interpret mode ("fast" or "strict").

    Torch ops from our kernels honour this too: the bridge only forces the fast mode when no
    mode has been chosen. Races found in strict mode fail on exit.
    """
    if mode == "fast":
        params: Any = True
    elif mode == "strict":
        params = strict_params(detect_races=detect_races)
        pltpu.reset_tpu_interpret_mode_state()
    else:
        raise ValueError(f"interpret mode must be 'fast' or 'strict', got {mode!r}")
    with pltpu.force_tpu_interpret_mode(params):
        yield
    if mode == "strict" and detect_races:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

        if ipc.races is not None and ipc.races.races_found:
            raise AssertionError("the strict TPU interpreter detected a data race")


