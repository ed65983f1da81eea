"""Calibrating the parts decoder in sequence: one part's float graph in memory at a time.

Whole-at-once calibration (`.calibration.parts_calibration_feeds` with order ``whole``) opens every part's float
graph of a graph set and runs the host loop call by call through all of them: its memory is the whole decoder in
float32 (about 30 GB at FastVLM-7B). In sequence (`record_in_sequence`), each calibration prompt's host loop
(`.calibration.PromptLoop`: `.genie_engine.GenieLayoutDecoder` driven as `.calibration.greedy_host_loop` drives it)
runs in two phases:

1. the prefill, part-major. The prefill's calls do not wait on logits: part k's feeds of a call are the prompt's
   embeddings (part 1) or part k-1's output of the same call, and past keys and values of part k's own layers,
   written by part k's earlier calls. So part 1's graph is opened once and every prompt's prefill runs through it
   (`_PrefillPart`), the host loop reading zeros for what the other parts would have made (`PromptLoop.zeros`);
   the hidden state each call hands on is kept in memory (rows x hidden per call) and fed to part 2, opened once
   next, and so on. After each part's pass a prompt keeps its KV of that part's layers (`PromptLoop.keep`), the
   last part's pass also the logits of the last prefill call: merged, they are the state whole-at-once leaves.
2. the greedy steps, in lockstep rounds. Each prompt's loop continues from that state (`PromptLoop.steps`) in a
   thread whose graph (`_Lane`) hands every call to a scheduler and waits. Once every loop waits on a call or has
   ended, part 1's float graph is opened and runs every waiting call, then part 2 on part 1's outputs, and so on;
   the last part's outputs (the logits the next greedy token needs) go back to the loops.

Graphs opened: parts x (1 + the greedy steps of the prompt that makes most), instead of parts x its calls (a token
graph's prefill is a call per row: at FastVLM-1.5B ~290 calls per prompt).

Only the kept calls' feeds are written to disk (`.feed_files.save_arrays`, one folder per part): which calls are kept is known
before the first call, because each prompt's number of calls is (``counts``, `.calibration.host_loop_calls`;
checked at the end). The calls are numbered prompt by prompt, the order whole-at-once makes them in (a prompt's
prefill calls, then its greedy steps), so the same calls are kept: the same feeds, the same quantized part
(tests/test_calibration_sequence.py). The disk this takes is the kept calls (at most `.calibration.MAX_SAMPLES` per
graph set) times a call's feeds over all parts (`.calibration.call_bytes`), checked against the free space before
the first call; a disk that fills anyway is one line from the CLI.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .feed_files import load_arrays, save_arrays


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
    arrays = {}
    for name, value in feeds.items():
        value = np.asarray(value)
        if clip is not None and name == "attention_mask":
            value = np.maximum(value, np.float32(clip))
        arrays[name] = value
    save_arrays(folder / "feeds.npz", arrays)


def load(folder: Path, names: Sequence[str]) -> dict:
    """One kept call's feeds of one part, as `record_in_sequence` saved them."""
    arrays = load_arrays(folder / "feeds.npz", set(names))
    return {name: arrays[name] for name in names}


def kept_calls(counts: Sequence[int], keep: set[int]) -> dict[tuple[int, int], int]:
    """{(prompt, its call): index} of the kept calls, numbered prompt by prompt (``counts``: calls per prompt)."""
    out, index = {}, 0
    for lane, n in enumerate(counts):
        for i in range(n):
            if index in keep:
                out[(lane, i)] = index
            index += 1
    return out


class _PrefillPart:
    """One part's open graph as one prompt's prefill sees it in phase 1 (``run(feeds) -> outputs``): the part's
    inputs from the host loop's feeds, but those the previous part made (``passed``: per call, its outputs the host
    loop does not read, e.g. the hidden state ``residual_{i}``) from there; the kept calls' feeds saved (``save``);
    back to the loop, ``loop.zeros(feeds)`` (what the loop reads of a call, as zeros) with this part's outputs over
    them. ``passed_on``: per call, this part's outputs the loop does not read; ``made``: those it reads."""

    def __init__(self, graph, loop, passed: list[dict] | None, save: Callable[[int, dict], None]):
        self.graph, self.loop, self.passed, self.save = graph, loop, passed, save
        self.passed_on: list[dict] = []
        self.made: set[str] = set()

    def run(self, feeds: dict) -> dict:
        call = len(self.passed_on)
        if self.passed is not None and call >= len(self.passed):
            raise RuntimeError(f"calibration in sequence: a prefill made more calls through a part ({call + 1})"
                               f" than through the one before ({len(self.passed)})")
        given = self.passed[call] if self.passed is not None else {}
        part_feeds = {n: given[n] if n in given else feeds[n] for n in self.graph.input_names}
        self.save(call, part_feeds)
        result = self.graph.run(part_feeds)
        zeros = self.loop.zeros(feeds)
        self.made.update(n for n in result if n in zeros)
        self.passed_on.append({n: v for n, v in result.items() if n not in zeros})
        return {**zeros, **result}


