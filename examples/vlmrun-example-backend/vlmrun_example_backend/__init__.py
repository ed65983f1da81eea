"""A third-party vlmrun backend, written against vlmrun's public API only.

``example_cpu`` runs FastVLM's vision stage with ONNX Runtime on the CPU, with an option of its own
(``threads``). Install it (``pip install ./examples/vlmrun-example-backend``) and run::

    vlmrun --vision example_cpu --threads 2 --image photo.jpg --prompt "Describe the image."
    vlmrun --vision example_cpu -o vision.threads=2 ...            # the same, generic form
"""

import numpy as np

import vlmrun

NAME = "example_cpu"


@vlmrun.hookimpl
def describe():
    return vlmrun.BackendInfo(NAME, ("vision",), "example: the vision stage on ONNX Runtime (CPU)")


@vlmrun.hookimpl
def register_options(register):
    register(vlmrun.Option(NAME, "threads", int, default=1, minimum=1, flag="--threads",
                           help="intra-op threads of the ONNX Runtime session"))


class VisionSession(vlmrun.StageHandle):
    """What load_stage returns; the core reads ``artifacts`` (reported by `vlmrun compile`) and ``load_s``."""

    def __init__(self, artifact, threads: int):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        self.threads = threads
        self.artifacts = (artifact,)
        self.session = ort.InferenceSession(str(artifact.file()), so, providers=["CPUExecutionProvider"])


@vlmrun.hookimpl
def load_stage(backend, stage, ctx):
    if not vlmrun.mine(backend, NAME):
        return None
    # ctx.options holds every declared option, converted, its default filled in (threads is an int >= 1)
    artifact = ctx.exported(vlmrun.ExportForm.of("vision"))  # the ONNX export, cached in the artifact store
    return VisionSession(artifact, ctx.options["threads"])


@vlmrun.hookimpl
def run_stage(backend, stage, handle, inputs):
    if not vlmrun.mine(backend, NAME):
        return None
    (features,) = handle.session.run(None, {"pixel_values": inputs["pixel_values"]})
    return {"image_features": np.asarray(features, dtype=np.float32)}
