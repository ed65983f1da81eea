"""Running the decoder's parts form: the host engine and the Genie engine over the part binaries of one artifact.

* `PartsHandle`: vlmrun's host loop (`.genie_engine.GenieLayoutDecoder`) over every part's graphs,
  the parts of one AR chained as one graph (`Chain`); what diffs and teacher forcing use;
* `GeniePartsHandle` (engine ``genie``): libGenie in its worker process decodes over the part binaries,
  ``ctx-bins`` in part order.

Weight-shared binaries on this machine: the HTP emulator inside onnxruntime-qnn 2.7.0 (QNN 2.51, libQnnHtp.so
on x86_64) refuses them in ``QnnContext_createFromBinary`` with "<E> Shared weights buffer isn't supported on this
platform" / "Fail to create context from binary with err 1000" (QNN_COMMON_ERROR_NOT_SUPPORTED), then calls a
NULL function pointer while cleaning up the half-made context: a segfault, through onnxruntime and through
libGenie alike. ``QnnContext_createFromBinaryListAsync`` (``htp_share_resource_optimization``) is not supported
by that backend either. So vlmrun never opens a weight-shared binary on the emulator: it says so in one line
(`check_loadable`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vlmrun.errors import BackendError
from vlmrun.handles import DecoderHandle
from vlmrun_qualcomm.manifest import ContextManifest

from . import ep
from .ep import is_emulator

EMULATOR_REFUSAL = ("the x86_64 HTP emulator of onnxruntime-qnn cannot load weight-shared context binaries (QNN:"
                    " \"Shared weights buffer isn't supported on this platform\", contextCreateFromBinary error"
                    " 1000, then a crash in its cleanup)")


class Chain:
    """The parts of one AR run in order as one graph (``run(feeds) -> outputs``), feeds recorded per part on the
    calls ``keep`` selects."""

    def __init__(self, runners: list, keep=None, clip: float | None = None):
        self.runners, self.keep, self.clip = runners, keep, clip
        self.calls = 0
        self.recorded: list[list[dict]] = [[] for _ in runners]

    def run(self, feeds: dict) -> dict:
        record = self.keep is not None and self.calls in self.keep
        self.calls += 1
        values, out = dict(feeds), {}
        for i, r in enumerate(self.runners):
            f = {n: values[n] for n in r.input_names}
            if record:
                copy = {k: np.array(v, copy=True) for k, v in f.items()}
                if self.clip is not None and "attention_mask" in copy:
                    copy["attention_mask"] = np.maximum(copy["attention_mask"], np.float32(self.clip))
                self.recorded[i].append(copy)
            res = r.run(f)
            values.update(res)
            out.update(res)
        return out



def check_loadable(manifest: dict, what: str = "decoder") -> None:
    """Refuse, in one line, to open weight-shared part binaries on the x86_64 HTP emulator (it would crash)."""
    d = manifest.get("decoder_parts") or {}
    if d.get("weight_sharing") and is_emulator():
        raise BackendError(f"{what}: these part binaries share weights between their prompt and token graphs;"
                           f" {EMULATOR_REFUSAL}. Run them on a device (Genie), or compile with weight_sharing ="
                           " \"off\" to run the same graphs one per binary here")


class HtpGraph:
    """One part graph on the local HTP; ``encodings``: inputs that are quantized in the graph (a bundle's
    ``inputs_embeds``), quantized here as Genie quantizes them."""

    def __init__(self, path: Path, soc, what: str, encodings: dict | None = None):
        self.session = ep.HtpSession(path, soc, what)
        self.input_names = list(self.session.inputs)
        self.load_s = self.session.load_s
        self.encodings = dict(encodings or {})

    def run(self, feeds: dict) -> dict:
        if self.encodings:
            from .image_encoder import quantize_values

            feeds = {k: quantize_values(v, self.encodings[k]) if k in self.encodings else v for k, v in feeds.items()}
        return self.session.run(feeds)


def open_chains(artifact, soc) -> tuple[dict, float]:
    """{AR: a chain running every part's graph of that AR on the local HTP}, load seconds: the prompt, token and
    (when compiled) follow-up graphs."""
    d = artifact.manifest["decoder_parts"]
    check_loadable(artifact.manifest)
    chains, load_s = {}, 0.0
    for kind in d["parts"][0]["graphs"]:
        runners = []
        for p in d["parts"]:
            g = p["graphs"][kind]
            enc = {"inputs_embeds": d["embeds_input"]} if d.get("embeds_input") and p["index"] == 1 else None
            r = HtpGraph(artifact.path / g["wrapper"], soc, f"decoder part {p['index']}/{d['count']} ({kind})", enc)
            load_s += r.load_s
            runners.append(r)
        chains[int(d["parts"][0]["graphs"][kind]["ar"])] = Chain(runners)
    return chains, load_s


class PartsHandle(DecoderHandle):
    """The decoder stage in the parts form, run by the host engine (``decoder``: vlmrun's loop over every part's
    graphs; a prompt's rows go to the smallest prompt graph covering them, `.genie_engine.GenieLayoutDecoder`).
    Sessions open on first use, so compiling, and refusing a weight-shared binary the emulator cannot load, happen
    without opening them. ``calls_per_ar``: the graph calls the host engine made, per AR."""

    def __init__(self, model, artifact, soc):
        from vlmrun_qualcomm import genie_config

        self.model, self.artifact, self.soc = model, artifact, soc
        self.artifacts = [artifact]
        self.parts = artifact.manifest["decoder_parts"]
        self.ctx = int(self.parts["ctx"])
        self.facts = genie_config.GenieModel.from_model(model)
        self.ctx_bins = [str(artifact.path / b) for b in self.parts["binaries_in_order"]]
        self._host = None
        self.load_s = 0.0
        self.last_timings: dict = {}

    @property
    def context_length(self) -> int:
        return self.ctx

    @property
    def calls_per_ar(self) -> dict[int, int]:
        """``{AR: calls}`` of the host engine since the handle opened its graphs (none before)."""
        return dict(self._host.steps) if self._host is not None else {}

    @property
    def decoder(self):
        if self._host is None:
            from .genie_engine import GenieLayoutDecoder

            chains, self.load_s = open_chains(self.artifact, self.soc)
            self._host = GenieLayoutDecoder(chains, self.ctx, self.facts)
        return self._host


class GeniePartsHandle(PartsHandle):
    """Engine ``genie``: Genie (libGenie, in its worker process) decodes over the part binaries, ``ctx-bins`` in
    part order; ``decoder`` (teacher forcing, diffs) stays the host engine over the same binaries."""

    def __init__(self, model, artifact, soc, lut_npy: Path, timeout: float = 600.0):
        from vlmrun_qualcomm import genie_binding, genie_worker

        from .genie_engine import libgenie_path

        super().__init__(model, artifact, soc)
        self.lut_npy = Path(lut_npy)
        self.timeout = float(timeout)
        self.lib = genie_binding.GenieLibrary(libgenie_path())
        self.runtime_name = genie_worker.RUNTIME_NAME

    def engine_decode(self, request):
        """The host engine over the same part binaries, step by step as Genie runs them (for diffs)."""
        return self.decoder.generate(request)

    def config(self, request) -> dict:
        from vlmrun_qualcomm import genie_config

        from .genie_engine import GenieHtpHandle

        stops = sorted(request.stop_ids) if request.stop_ids else [GenieHtpHandle._never_token(self)]
        return genie_config.dialog_config(
            self.facts, "QnnHtp", tokenizer=self.model.path / "tokenizer.json", context_size=self.ctx,
            sampling=getattr(request.sampler, "settings", None), max_new_tokens=request.max_new_tokens,
            ctx_bins=self.ctx_bins, eos=stops)

    def dialog_config(self, request) -> dict:
        """`config` for a dialog about to run here: the binaries must load on this machine."""
        check_loadable(self.artifact.manifest, "decoder (Genie)")
        return self.config(request)

    def genie_generate(self, request):
        from vlmrun.errors import InputError
        from vlmrun_qualcomm import genie_worker

        check_loadable(self.artifact.manifest, "decoder (Genie)")
        limit = min(int(request.context_length or self.ctx), self.ctx)
        if request.inputs_embeds.shape[1] >= limit:
            raise InputError(f"the prompt is {request.inputs_embeds.shape[1]} tokens but the compiled decoder"
                             f" context holds {limit}; compile the decoder with a larger context_length")
        self.last_timings = {}
        yield from genie_worker.stream_tokens_worker(self.lib.path, self.config(request), request.inputs_embeds,
                                                     self.lut_npy, timeout=self.timeout, profile_out=self.last_timings,
                                                     **genie_worker.tap_arguments(request, self.model))


def load_parts(ctx, plan, artifact) -> PartsHandle:
    """The handle of a compiled parts artifact (``load_stage``; ``plan``: the decoder's `.plan.StagePlan`)."""
    from vlmrun.stages import ExportForm

    if "decoder_parts" not in artifact.manifest:
        raise BackendError(f"decoder artifact {artifact.path.name} is not a parts artifact; compile it again with"
                           " --rebuild")
    ContextManifest.from_dict(artifact.manifest, f"decoder artifact {artifact.path.name}")
    soc = plan.soc
    ep.check_binary(artifact.manifest, artifact.file(), soc, f"decoder ({artifact.path.name})")
    if plan.engine == "genie":
        lut = ctx.exported(ExportForm.of("embed", "embed/lut")).file("embed_lut_f32.npy")
        return GeniePartsHandle(ctx.model, artifact, soc, lut, plan.runtime.timeout)
    return PartsHandle(ctx.model, artifact, soc)
