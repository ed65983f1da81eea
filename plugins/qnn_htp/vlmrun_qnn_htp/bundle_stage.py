"""The stages of a ``bundle:DIR`` layout: what ``load_stage`` returns for each stage (`BundleStage`, one
`.bundle_run.BundleRuntime` shared by them) and the ``run_request`` hook that hands a whole request to that runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from vlmrun.errors import BackendError, UsageError
from vlmrun.handles import DecoderHandle

from .bundle import sha256
from .bundle_run import BundleRuntime

_RUNTIMES: dict[tuple, BundleRuntime] = {}


class BundleFiles:
    """The bundle's files as the one artifact its decoder stage reports: ``binary_bytes`` is every file the device
    holds (binaries, token table, configs, tokenizer), so ``vlmrun eval`` reports a bundle's bytes on the device."""

    def __init__(self, runtime: BundleRuntime):
        self.path = runtime.path
        self.manifest = {"binary_bytes": {name: int(f["bytes"]) for name, f in runtime.manifest["files"].items()}}


class BundleStage(DecoderHandle):
    """One stage of a ``bundle:DIR`` layout. The bundle runs whole requests (``run_request``); a single stage runs
    only where the bundle's own binary can be driven alone: the decoder (teacher forcing, for diffs) by vlmrun's host
    engine over the store's compile whose binaries are byte-identical to the bundle's. The decoder's
    ``runtime_name`` says Genie's pipeline generates (a diff then teacher-forces Genie too, through its custom
    sampler); on a phone genie-app hands out no logits, and the runtime is not named."""

    def __init__(self, runtime: BundleRuntime, stage: str, ctx):
        self.runtime, self.stage, self.ctx = runtime, stage, ctx
        self.artifacts = [BundleFiles(runtime)] if stage == "decoder" else []
        self.load_s = 0.0
        self._decoder = None
        if stage == "decoder" and runtime.phone is None:
            self.runtime_name = "Genie's pipeline (libGenie)"

    @property
    def context_length(self) -> int:
        return int(self.runtime.manifest["context_length"])

    @property
    def last_timings(self) -> dict:
        return self.runtime.last_timings

    @property
    def decoder(self):
        if self._decoder is None:
            self._decoder = self._store_twin().decoder
        return self._decoder

    def _store_twin(self):
        """The parts handle over the store artifact the bundle's decoder was copied from, when its binaries are
        byte-identical to the bundle's."""
        from vlmrun_qualcomm import socs

        from .parts_run import PartsHandle

        m = self.runtime.manifest
        art = self.ctx.store.artifact(m["decoder"]["source"])
        if art is None:
            raise BackendError(f"bundle {self.runtime.path.name}: the decoder runs alone (teacher forcing) only with"
                               f" the store's compile it came from ({m['decoder']['source']}), which this store does"
                               " not hold; diff the bundle where it was written")
        for b in art.manifest["decoder_parts"]["binaries_in_order"]:
            if sha256(art.path / b) != m["files"][b.replace("_qnn.bin", ".bin")]["sha256"]:
                raise BackendError(f"bundle {self.runtime.path.name}: {b} in the store differs from the bundle's copy")
        return PartsHandle(self.runtime.model, art, socs.soc(m["soc"]))

    def engine_decode(self, request):
        """vlmrun's host engine over the bundle's decoder binaries (the store's byte-identical compile), step by step
        as Genie runs them: the smallest prompt graph covering the prompt (AR-128, or the follow-up AR-32), then the
        token graph per token."""
        return self.decoder.generate(request) if self.stage == "decoder" else None

    def run(self, inputs: dict) -> dict:
        raise BackendError(f"a bundle runs its {self.stage} stage only inside whole requests (Genie's pipeline fuses"
                           " vision and projector into its image encoder); run the bundle with --image/--prompt, or"
                           " diff the layout it was written from")


def load_bundle_stage(stage: str, ctx) -> BundleStage:
    from .bundle_phone import RUNTIME_OPTIONS

    fixed = sorted(set(ctx.options.given) - RUNTIME_OPTIONS)  # what the layout set, not the filled defaults
    if fixed:
        raise UsageError(f"a bundle runs as it was written: {', '.join(fixed)} cannot change (write another bundle"
                         f" with it); a bundle takes only {', '.join(sorted(RUNTIME_OPTIONS))}")
    path = str(Path(ctx.bundle).resolve())
    runtime = {k: v for k, v in ctx.options.given.items() if k in RUNTIME_OPTIONS}  # one runtime for all stages
    key = (path, tuple(sorted((k, str(v)) for k, v in runtime.items())))
    rt = _RUNTIMES.get(key)
    if rt is None or rt.model is not ctx.model:
        rt = _RUNTIMES[key] = BundleRuntime(Path(path), ctx.model, runtime)
    return BundleStage(rt, stage, ctx)


def run_request(handles: dict, request) -> Iterator[int]:
    """The ``run_request`` hook: the whole request through the bundle's Genie pipeline
    (`BundleRuntime.generate`)."""
    return handles["decoder"].runtime.generate(request)
