"""vlmrun plugin ``ort_reference``: every FastVLM stage on ONNX Runtime (CPU), the reference layout.

It also provides the ``export`` hook (torch -> ONNX, see `vlmrun_ort_reference.onnx_export`) that every
other backend builds on.
"""

from __future__ import annotations

from vlmrun import hookimpl
from vlmrun.options import Option
from vlmrun.plugins import BackendInfo, Check, Preset, mine
from vlmrun.stages import STAGES, ExportForm

from .engine import KVDecoder, Session
from .exporters import export_stage
from .probes import ProbeSession
from .streamed import PartsDecoder, PartsProbe, parts_form, plan_layers

NAME = "ort_reference"
__version__ = "0.1.0"

# Which graph each stage runs here.
FORMS = {
    "vision": ExportForm.of("vision"),
    "projector": ExportForm.of("projector"),
    "embed": ExportForm.of("embed"),
    "decoder": ExportForm.of("decoder", "decoder/kv"),
}


@hookimpl
def describe():
    return BackendInfo(NAME, STAGES, "ONNX Runtime on the CPU: the reference every device is compared with",
                       concurrent=True)  # sessions are thread-safe; each generation keeps its own KV cache


@hookimpl
def register_presets(register):
    register(Preset("reference", dict.fromkeys(STAGES, NAME), "every stage on ONNX Runtime's CPU provider, float32:"
                    " the layout others are diffed and scored against", reference=True))


@hookimpl
def register_options(register):
    register(Option(NAME, "parts", int, stages=("decoder",), default=1, minimum=0,
                    help="run the decoder in this many parts, one part's float32 weights in memory at a time (slow,"
                         " bounded by a part: FastVLM-7B's 28 GB decoder on a 24 GB machine); 0: the fewest parts"
                         " whose export fits VLMRUN_MEMORY_BUDGET_GB (else half this machine's memory); 1: the whole"
                         " decoder in one session"))


@hookimpl
def doctor():
    import onnxruntime as ort

    checks = [Check("onnxruntime", True, ort.__version__)]
    try:
        import torch

        checks.append(Check("torch (export)", True, torch.__version__))
    except ImportError:
        checks.append(Check("torch (export)", False, "not installed: export unavailable"))
    return checks


@hookimpl
def export(model, stage, form, out_dir):
    return export_stage(model, form, out_dir)


def decoder_parts_form(ctx) -> ExportForm | None:
    """The export the decoder runs from part by part (`.streamed.parts_form`) when the stage's option ``parts`` plans
    more than one part (`.streamed.plan_layers`); ``None``: the whole decoder in one session. A plugin that wraps
    these hooks with a stage context of its own backend, whose options do not hold ``parts``, gets the whole
    decoder, as before the option."""
    if ctx.backend != NAME:
        return None
    layers = plan_layers(ctx.model, int(ctx.options["parts"]))
    return parts_form(ctx.model, layers, ctx.options["context_length"]) if len(layers) > 1 else None


@hookimpl
def load_stage(backend, stage, ctx):
    if not mine(backend, NAME):
        return None
    if stage == "decoder":
        form = decoder_parts_form(ctx)
        if form is not None:  # streamed.py: part by part
            return PartsDecoder(ctx.exported(form), ctx.model)
        return KVDecoder(ctx.exported(FORMS[stage]).file(), ctx.model)
    return Session(ctx.exported(FORMS[stage]).file())


@hookimpl
def run_stage(backend, stage, handle, inputs):
    if not mine(backend, NAME):
        return None
    if stage == "decoder":
        return {"logits": handle.logits_of(inputs["inputs_embeds"])}
    return handle.run(dict(inputs))


@hookimpl
def load_probe(backend, stage, ctx):
    """The stage's probe form (`vlmrun_ort_reference.probes`): its graph plus the layer outputs."""
    if not mine(backend, NAME) or stage not in ("vision", "projector", "decoder"):
        return None
    parts = decoder_parts_form(ctx) if stage == "decoder" else None
    if parts is not None:  # streamed.py: every part's probe graph, part by part
        return PartsProbe(ctx.exported(parts.probe()), ctx.model)
    form = FORMS[stage].probe()
    return ProbeSession(ctx.exported(form), ctx.model, stage, export=ctx.exported, form=form)


@hookimpl
def run_probe(backend, stage, handle, inputs):
    if not mine(backend, NAME):
        return None
    return handle.run(dict(inputs))


@hookimpl
def decode(backend, handle, request):
    if not mine(backend, NAME):
        return None
    return handle.generate(request)


@hookimpl
def decoder_state(backend, handle):
    """A conversation's KV cache, kept between its turns (`.engine.KVState`, `.streamed.PartsState`)."""
    if not mine(backend, NAME):
        return None
    return handle.new_state()
