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
    preflight(backend, stage, ...)   before any work: can this backend run here at all (SDK, libraries)?
    load_stage(backend, stage, ctx)  once per pipeline; the plugin asks ``ctx`` for artifacts, which makes the
      -> export(...)                   core call ``export`` (torch -> ONNX, cached in the artifact store) and
      -> compile(...)                  ``compile`` (ONNX -> backend binary, cached) only when not cached yet
    run_stage(backend, stage, handle, inputs)   for every image/prompt (vision, projector, embed; and the
                                                decoder under teacher forcing: logits for given embeddings)
    decode(backend, handle, request)            the generation loop of the decoder stage
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


@hookspec(firstresult=True)
def compile(backend, stage, model, source, options, out_dir, target, stage_options, artifact, rebuild, store,
            registry):
    """Compile an exported stage into a backend's own format (e.g. a QNN context binary).

    Called by the core when ``ctx.compiled(...)`` has no valid copy in the store.

    :param backend: the plugin asked to compile: the stage's ``compiler`` option (``--compiler``), which
                    defaults to the stage's backend; return ``None`` if it is not yours.
    :param target: the backend that will load the result (equal to ``backend`` unless another plugin
                   compiles for it, e.g. ``qaihub`` compiling context binaries that ``qnn_htp`` runs).
    :param stage: the stage name.
    :param model: the :class:`vlmrun.model.FastVLMModel`.
    :param source: the :class:`vlmrun.store.Artifact` of the exported ONNX stage.
    :param options: a dict of per-stage options from the layout (precision, soc, context_length, ...).
    :param out_dir: an empty temporary directory to write into (renamed into the store on success).
    :param stage_options: all of the stage's layout options (``options`` is the subset that keys the binary),
                          e.g. a remote compiler's device name or timeout.
    :param artifact: the name the result will have in the store (stable across runs: a remote compiler can
                     use it to find a job an interrupted run submitted).
    :param rebuild: ``True`` when the user asked to rebuild (``--rebuild``), so cached remote results are stale.
    :param store: the :class:`vlmrun.store.ArtifactStore` and ``registry`` the loaded plugins, for a compiler
                  that needs other stages' results (e.g. int8 calibration on reference activations).
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
    :return: any object (a handle) the plugin wants back in ``run_stage`` and ``decode``. A decoder handle
             with a fixed context (compiled graphs) exposes it as ``handle.context_length``; the core checks
             prompt lengths against it.
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
                    that never sees logits, like Genie, leaves it uncalled).
    :return: an iterator of generated token ids (ints), yielded as soon as each is known so the core can
             stream text and time the first token. A handle whose runtime measures itself may set
             ``handle.last_timings`` (e.g. ``ttft_ms``, ``tokens_per_s``) by the end of the iteration; those
             figures replace the host-clock ones.
    """
