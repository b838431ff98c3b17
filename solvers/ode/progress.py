"""Progress output of a long solve (`odeint(progress=True)`): a line every
`PROGRESS_EVERY` loop iterations, and one when it is done."""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["PROGRESS_EVERY", "report", "report_done"]

PROGRESS_EVERY = 200


def _print_progress(t, t0, t_end, steps):
    t, t0, t_end, steps = (np.asarray(v) for v in (t, t0, t_end, steps))
    frac = np.clip(np.min((t - t0) / (t_end - t0)), 0, 1)
    print(
        f"\rodeint: t = {np.min(t):.6g} / {np.max(t_end):.6g}  "
        f"({100 * frac:5.1f}%, {int(np.max(steps))} steps)",
        end="",
        flush=True,
    )


def report(state, t0, t_end):
    """Print the time reached every `PROGRESS_EVERY` attempts (`state`: a `StepState`)."""
    n = state.acc + state.rej
    jax.lax.cond(
        n % PROGRESS_EVERY == 0,
        lambda: jax.debug.callback(_print_progress, state.t, t0, t_end, state.acc),
        lambda: None,
    )


def _print_done(t, steps, status):
    print(
        f"\rodeint: done at t = {np.max(np.asarray(t)):.6g} after "
        f"{int(np.max(np.asarray(steps)))} steps (status {int(np.max(np.asarray(status)))})"
    )


def report_done(state):
    jax.debug.callback(_print_done, state.t, state.acc, state.status)
