"""Calibrating the parts decoder in sequence: one part's float graph in memory at a time.

Whole-at-once calibration (`.calibration.parts_calibration_feeds` with order ``whole``) opens every part's float
graph of a graph set and runs the host loop call by call through all of them: its memory is the whole decoder in
float32 (about 30 GB at FastVLM-7B). In sequence, each calibration prompt runs its own host loop
(`.genie_engine.GenieLayoutDecoder`) in a thread whose graph (`_Lane`) hands every call to a scheduler and waits.
The scheduler works in rounds: once every prompt's loop waits on a call or has ended, part 1's float graph is opened
and runs every waiting call, then part 2 on part 1's outputs, and so on; the last part's outputs (the logits a
greedy step needs) go back to the loops. Graphs opened: parts x rounds (a round per call of the longest prompt).

Only the kept calls' feeds are written to disk (`np.save`, one folder per part): which calls are kept is known
before the first round, because each prompt's number of calls is (``counts``, `.calibration.host_loop_calls`;
checked at the end). The calls are numbered prompt by prompt, the order whole-at-once makes them in, so the same
calls are kept: the same feeds, the same quantized part (tests/test_calibration_sequence.py). The disk this takes
is the kept calls (at most `.calibration.MAX_SAMPLES` per graph set) times a call's feeds over all parts
(`.calibration.call_bytes`), checked against the free space before the first round; a disk that fills anyway is
one line from the CLI.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Sequence

import numpy as np


class _Rounds:
    """Where the prompts' loops hand their calls (`submit`) and the scheduler takes them a round at a time."""

    def __init__(self, lanes: int):
        self.cond = threading.Condition()
        self.lanes = lanes
        self.pending: dict[int, dict] = {}
        self.results: dict[int, dict] = {}
        self.done: set[int] = set()
        self.error: BaseException | None = None
        self.stopped = False

    def submit(self, lane: int, feeds: dict) -> dict:
        with self.cond:
            self.pending[lane] = feeds
            self.cond.notify_all()
            while lane not in self.results:
                if self.stopped:
                    raise RuntimeError("calibration in sequence stopped")
                self.cond.wait()
            return self.results.pop(lane)

    def finish(self, lane: int, error: BaseException | None = None) -> None:
        with self.cond:
            self.done.add(lane)
            if error is not None and self.error is None:
                self.error = error
            self.cond.notify_all()

    def next_round(self) -> dict[int, dict]:
        """The calls of this round ({lane: feeds}), once every loop waits on one or has ended; {} when all ended."""
        with self.cond:
            while len(self.pending) + len(self.done) < self.lanes and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise self.error
            batch, self.pending = self.pending, {}
            return batch

    def deliver(self, outputs: dict[int, dict]) -> None:
        with self.cond:
            self.results.update(outputs)
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class _Lane:
    """One prompt's graph as its host loop sees it: ``run(feeds) -> outputs`` of every part, in order."""

    def __init__(self, rounds: _Rounds, lane: int):
        self.rounds, self.lane = rounds, lane

    def run(self, feeds: dict) -> dict:
        return self.rounds.submit(self.lane, feeds)


def _save(folder: Path, feeds: dict, clip: float | None) -> None:
    folder.mkdir(parents=True)
    for name, value in feeds.items():
        value = np.asarray(value)
        if clip is not None and name == "attention_mask":
            value = np.maximum(value, np.float32(clip))
        np.save(folder / f"{name}.npy", value)


def load(folder: Path, names: Sequence[str]) -> dict:
    """One kept call's feeds of one part, as `record_in_sequence` saved them."""
    return {name: np.load(folder / f"{name}.npy") for name in names}


def kept_calls(counts: Sequence[int], keep: set[int]) -> dict[tuple[int, int], int]:
    """{(prompt, its call): index} of the kept calls, numbered prompt by prompt (``counts``: calls per prompt)."""
    out, index = {}, 0
    for lane, n in enumerate(counts):
        for i in range(n):
            if index in keep:
                out[(lane, i)] = index
            index += 1
    return out


def record_in_sequence(paths: Sequence[Path], open_graph: Callable, loops: Sequence[Callable], counts: Sequence[int],
                       keep: set[int], clip: float | None, spill: Path) -> tuple[list[list[Path]], list[list[str]], int]:
    """Each part's feeds on the calls ``keep`` selects (numbered prompt by prompt), as `.parts_run.Chain` records
    them over the same ``loops`` run one after another: per part, the folders they were saved to (in call order;
    `load` reads one), per part its input names, and the number of rounds.

    ``paths``: the parts' float graphs in order; ``open_graph(path)``: a graph with ``input_names`` and ``run``;
    ``loops``: one per prompt, ``loop(graph)`` runs that prompt's host loop over ``graph``; ``counts``: the calls
    each loop makes (a loop that makes another number is an error: the kept calls would not be whole-at-once's);
    ``clip``: the floor of the recorded attention masks; ``spill``: an empty folder for the kept feeds."""
    rounds = _Rounds(len(loops))
    kept = kept_calls(counts, keep)

    def run_loop(lane: int, loop: Callable) -> None:
        try:
            loop(_Lane(rounds, lane))
        except BaseException as exc:  # noqa: BLE001 (handed to the scheduler, raised there)
            rounds.finish(lane, exc)
        else:
            rounds.finish(lane)

    threads = [threading.Thread(target=run_loop, args=(lane, loop), daemon=True, name=f"calibration-prompt-{lane}")
               for lane, loop in enumerate(loops)]
    for t in threads:
        t.start()
    calls = [0] * len(loops)
    names: list[list[str]] = [[] for _ in paths]
    n_rounds = 0
    try:
        while batch := rounds.next_round():
            n_rounds += 1
            values = {lane: dict(feeds) for lane, feeds in batch.items()}
            outputs: dict[int, dict] = {lane: {} for lane in batch}
            for k, path in enumerate(paths):
                graph = open_graph(path)
                names[k] = list(graph.input_names)
                for lane in sorted(batch):
                    feeds = {n: values[lane][n] for n in graph.input_names}
                    if (lane, calls[lane]) in kept:
                        _save(spill / f"part{k}" / f"{kept[(lane, calls[lane])]:06d}", feeds, clip)
                    result = graph.run(feeds)
                    values[lane].update(result)
                    outputs[lane].update(result)
                del graph
            for lane in batch:
                calls[lane] += 1
            rounds.deliver(outputs)
    finally:
        rounds.stop()
        for t in threads:
            t.join()
    if calls != list(counts):
        raise RuntimeError(f"calibration in sequence: the prompts made {calls} calls, {list(counts)} expected")
    folders = [[spill / f"part{k}" / f"{index:06d}" for index in sorted(kept.values())] for k in range(len(paths))]
    return folders, names, n_rounds
