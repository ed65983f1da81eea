"""The four FastVLM stages and the tensor contracts checked at every hand-off.

::

    pixel_values --[vision]--> image_features --[projector]--> image_embeds ---+
    input_ids ----[embed]----> inputs_embeds (text) ---------------- splice ---+--> [decoder] --> tokens

Shapes are written with symbolic dims filled from the model (`vlmrun.model.FastVLMModel.dims`):
``S`` image size, ``N`` image tokens, ``F`` vision feature width, ``H`` LLM hidden size, ``V`` vocab rows,
``T`` a sequence length (free).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Mapping, Sequence

import attrs
import numpy as np

from .errors import ContractError

STAGES = ("vision", "projector", "embed", "decoder")


@attrs.frozen
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[object, ...]  # ints or symbolic dim names

    def concrete(self, dims: Mapping[str, int]) -> tuple[object, ...]:
        return tuple(dims.get(d, d) if isinstance(d, str) else d for d in self.shape)


@attrs.frozen
class StageContract:
    stage: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


CONTRACTS: dict[str, StageContract] = {
    "vision": StageContract(
        "vision",
        (TensorSpec("pixel_values", "float32", (1, 3, "S", "S")),),
        (TensorSpec("image_features", "float32", (1, "N", "F")),),
    ),
    "projector": StageContract(
        "projector",
        (TensorSpec("image_features", "float32", (1, "N", "F")),),
        (TensorSpec("image_embeds", "float32", (1, "N", "H")),),
    ),
    "embed": StageContract(
        "embed",
        (TensorSpec("input_ids", "int64", (1, "T")),),
        (TensorSpec("inputs_embeds", "float32", (1, "T", "H")),),
    ),
    "decoder": StageContract(
        "decoder",
        (TensorSpec("inputs_embeds", "float32", (1, "T", "H")),),
        (TensorSpec("logits", "float32", (1, "T", "V")),),
    ),
}


@attrs.frozen
class QuantizedTensor:
    """A quantized tensor as a backend produced it: ``float = (q + offset) * scale`` (the usual NPU runtimes' convention)."""

    data: np.ndarray
    scale: float
    offset: int

    def dequantize(self) -> np.ndarray:
        return ((self.data.astype(np.float32) + np.float32(self.offset)) * np.float32(self.scale)).astype(np.float32)


def check_tensor(
    value: object, spec: TensorSpec, dims: Mapping[str, int], producer: str, consumer: str
) -> np.ndarray:
    """Check one tensor at a hand-off and return it as a plain float/int ndarray.

    Quantized tensors are dequantized here, never passed on silently. A mismatch raises a ContractError
    naming the tensor and both sides.
    """
    if isinstance(value, QuantizedTensor):
        value = value.dequantize()
    if not isinstance(value, np.ndarray):
        raise ContractError(
            f"{producer} produced {type(value).__name__} for '{spec.name}', {consumer} expects a numpy array"
        )
    want = spec.concrete(dims)
    ok_shape = len(value.shape) == len(want) and all(
        isinstance(w, str) or w == got for w, got in zip(want, value.shape)
    )
    if not ok_shape or value.dtype != np.dtype(spec.dtype):
        shown = tuple(w for w in want)
        raise ContractError(
            f"tensor '{spec.name}' from {producer} is {value.dtype}{list(value.shape)} but {consumer}"
            f" expects {spec.dtype}{list(shown)}"
        )
    return value


@attrs.frozen
class ExportForm:
    """What kind of ONNX graph a backend wants for a stage.

    ``kind`` names the form (``vision``, ``projector``, ``embed``, ``embed/lut``, ``decoder/kv``,
    ``decoder/fixed``); ``params`` are sorted ``(key, value)`` pairs (e.g. ``ar``, ``ctx``, ``seq``).
    ``probe=True`` (`probe`) asks for the same graph with extra outputs at layer granularity (``vlmrun diff
    --locate``); its manifest names them (``probe_outputs``, see `probe_outputs`).
    """

    stage: str
    kind: str
    params: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, stage: str, kind: str | None = None, **params: object) -> "ExportForm":
        return cls(stage, kind or stage, tuple(sorted(params.items())))

    def get(self, key: str, default: object = None) -> object:
        return dict(self.params).get(key, default)

    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.params)
        return self.kind + (f"[{extra}]" if extra else "")

    def probe(self) -> "ExportForm":
        """This form with ``probe=True``: the same graph plus its layer outputs (see `probe_outputs`)."""
        return ExportForm(self.stage, self.kind, tuple(sorted({**dict(self.params), "probe": True}.items())))

    @property
    def is_probe(self) -> bool:
        return bool(self.get("probe"))


