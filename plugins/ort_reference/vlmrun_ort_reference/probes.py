"""Probe forms: a stage's graph plus its layer outputs (``ExportForm.probe()``, for ``vlmrun diff --locate``).

A probe form is the normal form of the stage (``vision``, ``projector``, ``decoder/kv``, ``decoder/fixed`` with
the same parameters) with one extra graph output per layer boundary. The main path is the very same graph (the
same torch modules traced the same way; an extra output only names a tensor the graph computes anyway), so the
probe's own outputs equal the normal form's.

=========== ===================================================================================================
vision      ``vision.stem``, ``vision.stage0`` .. ``vision.stage{n-1}`` (the FastViT stages), then
            ``vision.final_conv`` = the stage output ``image_features``
projector   ``projector.linear_1``, then ``projector.linear_2`` = ``image_embeds``
decoder     ``decoder.layer0`` .. ``decoder.layer{L-1}`` (the residual stream after each layer), ``decoder.norm``
            (the final RMSNorm), then ``decoder.lm_head`` = ``logits``
=========== ===================================================================================================

The manifest records ``probe_outputs`` (``[probe name, graph output name]`` pairs in network order: the extra
outputs are ``probe_<name with _ for .>``, the last layer's is the stage's own output) and ``probe_nodes`` (probe
name -> the name of the graph node producing it). Node names are the same in the normal form's graph (the
exporter names nodes by module scope and order, and the extra outputs add no node), so a layer's nodes in the
normal graph are those between its producer node and the previous layer's: how a compiler keeps one layer out
of quantization (qnn_htp's ``keep_fp``, `vlmrun_qnn_htp.probe.excluded_nodes`).

Param ``inject`` (`inject_form`, the reference side only): one more input per probe point but the last,
``inject_<name>``, added to that layer's output before anything reads it. ``vlmrun diff --locate`` feeds the
device's error at layer k-1 there and reads layer k: the reference layer k on the device's input, so the device
layer's own error is told apart from the error it was handed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from vlmrun.stages import ExportForm, probe_outputs

from .decoder_parts import export_part_probe, export_parts_probe
from .engine import Session
from .onnx_export import build_wrapper, stage_weights
from .probe_names import FINAL, STAGES, decoder_probe_outputs, graph_output, inject_input  # noqa: F401
from .torch_common import EXTERNAL_DATA_THRESHOLD, OPSET, import_torch


def _points(fvlm, stage: str) -> list[tuple[str, object]]:
    """(probe name, torch module whose output it is) for vision and projector."""
    from vlmrun.errors import BackendError

    if stage == "vision":
        tm = getattr(fvlm.model.vision_tower, "timm_model", None)
        if tm is None or not hasattr(tm, "stem") or not hasattr(tm, "stages"):
            raise BackendError("probe: the vision tower is not a FastViT (no stem/stages); cannot probe its layers")
        return [("vision.stem", tm.stem)] + [(f"vision.stage{i}", s) for i, s in enumerate(tm.stages)]
    if stage == "projector":
        proj = fvlm.model.multi_modal_projector
        return [("projector.linear_1", proj.linear_1)]
    raise BackendError(f"probe: stage '{stage}' has no layers to probe")


def _hooked(module, points, n_inputs: int):
    """``module`` whose forward also returns the outputs of ``points``' modules (forward hooks, traced); with
    ``inject``, one more input per point is added to that point's output (before anything reads it).

    The module itself with its ``forward`` replaced, not a wrapper around it: a wrapper would add a scope to every
    node name, and node names must stay those of the normal graph (see the module docstring)."""
    plain = type(module).forward.__get__(module)  # the class's own (calling this twice must not nest)

    def forward(*args):
        args, deltas = args[:n_inputs], dict(zip([n for n, _ in points], args[n_inputs:]))
        seen: dict[str, object] = {}

        def hook(_m, _i, out, n):
            if n in deltas:
                out = out + deltas[n]
            seen[n] = out
            return out

        hooks = [m.register_forward_hook(lambda _m, _i, out, n=n: hook(_m, _i, out, n)) for n, m in points]
        try:
            out = plain(*args)
        finally:
            for h in hooks:
                h.remove()
        outs = out if isinstance(out, tuple) else (out,)
        return (*outs, *[seen[n] for n, _ in points])

    module.forward = forward
    return module


def export_probe(model, form, out_dir: Path) -> dict | None:
    """Write the probe form ``form`` (``form.is_probe``) into ``out_dir``; the manifest fields."""
    if form.stage not in STAGES:
        return None
    if form.kind == "decoder/parts":  # one part's layers (a device's parts form), or every part's (streamed.py)
        return (export_part_probe if form.get("part") else export_parts_probe)(model, form, out_dir)
    torch, _ = import_torch()
    if form.stage == "decoder":
        built = build_wrapper(model, form)  # _decoder_wrapper adds the probe outputs itself
        if built is None:
            return None
        module, example, names_in, names_out, axes = built
        pairs = decoder_probe_outputs(model.num_layers)
    else:
        base = ExportForm(form.stage, form.kind, tuple((k, v) for k, v in form.params if k != "probe"))
        built = build_wrapper(model, base)
        if built is None:
            return None
        inner, example, names_in, names_out, axes = built
        points = _points(model.load_torch_part(stage_weights(base)), form.stage)  # the part build_wrapper loaded
        inject = bool(form.get("inject"))
        if inject:  # the example's shapes of each point's output, for the example deltas
            with torch.no_grad():
                shapes = _hooked(inner, points, len(example))(*example)[len(names_out):]
            names_in = [*names_in, *[inject_input(n) for n, _ in points]]
            example = (*example, *[torch.zeros_like(t) for t in shapes])
        module = _hooked(inner, points, len(names_in) - (len(points) if inject else 0))
        pairs = [(n, graph_output(n)) for n, _ in points]
        names_out = [*names_out, *[g for _, g in pairs]]
        if axes is not None:
            axes = dict(axes)
    pairs.append(FINAL[form.stage])
    module.eval()
    path = out_dir / f"{form.stage}.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, example, str(path), input_names=names_in, output_names=names_out,
                          dynamic_axes=axes, opset_version=OPSET, dynamo=False, do_constant_folding=True)
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    producers = {o: n.name for n in proto.graph.node for o in n.output}
    nodes = {name: producers.get(graph) for name, graph in pairs}
    files = [path.name]
    if path.stat().st_size > EXTERNAL_DATA_THRESHOLD:
        full = onnx.load(str(path))
        data = path.name + ".data"
        onnx.save_model(full, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data)
        files.append(data)
    return {
        "files": files,
        "form": form.label(),
        "inputs": names_in,
        "outputs": names_out,
        "probe_outputs": [list(p) for p in pairs],
        "probe_nodes": nodes,
        "opset": OPSET,
        "torch": torch.__version__,
    }


def inject_form(form):
    """The probe form of ``form`` that also takes ``inject_*`` inputs (the reference side of an isolated
    per-layer error: ``vlmrun diff --locate`` adds the device's error at one layer and reads the next one)."""
    return ExportForm(form.stage, form.kind, tuple(sorted({**dict(form.params), "probe": True, "inject": True}.items())))


# -- running on ONNX Runtime -------------------------------------------------------------------------------------
class ProbeSession:
    """A probe graph on ONNX Runtime (CPU): ``run(inputs)`` gives the contract outputs and every probe.

    Inputs ``inject:<probe name>`` (arrays shaped like that layer's output) are added to that layer's output
    inside the graph, so its probe output and every later layer see them: the graph of `inject_form`,
    loaded on first use (``export(form)`` gives its artifact)."""

    def __init__(self, artifact, model, stage: str, export=None, form=None):
        self.artifact = artifact
        self.artifacts = (artifact,)
        self.stage = stage
        self.session = Session(artifact.file())
        self.manifest = dict(artifact.manifest)
        self.model = model
        self._export, self._form = export, form
        self._inject = None

    def _feeds(self, session, inputs: dict) -> dict:
        import numpy as np

        feeds = {k: v for k, v in inputs.items() if not k.startswith("inject:")}
        T = None
        if self.stage == "decoder":  # decoder/kv: one causal forward from an empty cache
            x = np.asarray(inputs["inputs_embeds"], np.float32)
            T = x.shape[1]
            m = self.model
            feeds = {"inputs_embeds": x, "attention_mask": np.ones((1, T), np.int64),
                     "position_ids": np.arange(T, dtype=np.int64)[None]}
            empty = np.zeros((1, m.num_kv_heads, 0, m.head_dim), np.float32)
            feeds.update({n: empty for n in session.inputs if n.startswith("past_")})
        for i in session.sess.get_inputs():
            if i.name.startswith("inject_"):
                shape = [d if isinstance(d, int) else T for d in i.shape]
                feeds[i.name] = np.zeros(shape, np.float32)
        for k, v in inputs.items():
            if k.startswith("inject:"):
                feeds[inject_input(k[len("inject:"):])] = np.asarray(v, np.float32)
        return feeds

    def run(self, inputs: dict) -> dict:
        session = self.session
        if any(k.startswith("inject:") for k in inputs) and self._export is not None:
            if self._inject is None:
                self._inject = Session(self._export(inject_form(self._form)).file())
            session = self._inject
        return probe_outputs(self.stage, self.manifest, session.run(self._feeds(session, inputs)))

