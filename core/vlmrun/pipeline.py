"""The Python API: build a pipeline from a model and a layout, generate with streaming, run or capture stages.

>>> from vlmrun import Pipeline, GenerationSettings
>>> pipe = Pipeline.build(layout="reference")                # the tiny default model
>>> gen = pipe.generate("photo.jpg", "Describe the image.", GenerationSettings(max_new_tokens=32))
>>> for piece in gen:                                        # text streams as tokens arrive
...     print(piece, end="", flush=True)
>>> gen.token_ids, gen.timings                               # afterwards
>>> pipe.capture("photo.jpg", "Describe the image.")         # every stage-boundary tensor (for diffs)

Also here: `StageContext`, what the ``load_stage`` hook gets, and the cached ONNX export (`export_artifact`). How
`Pipeline.capture` teacher-forces the decoder is in `vlmrun.teacher_forcing`; the reference activations a compiler
asks for (`StageCompileContext`) in `vlmrun.compile_context`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, ContextManager, Mapping, Sequence

import attrs
import numpy as np

from . import layouts as layouts_mod
from . import plugins as plugins_mod
from . import teacher_forcing
from .compile_context import ReferenceCompileContext
from .errors import BackendError, InputError
from .conversation import Chat, ChatGeneration, KeptState
from .generation import Generation, GenerationSettings, Prepared
from .handles import context_of, profile_of, runtime_of
from .model import FastVLMModel, open_model
from .options import StageOptions
from .progress import no_progress
from .preprocess import load_image, preprocess_image, render_messages, render_prompt, splice, tokenize_prompt
from .stages import (CONTRACTS, STAGES, ArtifactKind, CompileRequest, ExportForm, check_tensor)
from .store import Artifact, ArtifactStore

Progress = Callable[[str], ContextManager]


@attrs.define
class StageContext:
    """What ``load_stage`` gets: the model, the stage's options, and cached access to artifacts.

    ``options`` may be given as a plain mapping (the stage's checked layout options); the context holds them
    filled and frozen, as `vlmrun.options.StageOptions` (every declared default filled in, ``options.given``
    what the layout set).
    """

    backend: str
    stage: str
    model: FastVLMModel
    options: StageOptions
    store: ArtifactStore
    registry: plugins_mod.Registry
    rebuild: bool = False
    progress: Progress = no_progress
    bundle: str | None = None  # the bundle folder when the layout is ``bundle:DIR`` (load_stage runs its files)
    executor: object | None = None  # where a compile's jobs run (`vlmrun.cluster`; None: in this process)

    def __attrs_post_init__(self) -> None:
        self.options = self.registry.stage_options(self.backend, self.stage, self.options)

    def _versions(self, hook: str) -> dict[str, str]:
        return {p.name: p.version for p in self.registry.plugins.values() if hook in p.hooks}

    def exported(self, form: ExportForm) -> Artifact:
        """The ONNX export of ``form`` (cached in the store; the ``export`` hook runs only when missing)."""
        return export_artifact(self.registry, self.store, self.model, form, self.progress, self.rebuild)

    def compiled(self, source: Artifact, options: Mapping[str, object], kind: ArtifactKind | str) -> Artifact:
        """``source`` compiled by this backend's ``compile`` hook (cached by source, options, versions); ``kind``
        (a `vlmrun.stages.ArtifactKind`; a plain label is taken as its ``what``) names and keys it."""
        kind = str(kind if isinstance(kind, ArtifactKind) else ArtifactKind(str(kind)))
        compiler = str(self.options["compiler"] or self.backend)
        key = {
            "stage": self.stage,
            "backend": self.backend,
            "compiler": compiler,
            "kind": kind,
            "source": source.path.name,
            "options": dict(options),
            "versions": self._versions("compile"),
        }
        if compiler != self.backend:  # the compiler's own options that change its output key the artifact too
            keyed = self._compiler_keyed(compiler, options)
            if keyed:
                key["compiler_options"] = keyed

        name = self.store.path_for(key).name

        def build(tmp: Path) -> dict:
            via = "" if compiler == self.backend else f" with {compiler}"
            request = CompileRequest(
                stage=self.stage, model=self.model, source=source, options=dict(options),
                stage_options=self.options, target=self.backend, compiler=compiler, out_dir=tmp,
                artifact=name, rebuild=self.rebuild,
                context=StageCompileContext(self, name),
            )
            with self.progress(f"compiling {self.stage} for {self.backend}{via} ({kind})"):
                result = self.registry.hook.compile(backend=compiler, request=request)
            if result is None:
                raise BackendError(f"'{compiler}' cannot compile stage '{self.stage}' for backend '{self.backend}'")
            return result

        return self.store.get_or_build(key, build, rebuild=self.rebuild)

    def _compiler_keyed(self, compiler: str, options: Mapping[str, object]) -> dict[str, object]:
        """The keyed options of another plugin compiling this stage, from what the layout gave (a default filled in
        keys nothing: the same binary as before keys the same artifact)."""
        given = self.options.given
        keyed = {}
        for k, decl in sorted(self.registry.options.by_backend.get(compiler, {}).items()):
            if not decl.keyed or k in options:
                continue
            if decl.key is not None:  # the value the compiler really uses, given or derived (one device, one key)
                v = decl.key(dict(given))
            elif k in given and given[k] != decl.default:  # at its default: as if not given
                v = given[k]
            else:
                continue
            if v is not None:
                keyed[k] = v
        return keyed


class StageCompileContext(ReferenceCompileContext):
    """The core's side of a compile (see `vlmrun.stages.CompileContext`): reference activations come
    from a ``reference``-layout pipeline over the same model and store, built on first use."""

    def build_reference(self, stages: tuple[str, ...]) -> "Pipeline":
        c = self._ctx
        return Pipeline.build(c.model, "reference", store=c.store, registry=c.registry, stages=stages,
                              progress=c.progress)

    def map(self, fn, jobs, memory_bytes=None, names=None) -> list:
        if self._ctx.executor is None:
            return super().map(fn, jobs, memory_bytes, names)
        return self._ctx.executor.map(fn, jobs, memory=memory_bytes, names=names)

    def work_dir(self, prefix: str = "vlmrun-") -> Path:
        if not getattr(self._ctx.executor, "remote", False):  # the jobs run in this process
            return super().work_dir(prefix)
        import tempfile

        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.state_dir()))  # in the store: every node sees it


def export_artifact(registry, store, model, form: ExportForm, progress: Progress = no_progress, rebuild=False):
    versions = {p.name: p.version for p in registry.plugins.values() if "export" in p.hooks}
    key = {
        "stage": form.stage,
        "backend": "onnx",
        "kind": form.label(),
        "weights": model.weights_hash(store),
        "versions": versions,
    }

    def build(tmp: Path) -> dict:
        with progress(f"exporting {form.stage} ({form.label()}) to ONNX"):
            result = registry.hook.export(model=model, stage=form.stage, form=form, out_dir=tmp)
        if result is None:
            raise BackendError(
                f"no installed plugin can export '{form.label()}' for stage '{form.stage}';"
                " install vlmrun-ort-reference (it exports every stage)"
            )
        return result

    return store.get_or_build(key, build, rebuild=rebuild)


class Pipeline:
    """FastVLM on a layout: one loaded stage per backend. Build with `build`."""

    def __init__(self, model, layout, registry, store, handles, progress: Progress = no_progress):
        self.model: FastVLMModel = model
        self.layout: layouts_mod.Layout = layout
        self.registry: plugins_mod.Registry = registry
        self.store: ArtifactStore = store
        self.handles: dict[str, object] = handles
        self.progress = progress
        self._lut: np.ndarray | None = None

    @classmethod
    def build(
        cls,
        model: str | os.PathLike | FastVLMModel | None = None,
        layout: str | layouts_mod.Layout | None = "reference",
        *,
        overrides: Mapping[str, str | None] | None = None,
        options: Mapping[str, Mapping[str, object]] | None = None,
        layout_file: str | os.PathLike | None = None,
        store: ArtifactStore | str | os.PathLike | None = None,
        registry: plugins_mod.Registry | None = None,
        rebuild: bool = False,
        image_size: int | None = None,
        stages: tuple[str, ...] = STAGES,
        progress: Progress = no_progress,
        requests: Sequence[tuple[object, str]] = (),
    ) -> "Pipeline":
        """Resolve and check the layout, open the model (the tiny default if ``None``), load every stage.

        Everything that can be checked is checked before anything is exported, compiled or loaded: the layout
        against the installed plugins and their declared options, then the images of ``requests`` (pairs of
        image, prompt the caller is about to run: each must be readable and decodable), then, once the model is
        open, that each prompt fits the decoder's context.
        """
        registry = registry or plugins_mod.load()
        if not isinstance(layout, layouts_mod.Layout):
            layout = layouts_mod.resolve(layout, layout_file, overrides, options, registry.presets)
        layout = layouts_mod.validate(layout, registry, stages)
        images = [load_image(img) if isinstance(img, (str, os.PathLike)) else img for img, _ in requests]
        if not isinstance(store, ArtifactStore):
            store = ArtifactStore(store)
        store.clean_stale()
        if layout.bundle is not None and model is None:  # a bundle carries its checkpoint's configs (no weights)
            fvlm = FastVLMModel(Path(layout.bundle), Path(layout.bundle), "bundle")
        else:
            fvlm = open_model(model, store, image_size, progress, rebuild=rebuild)
        for stage in stages if layout.bundle is None else ():  # a bundle's runtime checks itself as it loads
            assignment = layout.stages[stage]
            registry.hook.preflight(backend=assignment.backend, stage=stage, model=fvlm,
                                    options=registry.stage_options(assignment.backend, stage, assignment.options))
        pipe = cls(fvlm, layout, registry, store, {}, progress)
        if "decoder" in stages:
            for image, (_, prompt) in zip(images, requests):
                pipe.prepare(image, prompt)  # the prompt must fit the context before minutes of compiling
        for stage in stages:
            pipe.handles[stage] = pipe._load(stage, rebuild)
        return pipe

    def _load(self, stage: str, rebuild: bool) -> object:
        assignment = self.layout.stages[stage]
        ctx = StageContext(
            assignment.backend, stage, self.model, assignment.options, self.store, self.registry,
            rebuild, self.progress, self.layout.bundle,
        )
        handle = self.registry.hook.load_stage(backend=assignment.backend, stage=stage, ctx=ctx)
        if handle is None:
            raise BackendError(f"backend '{assignment.backend}' did not load stage '{stage}'")
        return handle

    # -- properties ----------------------------------------------------------------------------------
    @property
    def whole_backend(self) -> str | None:
        """The backend every stage is on, when one is (it may run whole requests: ``run_request``)."""
        backends = {self.layout.backend(s) for s in STAGES}
        return backends.pop() if len(backends) == 1 and set(self.handles) >= set(STAGES) else None

    @property
    def context_length(self) -> int:
        """The decoder's context: its handle's ``context_length`` (compiled backends fix it), else the
        layout option or its backend's declared default (before the handle exists, for early checks), else the
        model's ``max_position_embeddings``."""
        fixed = context_of(self.handles.get("decoder"))
        return int(fixed or self.stage_options("decoder")["context_length"] or self.model.max_context)

    def stage_options(self, stage: str) -> StageOptions:
        """The options the hooks of ``stage`` read: the layout's, every declared default filled in, read-only."""
        a = self.layout.stages[stage]
        return self.registry.stage_options(a.backend, stage, a.options)

    # -- single stages -------------------------------------------------------------------------------
    def run_stage(self, stage: str, inputs: Mapping[str, np.ndarray], producer: str = "the caller") -> dict:
        """Run one stage on its backend; inputs and outputs are checked against the stage contract."""
        backend = self.layout.backend(stage)
        contract, dims = CONTRACTS[stage], self.model.dims()
        checked = {}
        for spec in contract.inputs:
            if spec.name not in inputs:
                raise InputError(f"stage '{stage}' needs input '{spec.name}'")
            checked[spec.name] = check_tensor(inputs[spec.name], spec, dims, producer, f"{backend} ({stage})")
        out = self.registry.hook.run_stage(backend=backend, stage=stage, handle=self.handles[stage], inputs=checked)
        if out is None:
            raise BackendError(f"backend '{backend}' does not implement run_stage for '{stage}'")
        result = {}
        for spec in contract.outputs:
            if spec.name not in out:
                raise BackendError(f"backend '{backend}' returned no '{spec.name}' from stage '{stage}'")
            result[spec.name] = check_tensor(out[spec.name], spec, dims, f"{backend} ({stage})", self._consumer(stage))
        return result

    def _consumer(self, stage: str) -> str:
        nxt = {"vision": "projector", "projector": "decoder", "embed": "decoder"}.get(stage)
        return f"{self.layout.backend(nxt)} ({nxt})" if nxt else "the sampler"

    def prepare(self, image, prompt: str, system: str | None = None) -> Prepared:
        """Image path or PIL image + question -> pixel_values and token ids (placeholder expanded)."""
        if isinstance(image, (str, os.PathLike)):
            image = load_image(image)
        pixel_values = preprocess_image(image, self.model.image_processor_config)
        text = render_prompt(self.model.chat_template, prompt, system)
        ids, start = tokenize_prompt(
            self.model.tokenizer, text, self.model.image_token_id, self.model.image_tokens
        )
        if ids.shape[1] >= self.context_length:
            raise InputError(
                f"the prompt is {ids.shape[1]} tokens ({self.model.image_tokens} of them image) but the context"
                f" holds {self.context_length}; shorten the prompt or raise the decoder's context_length"
            )
        return Prepared(pixel_values, ids, start, text)

    def prepare_messages(self, image, messages) -> Prepared:
        """`prepare` for a whole conversation: ``messages`` as `vlmrun.preprocess.render_messages`
        takes them (system, user and assistant turns in order; the picture's ``{"type": "image"}`` part in the
        turn where it appears), rendered by the model's chat template with the generation prompt."""
        if isinstance(image, (str, os.PathLike)):
            image = load_image(image)
        pixel_values = preprocess_image(image, self.model.image_processor_config)
        text = render_messages(self.model.chat_template, messages)
        ids, start = tokenize_prompt(self.model.tokenizer, text, self.model.image_token_id, self.model.image_tokens)
        if ids.shape[1] >= self.context_length:
            raise InputError(
                f"the conversation is {ids.shape[1]} tokens ({self.model.image_tokens} of them image) but the context"
                f" holds {self.context_length}; start a new conversation or raise the decoder's context_length"
            )
        return Prepared(pixel_values, ids, start, text)

    def embed_prompt(self, prepared: Prepared, timings: dict | None = None, tensors: dict | None = None,
                     profiles: dict | None = None) -> np.ndarray:
        """vision -> projector, embed, splice: the decoder's ``inputs_embeds`` [1, T, H].

        ``timings`` gets each stage's latency (``<stage>_ms``: the device's own ``inference_ms`` when the handle
        reports one, with the host's wall time as ``<stage>_wall_ms``), ``tensors`` each boundary tensor and
        ``profiles`` each stage's device figures (`vlmrun.handles.StageHandle.last_profile`), when given.
        """
        feats, img = self.image_embeds(prepared.pixel_values, timings, profiles)
        txt = self._timed("embed", {"input_ids": prepared.input_ids}, timings, profiles)["inputs_embeds"]
        embeds = splice(txt, img, prepared.image_start)
        if tensors is not None:
            tensors.update(image_features=feats, image_embeds=img, text_embeds=txt, inputs_embeds=embeds)
        return embeds

    def image_embeds(self, pixel_values: np.ndarray, timings: dict | None = None,
                     profiles: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """vision -> projector for one picture: (``image_features``, ``image_embeds`` [1, N, H]); ``timings`` and
        ``profiles`` as `embed_prompt` fills them."""
        feats = self._timed("vision", {"pixel_values": pixel_values}, timings, profiles)["image_features"]
        img = self._timed("projector", {"image_features": feats}, timings, profiles,
                          self.layout.backend("vision"))["image_embeds"]
        return feats, img

    def _timed(self, stage: str, inputs: dict, timings: dict | None, profiles: dict | None,
               producer: str = "the caller") -> dict:
        """`run_stage` with its latency in ``timings`` (``<stage>_ms``: the device's own ``inference_ms`` when
        the handle reports one, the host's wall time as ``<stage>_wall_ms``) and its device figures in ``profiles``."""
        t = time.perf_counter()
        out = self.run_stage(stage, inputs, producer)
        wall = (time.perf_counter() - t) * 1e3
        prof = profile_of(self.handles[stage])
        device_ms = prof.get("inference_ms")
        if timings is not None:
            if isinstance(device_ms, (int, float)):
                timings[f"{stage}_ms"], timings[f"{stage}_wall_ms"] = float(device_ms), wall
            else:
                timings[f"{stage}_ms"] = wall
        if profiles is not None and prof:
            profiles[stage] = prof
        return out

    def decoder_state(self):
        """A new state for one conversation over the decoder (the ``decoder_state`` hook), or ``None`` when the
        decoder's backend cannot continue from a kept state (each turn is then decoded from the start)."""
        return self.registry.hook.decoder_state(backend=self.layout.backend("decoder"), handle=self.handles["decoder"])

    def request_state(self):
        """A new conversation state of the runtime that runs this layout's whole requests (``request_state`` hook:
        a bundle's), or ``None`` (stage by stage, or a runtime that keeps none)."""
        backend = self.whole_backend
        return None if backend is None else self.registry.hook.request_state(backend=backend, handles=dict(self.handles))

    def new_kept_state(self) -> KeptState:
        """What a new conversation keeps between its turns (`vlmrun.conversation.KeptState`)."""
        return KeptState(self.decoder_state(), self.request_state())

    def generate_turn(self, plan, kept=None, settings: GenerationSettings = GenerationSettings()) -> Generation:
        """One turn of a conversation already planned (`vlmrun.conversation.plan_turn`), continuing from
        ``kept`` (a `vlmrun.conversation.KeptState`; ``None``: a new one): what a server runs per request."""
        if settings.max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        return ChatGeneration(self, plan, kept if kept is not None else self.new_kept_state(), settings)

    def chat(self, system: str | None = None, settings: GenerationSettings = GenerationSettings(),
             keep_state: bool = True) -> Chat:
        """A conversation on this pipeline (`vlmrun.conversation.Chat`): ``chat.ask(prompt, image=None)``
        returns a streaming `Generation` per turn; the decoder's state is kept between turns (``keep_state``:
        ``False`` recomputes every turn from the start, the same tokens)."""
        return Chat(self, system=system, settings=settings, keep_state=keep_state)

    def embed_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Embeddings of generated tokens from the exported float32 LUT: int [n] -> float32 [1, n, H]."""
        if self._lut is None:
            art = export_artifact(self.registry, self.store, self.model, ExportForm.of("embed", "embed/lut"))
            # memory-mapped (a full-size table is 0.5 GB), viewed as a plain ndarray: np.memmap's own
            # __getitem__ costs ~20 us a lookup, which shows on a small model's decode step
            self._lut = np.asarray(np.load(art.file("embed_lut_f32.npy"), mmap_mode="r"))
        return self._lut[np.asarray(ids, dtype=np.int64).reshape(-1)][None]

    def generate(self, image, prompt: str, settings: GenerationSettings = GenerationSettings(),
                 keep_logits: bool = False) -> Generation:
        """Start a generation; iterate it for streamed text. Inputs are checked before this returns.

        ``keep_logits``: collect the per-step logits rows the decoder reports (``gen.step_logits``).
        """
        if settings.max_new_tokens < 1:  # before the image is read
            raise InputError("max_new_tokens must be at least 1")
        return self.generate_prepared(self.prepare(image, prompt, settings.system), settings, keep_logits)

    def generate_prepared(self, prepared: Prepared, settings: GenerationSettings = GenerationSettings(),
                          keep_logits: bool = False, teacher_tokens: Sequence[int] | None = None) -> Generation:
        """`generate` for inputs already `prepare`-d (a server checks them before queueing).

        ``teacher_tokens``: teacher forcing through the decoder's own runtime (step k takes token k)."""
        if settings.max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        return Generation(self, prepared, settings, keep_logits, teacher_tokens)

    def layout_options(self) -> dict[str, dict]:
        """Each stage's options with its precision: the stage's ``precision`` option, else (a bundle) the precision
        its manifest records for the stage as it was written, else the backend's own."""
        written = (layouts_mod.bundle_manifest(self.layout.bundle).get("precisions") or {}
                   if self.layout.bundle else {})
        out = {}
        for s in STAGES:
            opts = dict(self.layout.stages[s].options)
            default = written.get(s) or self.registry.backend(self.layout.backend(s)).precision
            out[s] = {"precision": default, **opts}
        return out

    @property
    def runtime_name(self) -> str | None:
        """The runtime that generates, when it is not the engine behind ``run_stage`` for the decoder (e.g.
        a vendor runtime over binaries vlmrun's host engine also runs): see `vlmrun.handles.DecoderHandle.runtime_name`."""
        return runtime_of(self.handles.get("decoder"))

    def capture(self, image, prompt: str, settings: GenerationSettings = GenerationSettings(),
                teacher_tokens: list[int] | None = None) -> dict[str, np.ndarray]:
        """Every stage-boundary tensor of one request, for diffs.

        Generates with ``settings`` (free-running: ``tokens``) and captures per-step ``logits`` under teacher
        forcing on ``teacher_tokens`` (default: its own tokens): row k predicts token k. When the decoder reported
        its logits while generating and it generated exactly the forced tokens, those rows are the teacher-forced
        ones already; otherwise the decoder stage runs once more over the prompt plus the forced tokens.

        When the decoder's runtime is not the engine behind ``run_stage`` (`runtime_name`, e.g. a vendor runtime), the
        free-running generation is the runtime's as it ships (its own sampler), ``logits`` are the engine's over
        the same binaries, and ``runtime_logits`` are the runtime's own, teacher-forced through it on the same
        tokens (its ``teacher_tokens``): the two sides of the runtime boundary.
        """
        return teacher_forcing.capture(self, image, prompt, settings, teacher_tokens)
