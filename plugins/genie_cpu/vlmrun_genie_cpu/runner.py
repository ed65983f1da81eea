"""The genie_cpu decoder handle: Genie on QnnGenAiTransformer through libGenie (worker process), the host SDK's
``genie-t2t-run``, or ``genie-t2t-run`` on a phone over adb.

On a phone a conversation keeps Genie's dialog state there between turns when the SDK has
``bin/aarch64-android/genie-app`` (`GenieCpuDecoder.dialog_state`: each turn one genie-app script that restores the
state the previous turn saved, queries the turn's new rows and saves the new state;
`vlmrun_qualcomm.genie_app.AppDialogState`). On this host (libGenie in a worker process started per request, or
genie-t2t-run) and on a phone without genie-app, every turn runs from the start (``no_state`` says why)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from vlmrun.handles import DecoderHandle
from vlmrun_qualcomm import genie, genie_config, genie_t2t, genie_worker
from vlmrun.errors import BackendError, InputError
from vlmrun.stages import ArtifactKind, ExportForm

from .options import DecoderPlan
from vlmrun_qualcomm.adb import Adb
from vlmrun_qualcomm.genie_app import APP, AppDevice, AppDialogState
from vlmrun_qualcomm.sdk import ANDROID, GENIE_CPU_LIBS, LIBCXX, Sdk
#: what a phone needs beside the model files, in push order (genie-t2t-run links libGenie.so and the NDK's
#: libc++_shared.so; Genie opens the QnnGenAiTransformer backend, its model library and its op package)
DEVICE_FILES = ("genie-t2t-run", *GENIE_CPU_LIBS, LIBCXX)


def require_tools(options, model):
    """The decoder's plan (`.options.DecoderPlan`), the SDK and the tools this decoder needs, or one error line
    naming what is missing and where we looked."""
    plan = DecoderPlan.of(options)
    sdk = Sdk.find(plan.sdk_root)
    return plan, sdk, sdk.require(plan.target, plan.runner, plan.ndk_root)


def load_decoder(ctx):
    plan, sdk, tools = require_tools(ctx.options, ctx.model)
    src = ctx.exported(ExportForm.of("embed", "embed/lut"))
    # the composer's architecture config states the context (size.context), so the model bin is keyed by it
    key = {"quantize": plan.quantize, "composer": str(tools["composer"].name), "context_length": plan.context_length,
           "sdk_version": sdk.version()}
    art = ctx.compiled(src, {**key, "sdk_root": str(sdk.root) if plan.sdk_root else None},
                       ArtifactKind("genai-transformer", plan.quantize))
    adb = None
    if plan.target == "android":
        adb = Adb.connect(plan.device, plan.adb)
        app = sdk.root / "bin" / ANDROID / APP
        if app.is_file():  # genie-app keeps a conversation's dialog state on the phone
            tools = {**tools, APP: app}
    return GenieCpuDecoder(ctx.model, art, plan, tools, adb)


class GenieCpuDecoder(DecoderHandle):
    def __init__(self, model, artifact, plan: DecoderPlan, tools: dict, adb=None):
        self.model, self.artifact, self.plan, self.tools, self.adb = model, artifact, plan, tools, adb
        self.artifacts = (artifact,)
        self.facts = genie_config.GenieModel.from_model(model)
        self.ctx = int(plan.context_length)
        self.load_s = 0.0
        self.last_timings: dict = {}
        self.last_text = ""
        self._placed = False  # the phone holds the tools and the model's files
        in_proc = all(n in tools for n in GENIE_CPU_LIBS)
        if plan.target == "android":
            self.mode = "adb"
        elif plan.runner == "t2t" or (plan.runner == "auto" and not in_proc):
            self.mode = "t2t"
        else:
            self.mode = "libgenie"
        self.no_state = self._why_no_state()

    def _why_no_state(self) -> str:
        """Why a conversation cannot keep Genie's state between turns here ("" when it can)."""
        if self.mode != "adb":
            return (f"genie_cpu on this host ({self.mode}) starts Genie per request: each turn of a conversation runs"
                    " from the start")
        if APP not in self.tools:
            return f"the QAIRT SDK has no bin/{ANDROID}/{APP}: each turn of a conversation runs from the start"
        return ""

    def dialog_state(self) -> AppDialogState | None:
        """A conversation's state kept on the phone by genie-app's dialog commands; None (``no_state`` says why) on
        this host or without genie-app."""
        if self.no_state:
            return None
        self._place_on_phone()
        rd = self.plan.remote_dir
        device = AppDevice(self.adb, rd, "embed_lut_f32.raw", {"LD_LIBRARY_PATH": rd, "ADSP_LIBRARY_PATH": rd},
                           self.plan.timeout)
        return AppDialogState(device, lambda request: self.config(request, "model.bin", "tokenizer.json"),
                              hidden=int(self.model.hidden_size), tokenizer=self.model.tokenizer,
                              context_length=self.ctx)

    @property
    def context_length(self) -> int:
        return self.ctx

    def config(self, request, model_bin: str, tokenizer: str) -> dict:
        stops = sorted(request.stop_ids) or list(self.facts.eos)
        return genie_config.dialog_config(
            self.facts, "QnnGenAiTransformer", tokenizer=tokenizer, model_bin=model_bin, context_size=self.ctx,
            sampling=getattr(request.sampler, "settings", None), max_new_tokens=request.max_new_tokens, eos=stops,
        )

    def generate(self, request) -> Iterator[int]:
        prompt = int(request.inputs_embeds.shape[1])
        if prompt >= self.ctx:
            raise InputError(f"the prompt is {prompt} tokens but the Genie context holds"
                             f" {self.ctx}; raise the decoder's context_length")
        genie.check_context(prompt, request.max_new_tokens, self.ctx)  # before Genie starts, on every path
        self.last_timings = {}
        try:
            yield from self._generate(request)
        except genie.ContextLimitError:  # Genie reached the context after all: one line, with the numbers
            raise genie.ContextLimitError(
                f"Genie ({self.mode}) stopped at its context limit of {self.ctx} tokens (prompt {prompt} tokens, up to"
                f" {request.max_new_tokens} new): raise the decoder's context_length or lower --max-new-tokens"
            ) from None

    def _generate(self, request) -> Iterator[int]:
        if self.mode == "libgenie":
            lib_dir = str(self.tools["libQnnGenAiTransformer.so"].parent)
            env = {"LD_LIBRARY_PATH": lib_dir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}
            cfg = self.config(request, str(self.artifact.file("model.bin")), str(self.artifact.file("tokenizer.json")))
            yield from genie_worker.stream_tokens_worker(self.tools["libGenie.so"], cfg, request.inputs_embeds,
                                                         self.artifact.file("embed_lut_f32.npy"),
                                                         timeout=self.plan.timeout, profile_out=self.last_timings,
                                                         env=env, **genie_worker.tap_arguments(request, self.model))
            return
        if self.mode == "adb":
            yield from self._stream_adb(request)
            return
        result = self._run_local(request)
        self.last_text, self.last_timings = result.text, result.timings
        # genie-t2t-run's safe output mode is text (token mode crashed in the seed notes): ids by re-tokenizing
        for tid in self.model.tokenizer.encode(result.text, add_special_tokens=False).ids:
            yield int(tid)

    def _run_local(self, request) -> genie_t2t.T2TResult:
        exe = self.tools["genie-t2t-run"]
        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-genie-t2t-"))
        try:
            cfg = self.config(request, str(self.artifact.file("model.bin")), str(self.artifact.file("tokenizer.json")))
            (tmp / "genie_config.json").write_text(json.dumps(cfg, indent=1))
            genie.write_embeddings(tmp / "embeddings.raw", request.inputs_embeds)
            profile = tmp / "profile.json"
            argv = genie_t2t.t2t_argv(str(exe), str(tmp / "genie_config.json"),
                                      embedding_file=str(tmp / "embeddings.raw"),
                                      lut=str(self.artifact.file("embed_lut_f32.raw")), output_type="text",
                                      profile=str(profile))
            lib_dir = exe.parent.parent.parent / "lib" / exe.parent.name
            env = {"LD_LIBRARY_PATH": f"{lib_dir}{os.pathsep}{os.environ.get('LD_LIBRARY_PATH', '')}"}
            return genie_t2t.run_t2t(argv, timeout=self.plan.timeout, cwd=tmp, env=env, profile=profile)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _place_on_phone(self) -> None:
        """The tools (genie-app too when the SDK has it) and the model's files on the phone, pushed once per handle
        (each skipped when the phone's copy has the same sha256)."""
        if self._placed:
            return
        adb, rd, t = self.adb, self.plan.remote_dir, self.plan.timeout
        missing = [n for n in DEVICE_FILES if n not in self.tools]
        if missing:  # preflight names them first; never start a phone run without them
            raise BackendError(f"genie_cpu on a phone needs {', '.join(missing)}; see vlmrun doctor")
        adb.mkdir(rd)
        tools = [n for n in (*DEVICE_FILES, APP) if n in self.tools]
        for name in tools:
            adb.push(self.tools[name], f"{rd}/{name}", timeout=t)
        for name in ("model.bin", "embed_lut_f32.raw", "tokenizer.json"):
            adb.push(self.artifact.file(name), f"{rd}/{name}", timeout=t)
        adb.shell(["chmod", "755", *[f"{rd}/{n}" for n in tools if n in ("genie-t2t-run", APP)]],
                  what="adb shell chmod")
        self._placed = True

    def _stream_adb(self, request) -> Iterator[int]:
        """genie-t2t-run on the phone: token ids as its answer streams back over adb (those whose tokenization can
        no longer change, `vlmrun_qualcomm.genie_t2t.Retokenizer`); errors from its stderr and exit status once it
        ended; ``last_text`` and ``last_timings`` (Genie's profile) after the last id."""
        adb, rd, t = self.adb, self.plan.remote_dir, self.plan.timeout
        self._place_on_phone()
        what = "genie-t2t-run (adb)"
        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-genie-adb-"))
        try:
            cfg = self.config(request, "model.bin", "tokenizer.json")  # relative to the remote working directory
            (tmp / "genie_config.json").write_text(json.dumps(cfg, indent=1))
            genie.write_embeddings(tmp / "embeddings.raw", request.inputs_embeds)
            adb.push(tmp / "genie_config.json", f"{rd}/genie_config.json", timeout=t, skip_same=False)
            adb.push(tmp / "embeddings.raw", f"{rd}/embeddings.raw", timeout=t, skip_same=False)
            adb.shell(["rm", "-f", f"{rd}/profile.json"], what="adb shell rm")
            argv = genie_t2t.t2t_argv("./genie-t2t-run", "genie_config.json", embedding_file="embeddings.raw",
                                      lut="embed_lut_f32.raw", output_type="text", profile="profile.json",
                                      check_profile_path=False)
            run = adb.stream(argv, cwd=rd, env={"LD_LIBRARY_PATH": rd, "ADSP_LIBRARY_PATH": rd}, timeout=t,
                             what=what, hint="raise the decoder's timeout option if the model is large")
            retok, text = genie_t2t.Retokenizer(self.model.tokenizer), ""
            for piece in genie_t2t.answer_pieces(run):
                text += piece
                yield from retok.stable(text)
            local_prof = tmp / "profile.json"
            if run.returncode == 0:
                try:
                    adb.pull(f"{rd}/profile.json", local_prof, timeout=t)
                except BackendError:
                    pass
            result = genie_t2t.finish_t2t(run.stdout, run.stderr, run.returncode,
                                          local_prof if run.returncode == 0 else None, run.seconds, what)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.last_text, self.last_timings = result.text, result.timings
        yield from retok.final(result.text)
