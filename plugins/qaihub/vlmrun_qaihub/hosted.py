"""Hosted stages: a stage compiled on AI Hub that runs as inference jobs (``profile=True``) on the hosted device,
each job recorded in the artifact's ledger so that a rerun re-attaches to it; a data set's worth of runs as one
job (``HostedStage.run_batch``, batching for ``vlmrun eval``), the device's figures in ``last_profile``."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np

from vlmrun.errors import BackendError, UsageError, VlmrunError
from vlmrun.handles import StageHandle
from vlmrun.stages import ArtifactKind, ExportForm

from . import hub as hubmod
from .devices import make_device
from .errors import HubJobTimeout, HubNotFound, HubTooLarge, HubUnreachable
from .figures import merge_figures, profile_figures
from .ledger import Ledger
from .options import DEFAULT_BATCH_MB, HOSTED_STAGES, compile_options, device_of, hub_for, qairt_version_of
from .reattach import REATTACH, forgotten

BATCH_JOBS_KEPT = 32  # finished batch jobs the ledger remembers per artifact (a rerun downloads their outputs)
BATCH_PREFIX = "inference-batch|"


def _digest(batches: dict[str, list[np.ndarray]]) -> str:
    h = hashlib.sha256()
    for name in sorted(batches):
        for a in batches[name]:
            h.update(f"{name}|{a.dtype}|{a.shape}|".encode())
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:24]


def _sample_digest(sample: dict[str, np.ndarray]) -> str:
    return _digest({k: [v] for k, v in sample.items()})


class HostedStage(StageHandle):
    """A stage compiled on AI Hub; each run is an inference job (profile=True) on the hosted device, recorded in
    the artifact's job ledger so that an interrupted run's job is re-attached by a rerun with the same inputs.

    ``last_profile`` (after a run): ``job_id``, ``url``, ``device``, ``target_model``, and the device's figures
    with units in their names (``profile_figures``): ``inference_ms`` (the stage on the device),
    ``inference_each_ms``, ``inferences``, ``inference_peak_memory_bytes``, ``load_cold_ms``, ``load_warm_ms``,
    ``*_peak_memory_bytes``, ``*_runs_ms``, ``*_range_bytes``, and ``job_wall_ms`` (submission to results, queue
    and polling included). After ``run_batch`` it describes the batch's job(s): see there.

    Samples. The binary has static shapes, so one run may be several samples of one inference job: embed's token
    ids are cut into chunks of the compiled sequence length (``embed_seq``), the last chunk zero-padded (an
    embedding is a per-token lookup: the padding changes no real token's row, and the padded rows are cut off);
    every other stage is one sample per run."""

    def __init__(self, hub: hubmod.Hub, artifact, stage: str, device: str, embed_seq: int | None = None,
                 state_dir: Path | None = None, qairt: str | None = None, batch_mb: float | None = None):
        self.hub = hub
        self.artifact = artifact
        self.artifacts = (artifact,)
        self.stage = stage
        self.device = device
        self.embed_seq = embed_seq
        self.qairt = qairt
        self.batch_bytes = int(float(batch_mb or DEFAULT_BATCH_MB) * 1e6)
        self.ledger = Ledger(state_dir) if state_dir else None
        self.load_s = 0.0
        self.last_profile: dict = {}
        self.last_job: str | None = None
        self._model = None
        m = artifact.manifest
        self.inputs = {t["name"]: (tuple(t["shape"]), t["dtype"]) for t in m["inputs"]}
        self.output_names = [t["name"] for t in m["outputs"]]

    def _hub_model(self):
        if self._model is None:
            client = self.hub.client
            m = self.artifact.manifest
            mid = m.get("hub_target_model") or (m.get("hub") or {}).get("target_model")
            if mid:
                try:
                    self._model = self.hub.call(f"lookup of model {mid}", client.get_model, mid)
                except HubNotFound:  # the hub forgot it (or another account): upload the binary we have
                    self._model = None
            if self._model is None:
                bin_path = next(self.artifact.path / f for f in m["files"] if f.endswith(".bin"))
                self.hub.say(f"AI Hub: uploading the stored context binary {bin_path.name}"
                             + (f" (the hub no longer has model {mid})" if mid else ""))
                self._model = self.hub.call("context binary upload", client.upload_model, str(bin_path))
        return self._model

    def _submit(self, feeds, kind: str = "inference"):
        n = max((len(v) for v in feeds.values()), default=1)
        many = f" ({n} samples)" if n > 1 else ""
        job = self.hub.call("inference job submission", self.hub.client.submit_inference_job, self._hub_model(),
                            make_device(self.device), inputs=feeds, profile=True,
                            name=f"vlmrun {self.stage}" + (f" batch of {n}" if kind != "inference" else ""),
                            options=f"--qairt_version {self.qairt}" if self.qairt else "",
                            retry=False, idempotent=False)
        self.hub.say(f"AI Hub: {kind} job {job.job_id} submitted on {self.device}{many} {hubmod.redact(job.url)}")
        return job

    def _named(self, job, outs: dict) -> dict:
        names = list(outs)
        if set(self.output_names) <= set(names):
            return {k: outs[k] for k in self.output_names}
        if len(names) == len(self.output_names):  # the hub renamed them: keep the order
            return dict(zip(self.output_names, (outs[k] for k in names)))
        raise BackendError(f"AI Hub job {job.job_id} returned outputs {names}, expected {self.output_names}")

    def _fetch(self, job, kind: str, rerun: str) -> tuple[dict, dict]:
        """Wait for ``job``: its outputs (by the manifest's names, a list per output) and execution summary."""
        self.hub.wait(job, kind, rerun=rerun)
        outs = self.hub.call(f"outputs of job {job.job_id}", job.download_output_data)
        prof = self.hub.call(f"profile of job {job.job_id}", job.download_profile) or {}
        if not outs:
            raise BackendError(f"AI Hub inference job {job.job_id} returned no outputs ({hubmod.redact(job.url)})")
        return self._named(job, outs), dict(prof.get("execution_summary") or {})

    def _job(self, key: str, feeds: dict, kind: str = "inference", *, keep: bool = False,
             record: dict | None = None):
        """One inference job over ``feeds``, recorded under ``key`` in the ledger: re-attached when an earlier run
        submitted it, else submitted. ``keep``: once done the ledger keeps it (state ``done``, with ``record``) so
        that a rerun downloads its outputs instead of running it again; else its entry is dropped.
        Returns (job, outputs by name (a list each), execution summary)."""
        ledger = self.ledger
        entry = (ledger.get(key) if ledger else None) or {}
        job = None
        if entry.get("job_id"):
            self.hub.say(f"AI Hub: re-attaching to inference job {entry['job_id']} submitted earlier for these inputs")
            try:
                job = self.hub.call(f"lookup of inference job {entry['job_id']}", self.hub.client.get_job,
                                    entry["job_id"])
            except HubNotFound as exc:
                forgotten(self.hub, "inference", entry["job_id"], exc)
                ledger.drop(key)
        attached = job is not None
        while True:
            if job is None:
                job = self._submit(feeds, kind)
                if ledger:
                    ledger.update(key, state="submitted", job_id=job.job_id, url=hubmod.redact(job.url),
                                  kind=kind, stage=self.stage, device=self.device, **(record or {}))
            self.last_job = job.job_id
            try:
                outs, summary = self._fetch(job, kind, REATTACH if ledger else "a rerun submits a new job")
            except HubNotFound as exc:
                if ledger:
                    ledger.drop(key)
                if not attached:
                    raise
                forgotten(self.hub, "inference", job.job_id, exc)
                attached, job = False, None
                continue
            except (HubUnreachable, HubJobTimeout):
                raise
            except VlmrunError:
                if ledger:
                    ledger.drop(key)
                raise
            break
        if ledger:
            if keep:
                ledger.update(key, state="done")
                ledger.prune(BATCH_PREFIX, BATCH_JOBS_KEPT)
            else:
                ledger.drop(key)
        return job, outs, summary

    def _profile(self, used: list[tuple], t0: float, **extra) -> dict:
        """``last_profile`` for the jobs in ``used`` ((job, samples, execution summary) each)."""
        m = self.artifact.manifest
        job = used[0][0]
        prof = {"job_id": job.job_id, "url": hubmod.redact(job.url), "device": self.device,
                "target_model": getattr(self._model, "model_id", None) or m.get("hub_target_model")}
        if len(used) > 1:
            prof["job_ids"] = [j.job_id for j, _, _ in used]
        prof.update(extra)
        prof.update(merge_figures([profile_figures(summary, n) for _, n, summary in used]))
        prof["job_wall_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        return prof

    def run_batches(self, batches: dict[str, list[np.ndarray]]) -> dict[str, list[np.ndarray]]:
        """One inference job over the samples in ``batches`` (input name -> one array per sample); its ledger
        entry is dropped once it is done."""
        feeds = {name: [self._cast(name, a) for a in arrs] for name, arrs in batches.items()}
        n = max((len(v) for v in feeds.values()), default=1)
        key = f"inference|{self.hub.api_url}|{self.device}|{self.qairt or ''}|{_digest(feeds)}"
        t0 = time.perf_counter()
        job, outs, summary = self._job(key, feeds)
        self.last_profile = self._profile([(job, n, summary)], t0)
        return outs

    def _cast(self, name: str, a) -> np.ndarray:
        dtype = self.inputs.get(name, (None, None))[1]
        return np.ascontiguousarray(a, dtype=dtype) if dtype else np.ascontiguousarray(a)

    def _samples(self, inputs: dict) -> list[dict[str, np.ndarray]]:
        """One run's inputs as samples of the binary (see the class docstring), in the binary's input order."""
        if self.stage == "embed" and self.embed_seq:
            ids = np.asarray(inputs["input_ids"], dtype=np.int64)
            T, E = ids.shape[1], self.embed_seq
            samples = []
            for i in range(0, T, E):
                c = np.zeros((1, E), np.int64)
                c[0, : min(E, T - i)] = ids[0, i : i + E]
                samples.append({"input_ids": c})
        else:
            samples = [{k: inputs[k] for k in self.inputs if k in inputs}]
        return [{k: self._cast(k, v) for k, v in s.items()} for s in samples]

    def _assemble(self, inputs: dict, outs: list[dict]) -> dict:
        """One run's outputs from its samples' outputs (the inverse of ``_samples``)."""
        if self.stage == "embed" and self.embed_seq:
            T, E = np.asarray(inputs["input_ids"]).shape[1], self.embed_seq
            parts = [np.asarray(o["inputs_embeds"])[:, : min(E, T - i * E)] for i, o in enumerate(outs)]
            return {"inputs_embeds": np.concatenate(parts, axis=1).astype(np.float32)}
        return {k: np.asarray(v) for k, v in outs[0].items()}

    def run(self, inputs: dict) -> dict:
        samples = self._samples(inputs)
        outs = self.run_batches({name: [s[name] for s in samples] for name in samples[0]})
        return self._assemble(inputs, [{k: v[i] for k, v in outs.items()} for i in range(len(samples))])

    # -- a data set's worth in one go (run_stage_batch) ----------------------------------------------------------
    def run_batch(self, items: list[dict]) -> list[dict]:
        """Run every item of ``items`` (each what ``run`` takes) in as few inference jobs as the hub allows;
        the outputs per item, in order, equal to what ``run`` gives each.

        * One job carries many samples (a dataset of input name -> list of N arrays, as the client sends it);
          the outputs come back in the same order and are split per item. Identical samples are sent once.
        * Shapes: the binary's are static, so nothing is padded beyond what ``run`` does (embed's chunks,
          see the class docstring; that makes embed's token ids of any length one job). Samples are grouped by
          their input shapes and dtypes, one job per group (grouping, not padding: a padded tensor would be
          another input than the stage contract's); with the binary's static shapes there is one group.
        * Size: neither the ``qai-hub`` client nor Qualcomm's documents state a limit on an inference job's
          dataset; the hub answers HTTP 413 ("The uploaded asset is too large") to an upload it refuses. vlmrun
          caps one job's inputs at ``batch_mb`` (its own default, ``DEFAULT_BATCH_MB`` MB) and splits a
          larger group into as few jobs of even size as fit, saying so; a 413 halves the job and tries again.
        * Ledger: each job is recorded with its samples' digests and kept once done (the most recent
          ``BATCH_JOBS_KEPT`` per artifact), so a rerun (an interrupted ``vlmrun eval``, which asks again
          for the items it has not finished) downloads the outputs of finished jobs instead of submitting new
          ones, re-attaches to jobs still running, and submits only samples no job has.
        * ``last_profile``: the first job's ``job_id`` and ``url`` (``job_ids`` when there were several),
          ``items``, and the device figures of the job(s) the outputs came from (``inferences``: their samples,
          ``inference_ms`` the sum, ``inference_each_ms`` the mean; merged figures: the largest load times and
          peak memory).
        * A failed job raises one line naming the job, the stage and the hub's reason.
        """
        if not items:
            return []
        t0 = time.perf_counter()
        kind = f"{self.stage} inference"
        per_item = [self._samples(dict(i)) for i in items]
        digests = [[_sample_digest(s) for s in samples] for samples in per_item]
        unique: dict[str, dict] = {}
        for samples, ds in zip(per_item, digests):
            for s, d in zip(samples, ds):
                unique.setdefault(d, s)
        got: dict[str, dict] = {}
        used: list[tuple] = []
        prefix = f"{BATCH_PREFIX}{self.hub.api_url}|{self.device}|{self.qairt or ''}|{self._model_tag()}|"
        if self.ledger:
            self._from_ledger(prefix, unique, got, used, kind)
        for group in self._plan([d for d in unique if d not in got], unique):
            self._run_group(group, unique, got, used, kind, prefix)
        self.last_profile = self._profile(used, t0, items=len(items))
        return [self._assemble(dict(inp), [got[d] for d in ds]) for inp, ds in zip(items, digests)]

    def _model_tag(self) -> str:
        m = self.artifact.manifest
        return str(m.get("hub_target_model") or (m.get("hub") or {}).get("target_model") or self.artifact.path.name)

    def _from_ledger(self, prefix: str, unique: dict, got: dict, used: list, kind: str) -> None:
        """Outputs of batch jobs earlier runs submitted (re-attached while running), for the samples they hold."""
        entries = sorted(self.ledger.entries(prefix).items(), key=lambda kv: -float(kv[1].get("updated") or 0))
        for key, entry in entries:
            samples = list(entry.get("samples") or [])
            hits = [i for i, d in enumerate(samples) if d in unique and d not in got]
            if not entry.get("job_id") or not hits:
                continue
            jid, done = entry["job_id"], entry.get("state") == "done"
            self.hub.say(f"AI Hub: {'downloading the outputs of' if done else 're-attaching to'} {kind} job {jid}"
                         f" ({'finished' if done else 'submitted'} earlier; {len(hits)} of its {len(samples)} samples"
                         " are wanted)")
            try:
                job = self.hub.call(f"lookup of inference job {jid}", self.hub.client.get_job, jid)
                outs, summary = self._fetch(job, kind, REATTACH)
            except HubNotFound as exc:
                forgotten(self.hub, "inference", jid, exc)
                self.ledger.drop(key)
                continue
            except (HubUnreachable, HubJobTimeout):
                raise
            except VlmrunError as exc:
                self.ledger.drop(key)
                if not done:
                    raise  # the job failed: the hub's reason
                self.hub.say(f"AI Hub: the outputs of {kind} job {jid} are gone ({exc}); running those samples again")
                continue
            if any(len(v) != len(samples) for v in outs.values()):
                self.ledger.drop(key)
                self.hub.say(f"AI Hub: {kind} job {jid} returned {min(len(v) for v in outs.values())} outputs for"
                             f" {len(samples)} samples; running those samples again")
                continue
            if not done:
                self.ledger.update(key, state="done")
            for i in hits:
                got[samples[i]] = {k: v[i] for k, v in outs.items()}
            used.append((job, len(samples), summary))

    def _plan(self, todo: list[str], unique: dict) -> list[list[str]]:
        """``todo``'s samples as jobs: grouped by input shapes and dtypes, a group split to fit ``batch_mb``."""
        groups: dict[tuple, list[str]] = {}
        for d in todo:
            s = unique[d]
            groups.setdefault(tuple((k, a.shape, str(a.dtype)) for k, a in s.items()), []).append(d)
        if len(groups) > 1:
            self.hub.say(f"AI Hub: the {self.stage} inputs come in {len(groups)} shapes: one inference job per shape")
        jobs = []
        for ds in groups.values():
            each = sum(a.nbytes for a in unique[ds[0]].values())
            per_job = max(1, self.batch_bytes // max(1, each))
            n_jobs = -(-len(ds) // per_job)
            size = -(-len(ds) // n_jobs)
            if n_jobs > 1:
                self.hub.say(f"AI Hub: {len(ds)} {self.stage} samples ({len(ds) * each / 1e6:.0f} MB) exceed"
                             f" batch_mb {self.batch_bytes / 1e6:g}: {n_jobs} inference jobs of at most {size}")
            jobs.extend(ds[i : i + size] for i in range(0, len(ds), size))
        return jobs

    def _run_group(self, ds: list[str], unique: dict, got: dict, used: list, kind: str, prefix: str) -> None:
        feeds = {name: [unique[d][name] for d in ds] for name in unique[ds[0]]}
        try:
            job, outs, summary = self._job(prefix + _digest(feeds), feeds, kind, keep=True,
                                           record={"samples": ds})
        except HubTooLarge as exc:
            mb = sum(a.nbytes for v in feeds.values() for a in v) / 1e6
            if len(ds) == 1:
                raise HubTooLarge(f"AI Hub refused one {self.stage} sample of {mb:.1f} MB as too large: {exc}"
                                  ) from None
            half = (len(ds) + 1) // 2
            self.hub.say(f"AI Hub refused the dataset of {len(ds)} {self.stage} samples ({mb:.0f} MB) as too large"
                         f" (HTTP 413): splitting it into two jobs of {half} and {len(ds) - half}")
            self._run_group(ds[:half], unique, got, used, kind, prefix)
            self._run_group(ds[half:], unique, got, used, kind, prefix)
            return
        if any(len(v) != len(ds) for v in outs.values()):
            raise BackendError(f"AI Hub {kind} job {job.job_id} returned {min(len(v) for v in outs.values())}"
                               f" outputs for {len(ds)} samples ({hubmod.redact(job.url)})")
        for i, d in enumerate(ds):
            got[d] = {k: v[i] for k, v in outs.items()}
        used.append((job, len(ds), summary))


def forms(stage: str, options) -> ExportForm:
    if stage == "embed":
        return ExportForm.of("embed", seq=int(options["embed_seq"]))
    return ExportForm.of(stage)


def load_hosted_stage(stage, ctx) -> HostedStage:
    """The ``load_stage`` hook's work: ``stage`` compiled on the hub for the device the options name (the artifact
    keyed by precision, device, QAIRT version, hub options and calibration), as a HostedStage."""
    if stage not in HOSTED_STAGES:
        raise UsageError(f"qaihub runs {', '.join(HOSTED_STAGES)} on hosted devices, not '{stage}'")
    o = ctx.options
    precision = str(o["precision"]).lower()
    qairt = qairt_version_of(o)
    compile_options(precision)  # validates
    device = device_of(o)
    form = forms(stage, o)
    src = ctx.exported(form)
    key_opts = {"precision": precision, "device": device, "hub_options": str(o.get("hub_options") or ""),
                "soc": o["soc"], "calibration_images": o["calibration_images"], "qairt_version": qairt,
                # keyed as given: the default sample count keys the artifacts it always did
                "calibration_samples": o.given.get("calibration_samples") if precision != "fp16" else None}
    key_opts = {k: v for k, v in key_opts.items() if v}
    art = ctx.compiled(src, key_opts, ArtifactKind.of(form, precision, device.replace(" ", "_")))
    hub = hub_for(o)
    state_dir = ctx.store.state_dir(art.path.name)  # the artifact's state directory (its job ledger)
    return HostedStage(hub, art, stage, device, form.get("seq") if stage == "embed" else None,
                       state_dir=state_dir, qairt=qairt, batch_mb=o["batch_mb"])