@attrs.frozen
class ArtifactKind:
    """What a compiled artifact is (``ctx.compiled(source, options, kind)``): ``what`` was compiled (an export
    form's label, `ArtifactKind.of`, or the name of a model format), at which ``precision``, for which ``target``
    (a SoC, a hosted device). It names the artifact in the store and in progress lines
    (``what-precision-target``, empty parts left out) and keys it with the options."""

    what: str
    precision: str | None = None
    target: str | None = None

    @classmethod
    def of(cls, form: ExportForm, precision: str | None = None, target: str | None = None) -> "ArtifactKind":
        return cls(form.label(), precision, target)

    def __str__(self) -> str:
        return "-".join(str(p) for p in (self.what, self.precision, self.target) if p)


#: The stage option through which a backend takes per-layer precisions: ``LAYER=PRECISION`` entries separated by
#: ``;`` or ``,`` (layers named as the probes name them, ``decoder.layer0``), or a TOML table. ``vlmrun tune`` writes
#: the precisions the ``layer_precisions`` hook offers; ``vlmrun diff --what-if`` sets a located layer to ``fp16``
#: (kept out of quantization) or to one of those. A backend that takes per-layer precisions declares it.
LAYER_PRECISION = "layer_precision"


def parse_layer_precision(value) -> dict[str, str]:
    """A `LAYER_PRECISION` value as ``{layer: precision}`` (entries without ``=`` are the backend's to refuse)."""
    if not value:
        return {}
    if isinstance(value, Mapping):
        return {str(k).strip(): str(v).strip() for k, v in value.items()}
    out = {}
    for part in str(value).replace(";", ",").split(","):
        name, sep, p = part.partition("=")
        if sep:
            out[name.strip()] = p.strip()
    return out


def layer_precision_text(layers: Mapping[str, str]) -> str:
    """``{layer: precision}`` as a `LAYER_PRECISION` value (sorted by layer: equal maps key alike)."""
    return ";".join(f"{k}={v}" for k, v in sorted(layers.items()))


def probe_outputs(stage: str, manifest: Mapping[str, object], outputs: Mapping[str, object]) -> dict[str, object]:
    """What ``run_probe`` returns, from a probe graph's outputs keyed by graph output names.

    A probe form's export manifest lists ``probe_outputs``: ``[probe name, graph output name]`` pairs in network
    order (``["vision.stage0", "probe_vision_stage0"]``; the last layer's pair names the stage's own output, e.g.
    ``["vision.final_conv", "image_features"]``). The result holds the stage's contract outputs under their names,
    then every probe under its probe name, in that order.
    """
    out = {spec.name: outputs[spec.name] for spec in CONTRACTS[stage].outputs if spec.name in outputs}
    for name, graph_name in manifest.get("probe_outputs") or ():
        if graph_name in outputs:
            out[name] = outputs[graph_name]
    return out


@attrs.define
class DecodeRequest:
    """Everything a ``decode`` hook needs to generate tokens."""

    inputs_embeds: np.ndarray  # [1, T, H] float32, image embeddings spliced in
    max_new_tokens: int
    sampler: object  # vlmrun.sampling.Sampler
    stop_ids: frozenset[int]
    embed_tokens: Callable[[np.ndarray], np.ndarray]  # int64 [n] -> float32 [1, n, H]
    context_length: int
    # when set, a decoder that sees its logits calls it with each step's row [V] before sampling from it
    on_logits: Callable[[np.ndarray], None] | None = None
    # teacher forcing: step k takes teacher_tokens[k] instead of sampling (``sampler`` already returns them; a
    # runtime that samples inside itself must force them itself, e.g. through a custom sampler callback)
    teacher_tokens: Sequence[int] | None = None


@attrs.define
class RequestRun:
    """One whole request (image + prompt -> tokens), for a backend that runs every stage in one runtime
    (the ``run_request`` hook: a deployable bundle run by its own runtime).

    :ivar pixel_values: float32 [1, 3, S, S], preprocessed as the checkpoint's image processor says.
    :ivar input_ids: int64 [1, T], the image placeholder expanded (what the stage-by-stage path embeds).
    :ivar image_start: where the image's rows start in ``input_ids``.
    :ivar prompt_text: the rendered chat template, with the image placeholder once (not expanded).
    :ivar max_new_tokens: the budget; ``sampling``: a `vlmrun.sampling.SamplingSettings`; ``stop_ids``:
        the tokens that end generation (empty: none).
    :ivar tensors: a dict the backend fills with the stage-boundary tensors it saw (e.g. ``image_embeds`` from
        its image encoder), for diffs.
    :ivar on_logits: when set, the runtime hands it each step's full logits row [V] (float32) as it generates; a
        runtime that cannot see its logits leaves it uncalled.
    :ivar teacher_tokens: when set, step k must take ``teacher_tokens[k]`` instead of sampling (teacher forcing
        through the runtime itself, so that its logits are comparable row by row with a reference's).
    """

    pixel_values: np.ndarray
    input_ids: np.ndarray
    image_start: int
    prompt_text: str
    max_new_tokens: int
    sampling: object
    stop_ids: frozenset[int]
    tensors: dict = attrs.field(factory=dict)
    on_logits: Callable[[np.ndarray], None] | None = None
    teacher_tokens: Sequence[int] | None = None