def record_in_sequence(paths: Sequence[Path], open_graph: Callable, loops: Sequence, counts: Sequence[int],
                       keep: set[int], clip: float | None, spill: Path) -> tuple[list[list[Path]], list[list[str]], int]:
    """Each part's feeds on the calls ``keep`` selects (numbered prompt by prompt), as `.parts_run.Chain` records
    them over the same ``loops`` run whole one after another (``loop(chain)``): per part, the folders they were
    saved to (in call order; `load` reads one), per part its input names, and the number of graphs opened
    (parts x (1 + greedy rounds)).

    ``paths``: the parts' float graphs in order; ``open_graph(path)``: a graph with ``input_names`` and ``run``;
    ``loops``: one per prompt (`.calibration.PromptLoop`), in halves: ``loop.prefill(graph)`` (from an empty
    state), ``loop.zeros(feeds)`` (the outputs the loop reads of a call, as zeros), ``loop.keep(names)`` (after a
    part's prefill pass: keep the state its outputs ``names`` made), ``loop.steps(graph)`` (the greedy steps from
    the state kept); ``counts``: the calls each loop makes, prefill and steps (a loop that makes another number is
    an error: the kept calls would not be whole-at-once's); ``clip``: the floor of the recorded attention masks;
    ``spill``: an empty folder for the kept feeds."""
    kept = kept_calls(counts, keep)

    def saver(k: int, lane: int) -> Callable[[int, dict], None]:
        def save(call: int, feeds: dict) -> None:
            if (lane, call) in kept:
                _save(spill / f"part{k}" / f"{kept[(lane, call)]:06d}", feeds, clip)
        return save

    names: list[list[str]] = [[] for _ in paths]
    opened = 0
    # phase 1: every prompt's prefill through part 1, then through part 2 on part 1's outputs, ...
    passed: list[list[dict] | None] = [None] * len(loops)
    calls: list[int | None] = [None] * len(loops)
    for k, path in enumerate(paths):
        graph = open_graph(path)
        opened += 1
        names[k] = list(graph.input_names)
        for lane, loop in enumerate(loops):
            part = _PrefillPart(graph, loop, passed[lane], saver(k, lane))
            loop.prefill(part)
            if calls[lane] is not None and len(part.passed_on) != calls[lane]:
                raise RuntimeError(f"calibration in sequence: prompt {lane}'s prefill made {len(part.passed_on)}"
                                   f" calls through part {k + 1}, {calls[lane]} through part 1")
            calls[lane] = len(part.passed_on)
            loop.keep(part.made)
            passed[lane] = part.passed_on
            del part
        del graph
    del passed
    # phase 2: the greedy steps in lockstep rounds, each prompt's loop in a thread
    rounds = _Rounds(len(loops))

    def run_loop(lane: int, loop) -> None:
        try:
            loop.steps(_Lane(rounds, lane))
        except BaseException as exc:  # noqa: BLE001 (handed to the scheduler, raised there)
            rounds.finish(lane, exc)
        else:
            rounds.finish(lane)

    threads = [threading.Thread(target=run_loop, args=(lane, loop), daemon=True, name=f"calibration-prompt-{lane}")
               for lane, loop in enumerate(loops)]
    for t in threads:
        t.start()
    try:
        while batch := rounds.next_round():
            values = {lane: dict(feeds) for lane, feeds in batch.items()}
            outputs: dict[int, dict] = {lane: {} for lane in batch}
            for k, path in enumerate(paths):
                graph = open_graph(path)
                opened += 1
                for lane in sorted(batch):
                    feeds = {n: values[lane][n] for n in graph.input_names}
                    saver(k, lane)(calls[lane], feeds)
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
    return folders, names, opened
