"""Which exporter writes which export form: the one entry point the plugin's ``export`` hook calls.

* ``embed/lut``: the embedding table as a LUT file (`.onnx_export.export_lut`);
* a probe form (``probe = true``): the stage's graph plus its layer outputs (`.probes`, ``vlmrun diff --locate``);
* ``decoder/parts``: the decoder's parts x (prompt, token) graphs in one artifact (`.decoder_parts`);
* everything else: one stage graph traced from its torch wrapper (`.onnx_export`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from .decoder_parts import export_parts
from .onnx_export import build_wrapper, export_lut
from .probes import export_probe
from .torch_common import EXTERNAL_DATA_THRESHOLD, OPSET, import_torch


def export_stage(model, form, out_dir: Path) -> dict | None:
    """Write ``form`` of ``model`` into ``out_dir``; return the manifest fields (see module docstring)."""
    if form.kind == "embed/lut":
        return export_lut(model, out_dir)
    if form.get("probe"):  # the same graph with its layer outputs (probes.py, vlmrun diff --locate)
        return export_probe(model, form, out_dir)
    if form.kind == "decoder/parts":  # parts x (prompt, token) graphs in one artifact (decoder_parts.py)
        return export_parts(model, form, out_dir)
    torch, _ = import_torch()
    built = build_wrapper(model, form)
    if built is None:
        return None
    module, example, names_in, names_out, axes = built
    module.eval()  # a fresh wrapper is in train mode; the exporter would restore that flag tree-wide
    path = out_dir / f"{form.stage}.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notices
        torch.onnx.export(
            module, example, str(path), input_names=names_in, output_names=names_out,
            dynamic_axes=axes, opset_version=OPSET, dynamo=False, do_constant_folding=True,
        )
    files = [path.name]
    if path.stat().st_size > EXTERNAL_DATA_THRESHOLD:
        import onnx

        proto = onnx.load(str(path))
        data = path.name + ".data"
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data)
        files.append(data)
    return {
        "files": files,
        "form": form.label(),
        "inputs": names_in,
        "outputs": names_out,
        "opset": OPSET,
        "torch": torch.__version__,
    }
