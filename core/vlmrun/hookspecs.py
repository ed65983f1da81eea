"""The vlmrun plugin API: the hooks a backend plugin implements.

A plugin is a module (usually a separately installed distribution) registered under the entry-point group
``vlmrun``. It implements any of the hooks below with ``@vlmrun.hookimpl``. Built-in and third-party plugins
are loaded the same way (see :mod:`vlmrun.plugins`).

Backends are selected *by name*: the core calls every hook with the ``backend`` it wants, and a plugin that
does not provide that backend returns ``None`` so the next plugin is asked (pluggy ``firstresult``). The
helper :func:`vlmrun.plugins.mine` keeps that check to one line.

Stages are ``vision``, ``projector``, ``embed`` and ``decoder`` (:mod:`vlmrun.stages` has their tensor
contracts). The order in which the core calls the hooks for one stage of one run::

    describe()                       once, when plugins are loaded (what backends exist, which stages)
    register_options(register)       once, when plugins are loaded (each backend's per-stage options)
    preflight(backend, stage, ...)   before any work: can this backend run here at all (SDK, libraries)?
    load_stage(backend, stage, ctx)  once per pipeline; the plugin asks ``ctx`` for artifacts, which makes the
      -> export(...)                   core call ``export`` (torch -> ONNX, cached in the artifact store) and
      -> compile(backend, request)     ``compile`` (ONNX -> backend binary, cached) only when not cached yet
    run_stage(backend, stage, handle, inputs)   for every image/prompt (vision, projector, embed; and the
                                                decoder under teacher forcing: logits for given embeddings)
    decode(backend, handle, request)            the generation loop of the decoder stage
    decoder_state(backend, handle)              optional, once per conversation: a state kept between its turns
      -> state.truncate(n), state.decode(request)   per turn: keep the shared prefix, prefill only the new positions
    request_state(backend, handles)             optional, the same for a runtime of whole requests (a bundle's):
      -> state.run(request)                     per turn, the whole conversation; the runtime feeds what is new
    run_request(backend, handles, request)      optional, before the stage-by-stage path of a generation when every
                                                stage is on ``backend``: the whole request in one runtime (a bundle)
    run_stage_batch(backend, stage, handle, inputs)  optional: a stage over a whole data set (``vlmrun eval``)
    load_probe(backend, stage, ctx)             optional: the stage's probe variant (``vlmrun diff --locate``)
    run_probe(backend, stage, handle, inputs)   optional: run it, outputs at layer granularity
    layer_precisions(backend, stage, options)   optional: the per-layer precisions a stage can take
                                                (``vlmrun tune`` writes them into its ``layer_precision`` option)

A deployable bundle (``vlmrun bundle OUT``; the ``bundle:OUT`` layout runs it)::

    write_bundle(backend, request)    the layout's stages compiled (through ``request.context(stage)``, cached in the
                                      store) and written as one folder its runtime loads
    verify_bundle(backend, path, options)   ``vlmrun bundle --verify``: files, hashes, configs, before anything runs
    load_stage(backend, stage, ctx)   ``ctx.bundle`` is the folder: every stage of a bundle layout is on the backend
                                      its manifest (``vlmrun-bundle.json``) names; ``run_request`` then runs requests

Layout options reach a plugin only after the core checked them against what it declared in
``register_options`` (unknown keys, wrong types and values outside the choices are errors before any work).
Handles may be any object; the core reads from them only through :mod:`vlmrun.handles`.
A plugin implementing a hook that is not specified here fails to load (a misspelt hook is never silent).
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("vlmrun")
hookimpl = pluggy.HookimplMarker("vlmrun")


@hookspec
def describe():
    """Say which backends this plugin provides.

    Called once after the plugin is registered.

    :return: a :class:`vlmrun.plugins.BackendInfo` or a list of them (name, stages it can run, summary).
             A plugin that only exports (no backend) may return ``None``.
    """


@hookspec
def doctor():
    """Check this plugin's environment for ``vlmrun doctor``.

    :return: a list of :class:`vlmrun.plugins.Check` (name, ok, detail): runtime versions, libraries found,
             SDK tools, devices. Must not raise and must be quick (no compiling).
    """


@hookspec
def preflight(backend, stage, model, options):
    """Check, before any export or compile, that ``backend`` can run ``stage`` here.

    Called by the core for every stage of a pipeline after the layout is validated and the model opened,
    before any ``load_stage``, so a missing SDK tool or library stops the run before minutes of work.

    :param backend: the backend name; do nothing if it is not yours.
    :param stage: the stage name.
    :param model: the :class:`vlmrun.model.FastVLMModel`.
    :param options: the stage's layout options.
    :return: nothing; raise a :class:`vlmrun.errors.VlmrunError` (one line: what is missing, where you looked,
             what to do) when the stage cannot run.
    """


@hookspec(firstresult=True)
def export(model, stage, form, out_dir):
    """Export one stage of a model to ONNX.

    Called by the core when a plugin's ``load_stage`` asks ``ctx.exported(form)`` and the artifact store has
    no valid copy yet.

    :param model: the :class:`vlmrun.model.FastVLMModel` (``model.load_torch()`` gives the torch model).
    :param stage: ``"vision"``, ``"projector"``, ``"embed"`` or ``"decoder"``.
    :param form: a :class:`vlmrun.stages.ExportForm`: the kind of graph wanted (e.g. ``decoder/kv`` for a
                 growing-KV decoder, ``decoder/fixed`` with ``ar`` and ``ctx`` parameters for NPU backends,
                 ``embed/lut`` for embedding tables) and its parameters.
    :param out_dir: an empty temporary directory (a :class:`pathlib.Path`) to write the files into; the core
                 renames it into the store only if the hook returns normally.
    :return: a dict for the artifact manifest (at least ``{"files": [...]}`` naming the main files, plus
             anything worth recording such as ``inputs``/``outputs``), or ``None`` if this plugin cannot
             export that form.
    """


@hookspec
def register_options(register):
    """Declare the per-stage options of this plugin's backends.

    Called once after the plugin is registered. Call ``register(option)`` with a
    :class:`vlmrun.options.Option` for each: name, type, allowed values, stages, default, help and an optional
    command-line flag. The core validates layout files, flags and ``--option STAGE.KEY=VALUE`` values against
    these declarations before any work, and hands ``load_stage`` (``ctx.options``) and ``compile``
    (``request.stage_options``) the converted values.
    """


@hookspec(firstresult=True)
def compile(backend, request):
    """Compile an exported stage into a backend's own format (e.g. an NPU context binary).

    Called by the core when ``ctx.compiled(...)`` has no valid copy in the store.

    :param backend: the plugin asked to compile: the stage's ``compiler`` option (``--compiler``), which
                    defaults to the stage's backend; return ``None`` if it is not yours.
    :param request: a :class:`vlmrun.stages.CompileRequest`: ``stage``, ``model``, ``source`` (the exported
                    ONNX artifact), ``options`` (those that key the binary), ``stage_options`` (all of the
                    stage's options), ``target`` (the backend that will load the result: another plugin may
                    compile for it), ``out_dir`` (an empty temporary directory, renamed into the store on
                    success), ``artifact`` (the result's stable store name), ``rebuild``, and ``context`` (a
                    :class:`vlmrun.stages.CompileContext`: reference activations for calibration, a state
                    directory that persists across runs, progress).
    :return: a manifest dict (like ``export``), or ``None`` if this plugin does not compile for ``backend``.
    """


@hookspec(firstresult=True)
def load_stage(backend, stage, ctx):
    """Prepare ``stage`` to run on ``backend``: get artifacts, open sessions.

    :param backend: the backend name; return ``None`` if it is not yours.
    :param stage: the stage name.
    :param ctx: a :class:`vlmrun.pipeline.StageContext` with ``model``, ``options``, ``store``,
                ``exported(form)`` and ``compiled(form, ...)`` to get (and cache) artifacts, and
                ``progress(text)`` for long steps.
    :return: any object (a handle) the plugin wants back in ``run_stage`` and ``decode``. Subclass
             :class:`vlmrun.handles.StageHandle` / :class:`vlmrun.handles.DecoderHandle` to report artifacts,
             a fixed ``context_length`` (the core checks prompt lengths against it), device profiles and
             runtime-measured timings.
    """


@hookspec(firstresult=True)
def run_stage(backend, stage, handle, inputs):
    """Run one stage once.

    :param backend: the backend name; return ``None`` if it is not yours.
    :param stage: the stage name.
    :param handle: what ``load_stage`` returned.
    :param inputs: dict of input name -> ``numpy.ndarray`` per the stage contract (:mod:`vlmrun.stages`).
                   For ``decoder`` the input is ``inputs_embeds`` [1, T, hidden] and the output is
                   ``logits`` [1, T, vocab] (a full causal forward from an empty cache: teacher forcing).
    :return: dict of output name -> ``numpy.ndarray`` or :class:`vlmrun.stages.QuantizedTensor` (the core
             dequantizes it at the stage boundary).
    """


@hookspec(firstresult=True)
def run_stage_batch(backend, stage, handle, inputs):
    """Run one stage on many inputs at once (optional; ``vlmrun eval`` asks for it).

    A backend whose every call is expensive on its own (a job on a hosted device, a session on a phone) can run
    a whole data set's worth of a stage in one go. ``vlmrun eval`` calls this once per stage (vision, then the
    projector on those features, then embed) over every pending item of a layout before it runs the items one by
    one; the stage's per-item ``run_stage`` is then not called.

    :param backend: the backend name; return ``None`` if it is not yours, or to decline (the core then calls
                    ``run_stage`` for each input).
    :param stage: the stage name.
    :param handle: what ``load_stage`` returned.
    :param inputs: a list of input dicts, each exactly what ``run_stage`` would get.
    :return: a list of output dicts, one per input and in the same order, as ``run_stage`` returns them.
    """


@hookspec(firstresult=True)
def load_probe(backend, stage, ctx):
    """Load the *probe* variant of ``stage``: the same computation with its layer outputs as extra outputs
    (optional; ``vlmrun diff --locate`` asks for it on both sides of a failing stage).

    Build it like ``load_stage`` from the probe export form: ``ctx.exported(form.probe())`` for any form the
    stage runs (``ExportForm.of("vision").probe()``, the decoder's prefill form ``.probe()``), compiled the same
    way and with the same options as the normal form (``ctx.compiled``; it is cached in the store like any
    artifact). The extra outputs must not change the main path: a quantizing compiler calibrates the probe form
    on the same feeds as the normal one, so every tensor the two graphs share gets the same quantization.

    :param backend: the backend name; return ``None`` if it is not yours or it has no probes (the core then says
                    the stage cannot be located on this backend).
    :param stage: ``vision``, ``projector`` or ``decoder`` (``embed`` is a table lookup with no layers).
    :param ctx: a :class:`vlmrun.pipeline.StageContext`, as for ``load_stage``.
    :return: a handle for ``run_probe``.
    """


@hookspec(firstresult=True)
def run_probe(backend, stage, handle, inputs):
    """Run a probe handle from ``load_probe`` once.

    :param inputs: the stage's contract inputs (as ``run_stage``). For ``decoder``, ``inputs_embeds`` [1,T,H] is
                   a whole teacher-forced sequence: run it as one causal forward from an empty cache (in chunks if
                   the graphs are fixed-size), every row's layer outputs concatenated over the chunks.
    :return: the stage's contract outputs, then one array per probe point keyed by its probe name, in network
             order: the export manifest's ``probe_outputs`` pairs (:func:`vlmrun.stages.probe_outputs` maps a
             graph's outputs to them). Arrays or :class:`vlmrun.stages.QuantizedTensor`.
    """


@hookspec(firstresult=True)
def layer_precisions(backend, stage, options):
    """The per-layer precisions ``stage`` can take at its options' precision, cheapest first (optional; what
    ``vlmrun tune`` searches over).

    A backend that implements it also declares the stage option ``layer_precision`` (a map
    ``LAYER=PRECISION``, entries separated by ``;`` or ``,``; layers named as the probes name them,
    ``decoder.layer0``), and takes every value returned here for every layer its probe reports.

    :param options: the stage's checked options (``precision`` among them).
    :return: the precisions above the stage's own, in increasing bytes on the device (e.g. ``["w8", "a16w16"]``
             for a w4a16 decoder); an empty list when the stage quantizes nothing (fp16); ``None`` if
             ``backend`` is not yours.
    """


@hookspec(firstresult=True)
def decode(backend, handle, request):
    """Generate tokens from prompt embeddings.

    :param backend: the backend name; return ``None`` if it is not yours.
    :param handle: what ``load_stage(backend, "decoder", ...)`` returned.
    :param request: a :class:`vlmrun.stages.DecodeRequest`: ``inputs_embeds`` [1, T, hidden] float32 (image
                    embeddings already spliced in), ``max_new_tokens``, ``sampler`` (a
                    :class:`vlmrun.sampling.Sampler` to pick a token from logits), ``stop_ids``,
                    ``embed_tokens(ids) -> [1, n, hidden]`` to embed generated tokens,
                    ``context_length``, and ``on_logits``: when not ``None``, call it with each step's logits
                    row [vocab] before sampling from it (diffs use these instead of a second forward; a runtime
                    that never sees logits (it samples inside itself) leaves it uncalled), and ``teacher_tokens``:
                    when not ``None``, step k takes ``teacher_tokens[k]`` (``sampler`` already returns them; a
                    runtime that samples inside itself must force them itself, e.g. through a custom sampler callback).
                    A handle whose ``runtime_name`` is set (a runtime other than the engine behind ``run_stage``)
                    must honour both, and may offer ``engine_decode`` (:class:`vlmrun.handles.DecoderHandle`).
    :return: an iterator of generated token ids (ints), yielded as soon as each is known so the core can
             stream text and time the first token. A :class:`vlmrun.handles.DecoderHandle` whose runtime
             measures itself sets ``last_timings`` (e.g. ``ttft_ms``, ``tokens_per_s``) by the end of the
             iteration; those figures replace the host-clock ones.
    """


@hookspec(firstresult=True)
def decoder_state(backend, handle):
    """A new, empty state for one conversation over the loaded decoder, kept between its turns so that a turn
    prefills only its new tokens (``Pipeline.chat``, ``vlmrun chat``, ``vlmrun serve``).

    Call order: ``load_stage`` once; ``decoder_state`` once per conversation; then per turn ``state.truncate(n)``
    and ``state.decode(request)`` with the new positions only (:class:`vlmrun.handles.DecoderState` documents the
    contract). The core never runs two turns on the same state at once, and runs one generation at a time on a
    handle whose backend does not declare it safe to share.

    :param backend: the backend name; return ``None`` if it is not yours.
    :param handle: what ``load_stage(backend, "decoder", ...)`` returned.
    :return: a :class:`vlmrun.handles.DecoderState`, or ``None`` when this decoder cannot continue from a kept
             state (the core then recomputes each turn from the start with ``decode``).
    """


@hookspec(firstresult=True)
def request_state(backend, handles):
    """:func:`decoder_state` for a runtime that runs whole requests (``run_request``): a new
    :class:`vlmrun.handles.RequestState` for one conversation, whose ``run(request)`` takes each turn's whole
    conversation and feeds the runtime only what it does not hold yet; ``None`` when the runtime cannot keep one (the
    core then sends every turn through ``run_request`` from the start).
    """


@hookspec(firstresult=True)
def run_request(backend, handles, request):
    """Run one whole request (image + prompt -> tokens) inside a single runtime (optional).

    Called by a generation before the stage-by-stage path, only when every stage of the layout is on ``backend``
    (e.g. a bundle whose runtime splices the image into the prompt itself). Return ``None`` to decline; the
    core then runs vision, projector, embed and the decoder one by one.

    :param backend: the backend name; return ``None`` if it is not yours.
    :param handles: ``{stage: handle}`` as ``load_stage`` returned them.
    :param request: a :class:`vlmrun.stages.RequestRun` (pixels, token ids, the rendered prompt, the budget, the
                    sampler settings and stop ids, ``tensors`` to fill with what the runtime saw, and
                    ``on_logits`` / ``teacher_tokens`` as for ``decode``: a diff teacher-forces the runtime
                    through them when the decoder handle names a ``runtime_name``).
    :return: an iterator of generated token ids, as ``decode``'s. A decoder handle that measures itself sets
             ``last_timings``.
    """


@hookspec(firstresult=True)
def write_bundle(backend, request):
    """Write the deployable folder of a layout whose every stage is on ``backend`` (``vlmrun bundle OUT``).

    :param backend: the backend name; return ``None`` if it is not yours (the core then says no installed plugin
                    writes bundles for it).
    :param request: a :class:`vlmrun.stages.BundleRequest`: model, layout, ``out_dir`` (an empty temporary folder,
                    renamed to the user's on success), ``target``, ``context(stage, options=None)`` for cached
                    exports and compiles, ``progress``.
    :return: the bundle's manifest (a dict; the plugin writes it into the folder as ``vlmrun-bundle.json``, with at
             least ``backend`` and ``files``).
    """


@hookspec(firstresult=True)
def verify_bundle(backend, path, options):
    """Check a bundle folder written by ``backend``'s ``write_bundle`` before anything runs or is pushed.

    :param path: the folder (a :class:`pathlib.Path`).
    :param options: the checks' settings from the command line (e.g. ``soc``, ``sdk_root`` of the phone's SDK).
    :return: a list of one-line descriptions of what was checked; raise a
             :class:`vlmrun.errors.VlmrunError` (one line) for the first problem.
    """
