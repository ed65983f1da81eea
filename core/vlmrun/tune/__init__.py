"""``vlmrun tune``: the smallest build of a layout whose answers, measured on the device, stay within a budget.

>>> from vlmrun import tune
>>> result = tune.tune(limit=8, budget=tune.Budget(min_answers_as_reference=1.0))  # or layout="PRESET,STAGE.KEY=V"
>>> print(tune.format_table(result)); tune.write_toml(result.winner, "best.toml")

The **base** layout sets each quantized stage's precision (the cheapest build the search starts from: by default
a preset with the ``tune`` options a plugin declares for it; `vlmrun plugins` shows it). Each layer of a tuned stage can be
raised to the precisions its backend offers above the stage's own (the optional ``layer_precisions`` hook; the NPU
backend: a 4-bit-weight decoder layer to 8-bit weights, then to 16-bit activations and weights), written into the
stage's ``layer_precision`` option.

**Search** (`.search`, `.climb`). Sensitivity first: ``vlmrun diff --locate``'s own error per layer, measured on the
device on the first item of the data set (each layer's own quantization error carried by the reference's later
layers to the stage output: the ``impact`` of `vlmrun.diff.locate.locate`). It is measured on the compiled
binary on the device backend, so it ranks what the device really does, needs no optional toolkit (a quantization
toolkit's sensitivity analysis simulates, and is an extra), and is the figure users already read in
``--locate``. Then a greedy climb: from the base, each step raises one layer one rung, choosing among the
``beam`` most sensitive layers not yet at the top the one with the best gain (logits SQNR, then answers as the
reference) per byte; it stops when a measured build meets the budget or after ``max_candidates`` builds.
Every reported point is a layout really compiled and run by `vlmrun.eval.evaluate` on the data set
(default: the generated held-out set): bytes on the device (the binaries' sizes), accuracy and its drop from the
reference, the share of answers equal to the reference's, the median logits SQNR (teacher-forced).

**Output** (`.front`): every point, the Pareto front over (bytes, logits SQNR, answers as the reference,
accuracy), the winner (the fewest bytes within the budget) as a layout TOML file for ``vlmrun``, ``vlmrun bundle``
and ``vlmrun eval``; a table, JSON, and an HTML page with the plot.

**Resume**: a measured point is kept in the store (``tune/``, keyed by the candidate's eval layout key, the items
measured (their content and expected answers, not the data set's path) and the reference) and the compiled binaries and eval results are cached there too: an interrupted tune
resumes, and a finished one run again builds nothing.

**Ray** (`.executors`, `vlmrun.cluster`): ``ray_address`` runs the candidates of a step as Ray tasks (each declares one CPU and
the memory a compile of this model needs, so two full-size compiles do not land on one node). Every node must see
the store at the same path (a shared filesystem): the tasks compile into it and write their eval results there;
the driver checks that before the first task.
"""

from __future__ import annotations

from .front import format_table, pareto_front, write_html, write_json, write_toml
from .search import Budget, Candidate, Point, TuneResult, tune

__all__ = ["Budget", "Candidate", "Point", "TuneResult", "format_table", "pareto_front", "tune", "write_html",
           "write_json", "write_toml"]