@attrs.frozen
class BundleRequest:
    """What a ``write_bundle`` hook gets.

    :ivar model: the `vlmrun.model.FastVLMModel`.
    :ivar layout: the `vlmrun.layouts.Layout` the bundle is made from (every stage on the hook's backend).
    :ivar out_dir: an empty temporary directory; the core renames it to the user's folder on success.
    :ivar target: ``local`` (this machine's runtime) or ``android`` (a phone).
    :ivar context: ``context(stage, options=None)`` -> a `vlmrun.pipeline.StageContext` for the stage (its
        layout options, or ``options``), whose ``exported`` / ``compiled`` cache artifacts in the store; its
        ``options`` are filled and frozen (`vlmrun.options.StageOptions`), while ``layout`` keeps what the user
        set (what the bundle's manifest records).
    :ivar progress: ``progress(label)`` context manager for long steps.
    """

    model: object
    layout: object
    out_dir: Path
    target: str
    context: Callable
    progress: Callable

    def stage_options(self, stage: str) -> Mapping[str, object]:
        """The options of ``stage`` as its hooks read them: the layout's, every declared default filled in,
        read-only (``context(stage).options``)."""
        return self.context(stage).options


@attrs.frozen
class CompileRequest:
    """Everything a ``compile`` hook gets: what to compile, for whom, where to write, and a narrow context.

    :ivar stage: the stage name.
    :ivar model: the `vlmrun.model.FastVLMModel`.
    :ivar source: the `vlmrun.store.Artifact` of the exported ONNX stage.
    :ivar options: the options that key the binary (what the loading backend passed to ``ctx.compiled``).
    :ivar stage_options: all of the stage's options (a `vlmrun.options.StageOptions`: checked against the
        declarations, every declared default filled in, read-only; ``stage_options.given`` what the layout set): a
        remote compiler's device or timeout live here.
    :ivar target: the backend that will load the result.
    :ivar compiler: the plugin asked to compile (the stage's ``compiler`` option, else ``target``).
    :ivar out_dir: an empty temporary directory; it becomes the artifact if the hook returns normally.
    :ivar artifact: the name the result will have in the store (stable across runs).
    :ivar rebuild: the user asked to rebuild (``--rebuild``): cached remote results are stale.
    :ivar context: a `CompileContext`: what compilers may ask of the core.
    """

    stage: str
    model: object
    source: object
    options: Mapping[str, object]
    stage_options: Mapping[str, object]
    target: str
    compiler: str
    out_dir: object  # pathlib.Path
    artifact: str
    rebuild: bool
    context: "CompileContext"


class CompileContext:
    """What a compiler may ask of the core while it compiles (implemented by `vlmrun.pipeline`)."""

    def reference_inputs(self, images: Sequence[object] | None = None,
                         prompts: Sequence[str] | None = None) -> list[dict[str, np.ndarray]]:
        """The stage's contract inputs as the ``reference`` layout produces them, one dict per (image, prompt)
        pair: ``pixel_values`` for vision, ``image_features`` for the projector, ``input_ids`` for embed,
        ``inputs_embeds`` (image spliced in) for the decoder. ``images`` are paths or PIL images (default: the
        demo image); ``prompts`` default to one descriptive question; the shorter list is cycled."""
        raise NotImplementedError

    def embed_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Reference embeddings of token ids: int [n] -> float32 [1, n, H] (to drive a decoder loop)."""
        raise NotImplementedError

    def release_reference(self) -> None:
        """Drop what `reference_inputs` and `embed_tokens` built (the reference sessions and their memory: at
        FastVLM-0.5B size the image encoder alone holds gigabytes); a later call builds it again. A compiler calls
        it once it has its reference activations, before its memory-heavy steps."""

    def state_dir(self) -> "os.PathLike":
        """A directory that persists across runs for this artifact (outside it: e.g. a remote job ledger);
        created on first call."""
        raise NotImplementedError

    def progress(self, label: str):
        """A context manager that shows ``label`` while a long step runs."""
        raise NotImplementedError

    def map(self, fn: Callable, jobs: Sequence, memory_bytes: Sequence[int] | None = None,
            names: Sequence[str] | None = None) -> list:
        """``[fn(job) for job in jobs]``, run where the user asked the compile's independent work to run: in this
        process, in order (the default), or, with ``vlmrun bundle --ray ADDRESS``, each job a Ray task on that
        cluster declaring one CPU and ``memory_bytes[i]`` bytes (at least 1 GiB). The results come in ``jobs``
        order. ``fn`` must be a module-level function and the jobs picklable; the files they read and write must
        be under a `work_dir` or in the store (every node sees both at the same path). ``names``: what each job is
        (a failing task is one line naming it)."""
        return [fn(job) for job in jobs]

    def work_dir(self, prefix: str = "vlmrun-") -> Path:
        """A new, empty directory for the compile's intermediate files that every job of `map` can read and
        write: a temporary directory of this machine, or, when `map` runs jobs on a cluster, one inside the store.
        The compiler removes it when done."""
        import tempfile

        return Path(tempfile.mkdtemp(prefix=prefix))
