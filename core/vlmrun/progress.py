"""Progress for long steps (export, compile, model build): a spinner on a terminal, plain lines otherwise."""

from __future__ import annotations

import contextlib
import sys
import time


def no_progress(label: str):
    """A progress callback that shows nothing (the API's default)."""
    return contextlib.nullcontext()


@contextlib.contextmanager
def step(label: str):
    """Show ``label`` while the block runs, then how long it took. Writes to stderr only."""
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    t0 = time.perf_counter()
    if console.is_terminal:
        with console.status(f"{label} ..."):
            yield
    else:
        print(f"{label} ...", file=sys.stderr, flush=True)
        yield
    console.print(f"[green]done[/green] {label} ({time.perf_counter() - t0:.1f} s)")
