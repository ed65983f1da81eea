"""The decoder's parts form, as Qualcomm ships LLMs to the HTP: how a decoder is split into part binaries.

What every plugin that compiles the parts form shares (qnn_htp compiles it locally, qaihub on AI Hub): the plan
(how many parts, which layers each holds, the AR and context), the size arithmetic (estimated bytes per part,
one copy of the weights), the graphs of each part (`part_graphs`: prompt, token and the follow-up prompt graph
exported with them), the part-limit check of compiled binaries and the digest of the
graphs a binary was compiled from. The form itself is described in `vlmrun_qnn_htp.parts_compile`.

The number of parts (option ``parts``, 0 = auto) is the fewest whose estimated part binary stays under
``part_limit_mb`` (default `DEFAULT_PART_LIMIT_MB` MB = 1 GB: the HTP is a 32-bit co-processor and one
context must map into its address space; qai-hub-models ships ~1 GB parts). Layers are spread so the parts'
weights are balanced, the lm_head counting toward the last part.
"""

from __future__ import annotations

from pathlib import Path

from vlmrun.errors import BackendError, UsageError
from vlmrun.onnx_files import graph_files

PRECISIONS = ("fp16", "w8a16", "w4a16")
DEFAULT_PART_LIMIT_MB = 1000  # MB (10^6 bytes) per part binary
WEIGHT_BITS = {"fp16": 16, "w8a16": 8, "w4a16": 4}
OVERHEAD = 1.08  # estimated binary bytes / weight bytes (graph, I/O and spill buffers, biases), from measurements


def weight_counts(model) -> tuple[int, int, int]:
    """(MatMul weight elements per layer, other parameters per layer, lm_head elements) from the model config."""
    H, nh, kv, D = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    inter = int(model.text_config.get("intermediate_size") or 4 * H)
    mm = H * nh * D * 2 + H * kv * D * 2 + 3 * H * inter  # q, o, k, v, gate, up, down
    other = nh * D + 2 * kv * D + 2 * H  # q/k/v biases, two RMSNorm gains
    return mm, other, model.vocab_size * H


def estimate_bytes(model, precision: str, layers: int, last: bool) -> int:
    """Estimated bytes of a part binary holding ``layers`` layers (+ norm and lm_head when ``last``)."""
    mm, other, head = weight_counts(model)
    bits = WEIGHT_BITS[precision]
    mm_bytes = (layers * mm + (head if last else 0)) * bits / 8
    rest = layers * other * (2 if precision == "fp16" else 4) + (model.hidden_size * 2 if last else 0)
    return int((mm_bytes + rest) * OVERHEAD)


def split_layers(model, precision: str, parts: int) -> list[int]:
    """Layers per part for ``parts`` parts: the split with the smallest largest part (lm_head in the last)."""
    L = model.num_layers
    if parts > L:
        raise UsageError(f"parts = {parts} exceeds the model's {L} layers")
    if parts == 1:
        return [L]
    best = None
    for last in range(1, L - parts + 2):
        rest = L - last
        base, extra = divmod(rest, parts - 1)
        counts = [base + (1 if i < extra else 0) for i in range(parts - 1)] + [last]
        if min(counts) < 1:
            continue
        worst = max(estimate_bytes(model, precision, c, i == parts - 1) for i, c in enumerate(counts))
        if best is None or worst < best[0]:
            best = (worst, counts)
    return best[1]


def plan(model, opts: dict) -> dict:
    """The parts, AR and context the form is exported with (the ``decoder/parts`` export params), and the AR of the
    follow-up prompt graph (``followup_ar``, 0 = none: `followup_ar`)."""
    precision, limit = opts["precision"], opts["part_limit_mb"] * 1_000_000
    parts = opts["parts"]
    if not parts:
        for p in range(1, model.num_layers + 1):
            counts = split_layers(model, precision, p)
            if max(estimate_bytes(model, precision, c, i == p - 1) for i, c in enumerate(counts)) <= limit:
                parts = p
                break
        else:
            raise UsageError(f"the decoder does not fit part binaries of {opts['part_limit_mb']} MB even one layer"
                             " per part; raise part_limit_mb")
    counts = split_layers(model, precision, parts)
    ctx = int(opts["context_length"])
    # AR <= hidden: Genie reads AR from an embedding input as elements / largest dim; AR < ctx / 2: with the
    # prompt graph's past as long as its rows (AR = ctx / 2) Genie decoded wrong tokens on the emulator
    ar = max(2, min(int(opts["prefill_ar"]), model.hidden_size, (ctx - 1) // 2))
    return {"layers": counts, "ar": ar, "ctx": ctx, "followup_ar": followup_ar(opts.get("followup_ar"), ar)}


def followup_ar(asked, ar: int) -> int:
    """The rows of the follow-up prompt graph: a second, smaller prompt graph per part for prompts shorter than it
    (a conversation's next turn), beside the AR-``ar`` one; 0 (none) when ``asked`` is 0 or not below ``ar``, or
    under 2 (AR-1 is the token graph already)."""
    n = int(asked or 0)
    return n if 2 <= n < ar else 0


GRAPHS = ("prompt", "token")  # the graphs of every part
FOLLOWUP = "followup"  # a part's smaller prompt graph (``followup_ar`` rows), when the export has it


def part_graphs(p: dict) -> dict[str, dict]:
    """``{kind: the graph's ``parts.json`` entry}`` of part ``p`` (an entry of an export's ``parts.json``; a graph's
    files are in that export's folder): prompt, token and, when the export has it (the form's param ``followup``),
    the follow-up prompt graph as "followup"; in that order, the order a part's graphs are compiled, linked and
    listed in."""
    return {kind: p["graphs"][kind] for kind in (*GRAPHS, FOLLOWUP) if kind in p["graphs"]}


def exported_followup_ar(desc: dict) -> int:
    """The rows of the follow-up prompt graphs of the export described by ``desc`` (its ``parts.json``); 0 when it
    has none."""
    first = desc["parts"][0]["graphs"] if desc["parts"] else {}
    return int(first[FOLLOWUP]["ar"]) if FOLLOWUP in first else 0


def weight_bytes(model, precision: str) -> int:
    """Bytes of one copy of the decoder's weights at ``precision``: the MatMul weights and the lm_head at the
    precision's weight bits, the rest (norms, biases) at 16 bits; what ``bytes_over_weights`` divides by."""
    mm, other, head = weight_counts(model)
    return int((model.num_layers * mm + head) * WEIGHT_BITS[precision] / 8 + model.num_layers * other * 2)


def check_part_limits(out_dir: Path, parts: list[dict], limit: int, where: str = "") -> None:
    """BackendError when a part's binary (``parts``: the manifest's entries) is over ``limit`` bytes."""
    P = len(parts)
    for e in parts:
        for b in e["binaries"]:
            size = (Path(out_dir) / b).stat().st_size
            if size > limit:
                raise BackendError(f"decoder part {e['index']}/{P}: its binary {b}{where} is {size / 1e6:.0f} MB,"
                                   f" over the {limit / 1e6:.0f} MB part limit; compile with parts = {P + 1} (or"
                                   " raise part_limit_mb)")


def graph_digest(path: Path) -> str:
    """sha256 of an ONNX graph and its external data: what a binary was compiled from (the float export, or the
    QDQ model), so binaries compiled with and without weight sharing can be shown to hold the same graphs."""
    import hashlib

    h = hashlib.sha256()
    for f in graph_files(path):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()
