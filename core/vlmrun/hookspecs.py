"""The vlmrun plugin API: the hooks a backend plugin implements.

A plugin is a module (usually a separately installed distribution) registered under the entry-point group
``vlmrun``. It implements any of the hooks below with ``@vlmrun.hookimpl``. Built-in and third-party plugins
are loaded the same way (see `vlmrun.plugins`).

Backends are selected *by name*: the core calls every hook but ``describe``, ``register_options``, ``doctor`` and
``export`` with the ``backend`` it wants, and a plugin that does not provide that backend returns ``None`` so the
next plugin is asked (pluggy ``firstresult``; ``preflight`` is the one such hook every plugin gets, and it does
nothing for a backend that is not its own). The helper `vlmrun.plugins.mine` keeps that check to one line.
``export`` has no backend: the first plugin that returns a manifest for the form wins.

Stages are ``vision``, ``projector``, ``embed`` and ``decoder`` (`vlmrun.stages` has their tensor contracts).
The hooks below are grouped by phase, in the order the core calls them. For one plugin and one run::

    registration and environment
    describe()                          once, when the plugin is loaded (the core calls the plugin's own function)
    register_options(register)          right after, once (each backend's per-stage options)
    register_presets(register)          right after, once (the named layouts its backends make)
    register_precisions(register)       right after, once (the precisions its backends build at, with the
                                        thresholds a diff judges them by)
    doctor()                            only for ``vlmrun doctor``

    load a pipeline (``Pipeline.build``: layout checked against the options, images read, model opened)
    preflight(backend, stage, model, options)   every stage, before any work (not for a ``bundle:DIR`` layout)
    load_stage(backend, stage, ctx)     once per stage (vision, projector, embed, decoder), after the prompts'
                                        lengths are checked; the plugin asks ``ctx`` for artifacts:

    build (from inside load_stage, load_probe or write_bundle, only when the store has no valid copy)
      ctx.exported(form)                -> export(model, stage, form, out_dir)    torch -> ONNX
      ctx.compiled(source, options, kind)  -> compile(backend, request)           ONNX -> the backend's binary

    run stages
    run_stage(backend, stage, handle, inputs)   every image/prompt (vision, projector, embed; the decoder under
                                                teacher forcing: logits for given embeddings)
    run_stage_batch(backend, stage, handle, inputs)   optional, ``vlmrun eval``: vision, projector, embed over
                                                every pending item at once, before the items run one by one

    generate (one request)
    run_request(backend, handles, request)      optional, tried first when every stage is on ``backend``: the
                                                whole request in one runtime (a bundle's); ``None``: stage by stage
    decode(backend, handle, request)            otherwise: the decoder's generation loop over the prompt embeddings

    conversations (``Pipeline.chat``, ``vlmrun chat``, ``vlmrun serve``)
    decoder_state(backend, handle)              optional, once per new conversation: a state kept between turns
      -> state.truncate(n), state.decode(request)   per turn: keep the shared prefix, prefill only the new positions
    request_state(backend, handles)             optional, once per new conversation when every stage is on
      -> state.run(request)                     ``backend`` (a bundle's runtime): per turn, the whole conversation

    bundles (``vlmrun bundle OUT``; the ``bundle:OUT`` layout runs one)
    preflight(...)                              every stage, then
    write_bundle(backend, request)              the layout's stages compiled (``request.context(stage)``, cached in
                                                the store) and written as one folder its runtime loads
    verify_bundle(backend, path, options)       ``vlmrun bundle --verify OUT``: files, hashes, configs
    load_stage(backend, stage, ctx)             ``ctx.bundle`` is the folder; ``run_request`` then runs requests

    analysis
    load_probe(backend, stage, ctx)             optional, ``vlmrun diff --locate``: the stage's probe variant
    run_probe(backend, stage, handle, inputs)   run it: outputs at layer granularity
    layer_precisions(backend, stage, options)   optional, ``vlmrun tune``: the per-layer precisions a stage can take
                                                (``vlmrun tune`` writes them into its ``layer_precision`` option)

Layout options reach a plugin only after the core checked them against what it declared in
``register_options`` (unknown keys, wrong types and values outside the choices are errors before any work), and
always as a `vlmrun.options.StageOptions`: converted, every declared option present with its declared default when
the layout does not set it, read-only (``preflight``'s and ``layer_precisions``' ``options``, ``load_stage``'s and
``load_probe``'s ``ctx.options``, ``compile``'s ``request.stage_options``, ``write_bundle``'s
``request.stage_options(stage)``). Read ``options["timeout"]``, with no fallback of your own: the default is the
declaration's. ``options.given`` is what the layout set (key artifacts and write manifests from it); copy with
``dict(options)`` to change them.
Handles may be any object; the core reads from them only through `vlmrun.handles`.
A plugin implementing a hook that is not specified here, or with arguments the spec does not have, fails to load
(a misspelt hook is never silent).
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("vlmrun")
hookimpl = pluggy.HookimplMarker("vlmrun")


# -- registration and environment ---------------------------------------------------------------------------------
# Called on each plugin's own functions (not through the hook relay) when it is loaded; a plugin whose describe or
# register_options raises is skipped with one line in `vlmrun plugins`.


@hookspec
def describe():
    """Say which backends this plugin provides.

    Called once, right after the plugin is registered (before ``register_options``), on this plugin's own
    function; an exception makes the plugin fail to load.

    :return: a `vlmrun.plugins.BackendInfo` or a list of them (``name``, ``stages`` it can run, ``summary``, the
             default ``precision`` of its stages, and ``concurrent``: several generations may run at once on its
             loaded stages). A plugin that only exports (no backend) may return ``None``.
    """


@hookspec
def register_options(register):
    """Declare the per-stage options of this plugin's backends.

    Called once, right after ``describe``, on this plugin's own function. Call ``register(option)`` with a
    `vlmrun.options.Option` for each: backend (one this plugin's ``describe`` named, else the plugin fails to load),
    name, type, allowed values, stages (``None``: every stage the backend runs), default, help and an optional
    command-line flag. The core validates layout files, flags and ``--option STAGE.KEY=VALUE`` values against
    these declarations before any work, and hands ``preflight`` (``options``), ``load_stage`` and ``load_probe``
    (``ctx.options``), ``compile`` (``request.stage_options``), ``write_bundle`` (``request.stage_options(stage)``)
    and ``layer_precisions`` (``options``) the converted values with every declared default filled in, read-only
    (`vlmrun.options.StageOptions`). An option whose default depends on other options declares ``default=None``,
    says the rule in its help, and is derived in one place of the plugin.
    """


@hookspec
def register_presets(register):
    """Name the layouts this plugin's backends make (``--layout NAME``).

    Called once, right after ``register_options``, on this plugin's own function. Call ``register(preset)`` with a
    `vlmrun.plugins.Preset` for each: its ``name``, the backend of every stage (``stages``: one for each of
    vision, projector, embed and decoder; a preset may name another plugin's backend, checked when it is used), a
    ``summary`` for ``vlmrun plugins``, and ``reference=True`` for the one layout other layouts are diffed and
    scored against (the core's default layout, ``reference``; one plugin declares it). Two plugins declaring the
    same name: the second fails to load.
    """


@hookspec
def register_precisions(register):
    """Name the precisions this plugin's backends build at, with the default thresholds ``vlmrun diff`` and
    ``vlmrun eval`` judge a device at each by.

    Called once, right after ``register_presets``, on this plugin's own function. Call ``register(precision)`` with
    a `vlmrun.plugins.Precision` for each: its ``name`` (the value of a stage's ``precision`` option), the floors of
    every tensor checkpoint (``sqnr_db``, ``cosine``), of the decoder under teacher forcing (``top1``, ``top5``,
    ``kl``), ``generation`` (the share of the reference's free-running tokens the device must match, ``None`` when
    a precision may legitimately diverge), or ``like`` another declared precision whose figures it shares. The
    core declares ``fp32`` itself (two correct float32 implementations). Plugins that share a vocabulary may
    declare the same precision with the same values; other values under a taken name fail the second plugin.
    """


@hookspec
def doctor():
    """Check this plugin's environment for ``vlmrun doctor``.

    Called only by ``vlmrun doctor``, once per loaded plugin, on this plugin's own function (what it prints to
    stdout goes to stderr).

    :return: a list of `vlmrun.plugins.Check` (name, ok, detail): runtime versions, libraries found,
             SDK tools, devices. Must not raise and must be quick (no compiling).
    """


# -- load a pipeline: preflight, then load_stage per stage ---------------------------------------------------------


@hookspec
def preflight(backend, stage, model, options):
    """Check, before any export or compile, that ``backend`` can run ``stage`` here.

    Not ``firstresult``: every plugin's ``preflight`` is called, each doing nothing for a backend that is not its
    own. ``Pipeline.build`` calls it for every stage of the pipeline after the layout is validated, the requests'
    images read and the model opened, before any ``load_stage`` (a ``bundle:DIR`` layout skips it: its runtime
    checks itself as it loads); ``vlmrun bundle`` calls it for every stage before ``write_bundle``. So a missing
    SDK tool or library stops the run before minutes of work.

    :param backend: the backend name; do nothing if it is not yours.
    :param stage: the stage name.
    :param model: the `vlmrun.model.FastVLMModel`.
    :param options: the stage's options: a `vlmrun.options.StageOptions` (checked, every declared default filled
                    in, read-only; ``options.given`` what the layout set).
    :return: nothing (the core ignores it); raise a `vlmrun.errors.VlmrunError` (one line: what is missing, where
             you looked, what to do) when the stage cannot run.
    """


@hookspec(firstresult=True)
def load_stage(backend, stage, ctx):
    """Prepare ``stage`` to run on ``backend``: get artifacts, open sessions.

    Called by ``Pipeline.build`` once per stage, in stage order (vision, projector, embed, decoder), after
    ``preflight`` and the check that the requests' prompts fit the context.

    :param backend: the backend name; return ``None`` if it is not yours (no plugin loading it is an error).
    :param stage: the stage name.
    :param ctx: a `vlmrun.pipeline.StageContext` with ``backend``, ``stage``, ``model``, ``options`` (the stage's
                options: a `vlmrun.options.StageOptions`, every declared default filled in), ``store``, ``registry``, ``rebuild``, ``bundle`` (the bundle folder of a
                ``bundle:DIR`` layout, else ``None``), ``progress(label)`` (a context manager for long steps), and
                two methods that get artifacts from the store, building them when missing:
                ``exported(form)`` -> the ONNX export of an `vlmrun.stages.ExportForm` (the ``export`` hook), and
                ``compiled(source, options, kind)`` -> ``source`` (an artifact, usually from ``exported``)
                compiled by the stage's ``compiler`` (the ``compile`` hook). ``options`` (a dict) are the settings
                that change the binary: they key the artifact and reach ``compile`` as ``request.options`` (build
                them from what changes the binary, never from every option: a default filled in must not key a
                new artifact).
                ``kind`` is a `vlmrun.stages.ArtifactKind` (what was compiled, at which precision, for which
                target: ``ArtifactKind.of(form, precision, soc)``): it keys the artifact, names it in the store and
                the compile in the progress line, and is not passed to ``compile``.
    :return: any object (a handle) the plugin wants back in ``run_stage``, ``decode`` and the other hooks that
             take a handle. Subclass `vlmrun.handles.StageHandle` / `vlmrun.handles.DecoderHandle` to report
             artifacts, a fixed ``context_length`` (the core checks prompt lengths against it), device profiles and
             runtime-measured timings.
    """


# -- build: export and compile (asked for from inside load_stage, load_probe and write_bundle) ---------------------


@hookspec(firstresult=True)
def export(model, stage, form, out_dir):
    """Export one stage of a model to ONNX.

    Called by the core when ``ctx.exported(form)`` (from ``load_stage``, ``load_probe`` or a bundle's
    ``request.context(stage)``) or the core itself (the ``embed/lut`` table it embeds generated tokens with) needs
    a form the artifact store has no valid copy of. There is no ``backend`` argument: the first plugin that returns
    a manifest wins (``ort_reference`` exports every stage).

    :param model: the `vlmrun.model.FastVLMModel` (``model.load_torch()`` gives the torch model).
    :param stage: ``"vision"``, ``"projector"``, ``"embed"`` or ``"decoder"`` (``form.stage``).
    :param form: a `vlmrun.stages.ExportForm`: the kind of graph wanted (e.g. ``decoder/kv`` for a
                 growing-KV decoder, ``decoder/fixed`` with ``ar`` and ``ctx`` parameters for NPU backends,
                 ``embed/lut`` for embedding tables) and its parameters (``probe`` for a probe form).
    :param out_dir: an empty temporary directory (a `pathlib.Path`) to write the files into; the core
                 renames it into the store only if the hook returns normally.
    :return: a dict for the artifact manifest (at least ``{"files": [...]}`` naming the main files, plus
             anything worth recording such as ``inputs``/``outputs``), or ``None`` if this plugin cannot
             export that form (no plugin exporting it is an error).
    """


@hookspec(firstresult=True)
def compile(backend, request):
    """Compile an exported stage into a backend's own format (e.g. an NPU context binary).

    Called by the core when a plugin's ``ctx.compiled(source, options, kind)`` finds no valid copy in the store
    (the artifact is keyed by stage, target backend, compiler, ``kind``, source, ``options``, the versions of the
    plugins that implement ``compile`` and, when another plugin compiles, that compiler's keyed options).

    :param backend: the plugin asked to compile: the stage's ``compiler`` option (``--compiler``), which
                    defaults to the stage's backend; return ``None`` if it is not yours (no plugin compiling it is
                    an error).
    :param request: a `vlmrun.stages.CompileRequest`: ``stage``, ``model``, ``source`` (the exported
                    ONNX artifact), ``options`` (those that key the binary: what the loading plugin passed to
                    ``ctx.compiled``), ``stage_options`` (all of the stage's options, filled and frozen: a
                    `vlmrun.options.StageOptions`), ``target`` (the backend that
                    will load the result: another plugin may compile for it), ``compiler`` (``backend``),
                    ``out_dir`` (an empty temporary directory, renamed into the store on success), ``artifact``
                    (the result's stable store name), ``rebuild``, and ``context`` (a
                    `vlmrun.stages.CompileContext`: reference activations for calibration, a state
                    directory that persists across runs, progress).
    :return: a manifest dict (like ``export``), or ``None`` if this plugin does not compile for ``backend``.
    """


# -- run stages ----------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def run_stage(backend, stage, handle, inputs):
    """Run one stage once.

    Called by ``Pipeline.run_stage`` for every image and prompt (vision, projector, embed; the decoder for its
    teacher-forced logits: a diff's capture, ``vlmrun profile``), with the inputs checked against the stage
    contract.

    :param backend: the backend name; return ``None`` if it is not yours (no plugin running it is an error).
    :param stage: the stage name.
    :param handle: what ``load_stage`` returned.
    :param inputs: dict of input name -> ``numpy.ndarray`` per the stage contract (`vlmrun.stages`).
                   For ``decoder`` the input is ``inputs_embeds`` [1, T, hidden] and the output is
                   ``logits`` [1, T, vocab] (a full causal forward from an empty cache: teacher forcing).
    :return: dict of output name -> ``numpy.ndarray`` or `vlmrun.stages.QuantizedTensor` (the core
             dequantizes it at the stage boundary and checks every contract output is there).
    """


@hookspec(firstresult=True)
def run_stage_batch(backend, stage, handle, inputs):
    """Run one stage on many inputs at once (optional; ``vlmrun eval`` asks for it).

    A backend whose every call is expensive on its own (a job on a hosted device, a session on a phone) can run
    a whole data set's worth of a stage in one go. ``vlmrun eval`` calls this, when the plugin providing the
    stage's backend implements it, once per stage (vision, then the projector on those features, then embed)
    over every pending single-turn item of a layout before it runs the items one by one; the stage's per-item
    ``run_stage`` is then not called (a conversation's turns still go through ``run_stage``).

    :param backend: the backend name; return ``None`` if it is not yours, or to decline (the core then calls
                    ``run_stage`` for each input).
    :param stage: ``vision``, ``projector`` or ``embed``.
    :param handle: what ``load_stage`` returned.
    :param inputs: a list of input dicts, each exactly what ``run_stage`` would get (checked against the contract).
    :return: a list of output dicts, one per input and in the same order, as ``run_stage`` returns them (a list
             of another length is an error).
    """


# -- generate: a whole request in one runtime, else the decoder's loop ---------------------------------------------


@hookspec(firstresult=True)
def run_request(backend, handles, request):
    """Run one whole request (image + prompt -> tokens) inside a single runtime (optional).

    Called by a generation before the stage-by-stage path, only when every stage of the layout is on ``backend``
    (e.g. a bundle whose runtime splices the image into the prompt itself); a conversation's turn tries it only
    when it keeps no ``decoder_state`` and no ``request_state``, and has one picture. Return ``None`` to decline;
    the core then runs vision, projector, embed and the decoder one by one.

    :param backend: the backend name; return ``None`` if it is not yours.
    :param handles: ``{stage: handle}`` as ``load_stage`` returned them.
    :param request: a `vlmrun.stages.RequestRun` (pixels, token ids, the rendered prompt, the budget, the
                    sampling settings and stop ids, ``tensors`` to fill with what the runtime saw, and
                    ``on_logits`` / ``teacher_tokens`` as for ``decode``: a diff teacher-forces the runtime
                    through them when the decoder handle names a ``runtime_name``).
    :return: an iterator of generated token ids, as ``decode``'s. A decoder handle that measures itself sets
             ``last_timings``.
    """


@hookspec(firstresult=True)
def decode(backend, handle, request):
    """Generate tokens from prompt embeddings.

    Called by a generation when ``run_request`` declined (or the stages are on several backends), by a
    conversation's turn when the decoder keeps no state (the whole history, every turn), and by ``vlmrun diff`` to
    teacher-force the decoder step by step (``on_logits`` and ``teacher_tokens`` set).

    :param backend: the backend name; return ``None`` if it is not yours.
    :param handle: what ``load_stage(backend, "decoder", ...)`` returned.
    :param request: a `vlmrun.stages.DecodeRequest`: ``inputs_embeds`` [1, T, hidden] float32 (image
                    embeddings already spliced in), ``max_new_tokens``, ``sampler`` (a
                    `vlmrun.sampling.Sampler` to pick a token from logits), ``stop_ids``,
                    ``embed_tokens(ids) -> [1, n, hidden]`` to embed generated tokens,
                    ``context_length``, and ``on_logits``: when not ``None``, call it with each step's logits
                    row [vocab] before sampling from it (diffs use these instead of a second forward; a runtime
                    that never sees logits (it samples inside itself) leaves it uncalled), and ``teacher_tokens``:
                    when not ``None``, step k takes ``teacher_tokens[k]`` (``sampler`` already returns them; a
                    runtime that samples inside itself must force them itself, e.g. through a custom sampler callback).
                    A handle whose ``runtime_name`` is set (a runtime other than the engine behind ``run_stage``)
                    must honour both, and may offer ``engine_decode`` (`vlmrun.handles.DecoderHandle`).
    :return: an iterator of generated token ids (ints), yielded as soon as each is known so the core can
             stream text and time the first token. The core stops reading (and closes the iterator) at a stop id,
             after ``max_new_tokens`` tokens or when its caller stops. A `vlmrun.handles.DecoderHandle` whose
             runtime measures itself sets ``last_timings`` (e.g. ``ttft_ms``, ``tokens_per_s``) by the end of the
             iteration; those figures replace the host-clock ones.
    """


# -- conversations: a state kept between turns ---------------------------------------------------------------------


@hookspec(firstresult=True)
def decoder_state(backend, handle):
    """A new, empty state for one conversation over the loaded decoder, kept between its turns so that a turn
    prefills only its new tokens (``Pipeline.chat``, ``vlmrun chat``, ``vlmrun serve``).

    Call order: ``load_stage`` once; ``decoder_state`` once per new conversation; then per turn
    ``state.truncate(n)`` and ``state.decode(request)`` with the new positions only (`vlmrun.handles.DecoderState`
    documents the contract). A conversation with a decoder state goes stage by stage, never through
    ``run_request``. The core never runs two turns on the same state at once, and runs one generation at a time on
    a handle whose backend does not declare it safe to share.

    :param backend: the backend name; return ``None`` if it is not yours.
    :param handle: what ``load_stage(backend, "decoder", ...)`` returned.
    :return: a `vlmrun.handles.DecoderState`, or ``None`` when this decoder cannot continue from a kept
             state (the core then recomputes each turn from the start with ``decode``).
    """


@hookspec(firstresult=True)
def request_state(backend, handles):
    """`decoder_state` for a runtime that runs whole requests (``run_request``).

    Called once per new conversation, beside ``decoder_state``, only when every stage of the layout is on
    ``backend``; used for a turn when there is no decoder state and the conversation has one picture. Per turn the
    core calls ``state.run(request)`` with a `vlmrun.stages.RequestRun` holding the whole conversation (no
    ``on_logits`` or ``teacher_tokens``); the state feeds the runtime only what it does not hold yet
    (`vlmrun.handles.RequestState` documents the contract).

    :param backend: the backend name; return ``None`` if it is not yours.
    :param handles: ``{stage: handle}`` as ``load_stage`` returned them.
    :return: a new `vlmrun.handles.RequestState`, or ``None`` when the runtime cannot keep one (the core then sends
             every turn through ``run_request`` from the start).
    """


# -- bundles: a deployable folder, run by its own runtime ----------------------------------------------------------


@hookspec(firstresult=True)
def write_bundle(backend, request):
    """Write the deployable folder of a layout whose every stage is on ``backend`` (``vlmrun bundle OUT``).

    Called once, after ``preflight`` for every stage; the core then runs ``vlmrun eval`` on the folder (a
    ``local`` target) and writes the returned manifest, with its ``verified`` figures added, into it again.

    :param backend: the backend name; return ``None`` if it is not yours (the core then says no installed plugin
                    writes bundles for it).
    :param request: a `vlmrun.stages.BundleRequest`: model, layout, ``out_dir`` (an empty temporary folder,
                    renamed to the user's on success), ``target``, ``context(stage, options=None)`` for cached
                    exports and compiles, ``stage_options(stage)`` (the stage's options filled and frozen, as
                    ``load_stage`` reads them; ``layout`` keeps what the user set, which the manifest records),
                    ``progress``.
    :return: the bundle's manifest (a dict with at least ``backend`` and ``files``); the plugin also writes it into
             the folder as ``vlmrun-bundle.json``, which loading the folder (and so its verification) reads.
    """


@hookspec(firstresult=True)
def verify_bundle(backend, path, options):
    """Check a bundle folder written by ``backend``'s ``write_bundle`` before anything runs or is pushed.

    Called only by ``vlmrun bundle --verify OUT``, with the ``backend`` the folder's ``vlmrun-bundle.json`` names.

    :param backend: the backend name; return ``None`` if it is not yours (the core then says no installed plugin
                    verifies its bundles).
    :param path: the folder (a `pathlib.Path`).
    :param options: the checks' settings from the command line: ``{key: value}`` from the stage option flags
                    (e.g. ``--soc``) and ``-o STAGE.KEY=VALUE`` (the stage dropped; the value a string, not checked
                    against the declarations, no default filled in), e.g. ``soc``, ``sdk_root`` of the phone's SDK.
    :return: a list of one-line descriptions of what was checked; raise a
             `vlmrun.errors.VlmrunError` (one line) for the first problem.
    """


# -- analysis: layer probes (``vlmrun diff --locate``) and layer precisions (``vlmrun tune``) -----------------------


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
    :param ctx: a `vlmrun.pipeline.StageContext`, as for ``load_stage`` (a new one, ``rebuild`` off).
    :return: a handle for ``run_probe``. A decoder probe handle may also offer (read with ``getattr``) ``parts``,
             the layer ranges ``[(lo, hi), ...]`` of a decoder split into parts, and ``inside(k)``, a probe handle
             whose ``run_probe`` also reports the layers inside part ``k`` (``--locate`` probes the worst part).
    """


@hookspec(firstresult=True)
def run_probe(backend, stage, handle, inputs):
    """Run a probe handle from ``load_probe`` once.

    :param backend: the backend name; return ``None`` if it is not yours.
    :param stage: the stage name, as for ``load_probe``.
    :param handle: what ``load_probe`` returned (or a decoder handle's ``inside(k)``).
    :param inputs: the stage's contract inputs (as ``run_stage``). For ``decoder``, ``inputs_embeds`` [1,T,H] is
                   a whole teacher-forced sequence: run it as one causal forward from an empty cache (in chunks if
                   the graphs are fixed-size), every row's layer outputs concatenated over the chunks. On the
                   reference side ``--locate`` also passes ``inject:<probe name>`` arrays: add each to that probe
                   point's output before anything reads it (a backend that ignores them makes ``--locate`` say
                   each layer's own error is not known).
    :return: the stage's contract outputs, then one array per probe point keyed by its probe name, in network
             order: the export manifest's ``probe_outputs`` pairs (`vlmrun.stages.probe_outputs` maps a
             graph's outputs to them). Arrays or `vlmrun.stages.QuantizedTensor` (the core dequantizes them).
    """


@hookspec(firstresult=True)
def layer_precisions(backend, stage, options):
    """The per-layer precisions ``stage`` can take at its options' precision, cheapest first (optional; what
    ``vlmrun tune`` searches over).

    Called by ``vlmrun tune`` once per stage with layers (vision, projector, decoder) of its base layout, before
    anything is built; a stage with an empty answer is not tuned. A backend that implements it also declares the
    stage option ``layer_precision`` (`vlmrun.stages.LAYER_PRECISION`: a map ``LAYER=PRECISION``, entries separated
    by ``;`` or ``,``; layers named as the probes name them, ``decoder.layer0``), and takes every value returned here
    for every layer its probe reports. The same option is the one per-layer contract of ``vlmrun diff --what-if``,
    which sets a located layer to ``fp16`` (kept out of quantization) or to a precision returned here.

    :param backend: the backend name; return ``None`` if it is not yours.
    :param stage: ``vision``, ``projector`` or ``decoder``.
    :param options: the stage's options, filled and frozen (a `vlmrun.options.StageOptions`: ``precision`` is
                    the declared default when the layout does not set it).
    :return: the precisions above the stage's own, in increasing bytes on the device (e.g. 8-bit weights,
             then 16-bit activations and weights, for a decoder at 4-bit weights); an empty list when the stage quantizes nothing (fp16); ``None`` if
             ``backend`` is not yours.
    """
