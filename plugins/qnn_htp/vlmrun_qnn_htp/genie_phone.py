"""Decoder engine ``genie`` on a phone (``--decoder-engine genie --target android``): the SDK's ``genie-t2t-run`` on
the phone's HTP (Genie's QnnHtp backend) over adb, decoding over the decoder's context binaries.

Vision, projector and embed keep running through ``qnn-net-run`` (`.netrun`); only the decoder comes here.

What goes to the phone, into one directory (`REMOTE_DIR`), each file pushed once and skipped when the remote
sha256 matches (`vlmrun_qualcomm.adb.Adb.push`):

* from the QAIRT SDK (`vlmrun_qualcomm.sdk.Sdk.require_genie_htp`, NN = the SoC table's HTP arch):
  ``bin/aarch64-android/genie-t2t-run``, ``lib/aarch64-android/{libGenie.so, libQnnHtp.so, libQnnHtpV<NN>Stub.so,
  libQnnSystem.so, libQnnHtpNetRunExtensions.so}``, ``lib/hexagon-v<NN>/unsigned/libQnnHtpV<NN>Skel.so`` and
  ``libc++_shared.so`` (the SDK's, else the NDK's: genie-t2t-run links it, as on the Genie CPU path);
* the decoder's context binaries (``<artifact>/<file>.bin``, the handle's ``ctx_bins`` in order), the tokenizer
  (``tokenizer.json``), the float32 LUT (``embed_lut_f32.raw`` [vocab, hidden], the ``-t`` table, derived once
  from the embed LUT export and kept in the artifact store) and a backend extension config when the dialog config
  names one (``engine.backend.extensions``);
* per query: ``genie_config.json`` (the handle's own QnnHtp dialog config with every path made relative to the
  remote directory) and ``embeddings.raw`` (the spliced prompt embeddings, float32 [N, hidden]).

Then, with ``LD_LIBRARY_PATH`` and ``ADSP_LIBRARY_PATH`` set to that directory::

    cd /data/local/tmp/vlmrun/genie_htp && env LD_LIBRARY_PATH=... ADSP_LIBRARY_PATH=... ./genie-t2t-run \\
        -c genie_config.json -e embeddings.raw -t embed_lut_f32.raw --embedding_query_output_type text \\
        --profile profile.json

The text streams back as genie-t2t-run prints it and becomes token ids (the tool's safe output mode is text) as soon
as its tokenization can no longer change. Errors come from genie-t2t-run's stderr and exit status only, never from
the generated text; a device error keeps Genie's own text and says what to check. Genie's profile (pulled after the
run) becomes the handle's ``last_timings``. A binary newer than the phone's QNN (the SDK's) is refused before any
push (`.netrun.check_runtime`).

Conversations (`GeniePhone.dialog_state`): when the SDK has ``bin/aarch64-android/genie-app`` it is pushed too, and
a conversation's turns run as genie-app dialog scripts that keep Genie's state on the phone between turns
(`vlmrun_qualcomm.genie_app.AppDialogState`: ``dialog restore`` of the previous turn's saved state, ``dialog
embeddingQuery`` of the turn's new rows only, text and picture rows alike, then ``dialog save``). Without genie-app
(``GeniePhone.no_state`` says so) every turn runs from the start through genie-t2t-run.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from vlmrun.errors import BackendError, InputError
from vlmrun.stages import ExportForm
from vlmrun_qualcomm import genie, genie_t2t
from vlmrun_qualcomm.adb import Adb
from vlmrun_qualcomm.genie_app import APP, AppDevice, AppDialogState
from vlmrun_qualcomm.genie_t2t import Retokenizer, answer_pieces
from vlmrun_qualcomm.sdk import ANDROID, Sdk

from .netrun import REMOTE_ROOT, check_runtime, phone_sdk

REMOTE_DIR = f"{REMOTE_ROOT}/genie_htp"
EXE = "genie-t2t-run"
CONFIG = "genie_config.json"
EMBEDDINGS = "embeddings.raw"
LUT_NAME = "embed_lut_f32.raw"
TOKENIZER = "tokenizer.json"
PROFILE = "profile.json"
#: Genie's CPU threads on the phone: the three cores of the config's cpu-mask 0xe0, as Qualcomm's shipped configs
PHONE_THREADS = 3
WHY = "for the Genie decoder on a phone (--decoder-engine genie --target android)"


def device_files(sdk: Sdk, soc, ndk_root=None) -> dict[str, Path]:
    """What genie-t2t-run needs on the phone's HTP, ``{name on the phone: local file}`` in push order; one
    BackendError line naming every missing SDK file and where vlmrun looked."""
    return sdk.require_genie_htp(soc.arch, ndk_root, why=WHY)


def sdk_app(sdk: Sdk) -> Path | None:
    """The SDK's genie-app for the phone (what keeps a conversation's state there), or None."""
    app = sdk.root / "bin" / ANDROID / APP if sdk.root else None
    return app if app is not None and app.is_file() else None


def lut_raw(ctx) -> Path:
    """The ``-t`` table: the embed LUT export as raw float32 [vocab, hidden], derived once into the artifact store."""
    src = ctx.exported(ExportForm.of("embed", "embed/lut"))
    key = {"stage": "embed", "backend": "qnn_htp", "kind": "genie-lut-raw", "source": src.path.name,
           "format": "float32 [vocab, hidden], raw"}

    def build(tmp: Path) -> dict:
        table = np.load(src.file("embed_lut_f32.npy"), mmap_mode="r")
        genie.write_lut(tmp / LUT_NAME, table)
        return {"files": [LUT_NAME], "stage": "embed", "form": "embed/lut-raw", "shape": list(table.shape),
                "dtype": "float32"}

    return ctx.store.get_or_build(key, build, rebuild=bool(getattr(ctx, "rebuild", False))).file(LUT_NAME)


def attach(handle, ctx, plan):
    """``handle`` (a Genie-engine decoder handle: ``ctx_bins``, ``config(request)``, ``artifacts``, ``model``) as
    loaded for the target of ``plan`` (the decoder's `.plan.StagePlan`): unchanged locally; on a phone it gets
    ``handle.phone`` (a `GeniePhone`, which the ``decode`` hook uses) after the QNN-version check and the pushes."""
    rt, soc = plan.runtime, plan.soc
    if rt.target != "android":
        return handle
    sdk = phone_sdk(rt.sdk_root)
    for art in handle.artifacts:  # before adb is even asked for a device
        check_runtime(art.manifest, sdk, f"decoder ({art.path.name})")
    files = device_files(sdk, soc, rt.ndk_root)
    lut = lut_raw(ctx)
    adb = Adb.connect(rt.device, rt.adb, timeout=rt.adb_timeout)
    handle.phone = GeniePhone(handle, files=files, adb=adb, soc=soc, lut=lut, timeout=rt.timeout, app=sdk_app(sdk))
    if handle.phone.app is None:
        handle.phone.no_state = (f"the QAIRT SDK at {sdk.root} has no bin/{ANDROID}/{APP}: each turn of a"
                                 " conversation runs from the start")
    handle.runtime_name = None  # genie-t2t-run hands out no logits: a diff judges its tokens by the engine's
    handle.load_s = float(getattr(handle, "load_s", 0.0) or 0.0) + handle.phone.load_s
    return handle


#: device errors (Genie's text, stderr) -> what to check; the first match is appended to the one-line error
DEVICE_HINTS = (
    (re.compile(r"Failed to create device: 1008|Unable to load Skel|Failed to load skel", re.I),
     "the phone's HTP did not load {skel} from ADSP_LIBRARY_PATH ({rd}): is the phone's SoC {soc} ({arch})? set --soc"
     " to the phone's SoC"),
    (re.compile(r"14001|Transport layer setup failed|DspTransport", re.I),
     "the HTP transport did not start ({stub} -> {skel}): check --soc against the phone and that both come from the"
     " same QAIRT SDK"),
    (re.compile(r"\b500[05]\b"),
     "context creation failed: a context binary for another SoC or a newer QNN than the phone's runtime"),
    (re.compile(r"\b1002\b"),
     "the HTP's protection domain is too small for the weights: split the decoder (decoder_form = \"parts\")"),
)


def explain(message: str, soc: str, arch: str, remote_dir: str) -> str:
    """A device failure line plus what to check, for the first `DEVICE_HINTS` pattern it matches."""
    nn = arch.lstrip("v")
    for pattern, hint in DEVICE_HINTS:
        if pattern.search(message):
            return message + "; " + hint.format(skel=f"libQnnHtpV{nn}Skel.so", stub=f"libQnnHtpV{nn}Stub.so",
                                                rd=remote_dir, soc=soc, arch=arch)
    return message


class GeniePhone:
    """genie-t2t-run on the phone's HTP for one decoder handle. Construction pushes what every query needs."""

    def __init__(self, handle, *, files: dict[str, Path], adb: Adb, soc, lut: Path, timeout: float = 600.0,
                 remote_dir: str = REMOTE_DIR, app: Path | None = None):
        self.adb, self.soc, self.rd, self.timeout = adb, soc, remote_dir, float(timeout)
        self.artifacts = list(handle.artifacts)
        self.app, self.no_state = app, ""
        self.files = {**dict(files), **({APP: Path(app)} if app is not None else {})}
        self.placed: dict[str, Path] = {}  # remote name (relative to rd) -> the local file it holds
        self._dirs: set[str] = set()
        self.last_command = ""
        t0 = time.perf_counter()
        adb.mkdir(self.rd)
        for name, path in self.files.items():
            self.place(path, name)
        adb.shell(["chmod", "755", *[f"{self.rd}/{x}" for x in (EXE, APP) if x in self.files]],
                  what="adb shell chmod")
        for local in handle.ctx_bins:
            self.place(Path(local), self.bin_name(local))
        self.place(Path(handle.model.path) / "tokenizer.json", TOKENIZER)
        self.place(Path(lut), LUT_NAME)
        self.load_s = time.perf_counter() - t0

    # -- files --------------------------------------------------------------------------------------------------
    def bin_name(self, local) -> str:
        """A context binary's name on the phone: ``<artifact directory>/<file>`` (unique per artifact)."""
        p = Path(local)
        for art in self.artifacts:
            try:
                return f"{art.path.name}/{p.relative_to(art.path).as_posix()}"
            except ValueError:
                continue
        return f"{p.parent.name}/{p.name}"

    def place(self, local: Path, name: str) -> str:
        """``local`` at ``<rd>/<name>`` (pushed unless the remote sha256 matches); returns ``name``."""
        local = Path(local)
        if self.placed.get(name) == local:
            return name
        if not local.is_file():
            raise BackendError(f"the Genie decoder on a phone needs {local}, which does not exist")
        parent = name.rpartition("/")[0]
        if parent and parent not in self._dirs:
            self.adb.mkdir(f"{self.rd}/{parent}")
            self._dirs.add(parent)
        self.adb.push(local, f"{self.rd}/{name}")
        self.placed[name] = local
        return name

    def remote_config(self, config: dict) -> dict:
        """The handle's dialog config with its files placed on the phone and named relative to the remote
        directory (genie-t2t-run's working directory): ctx-bins, tokenizer, backend extensions; n-threads for the
        phone."""
        cfg = copy.deepcopy(config)
        d = cfg["dialog"]
        model = d["engine"]["model"]
        if model.get("type") == "binary":
            model["binary"]["ctx-bins"] = [self.place(Path(b), self.bin_name(b)) for b in model["binary"]["ctx-bins"]]
        d["tokenizer"]["path"] = self.place(Path(d["tokenizer"]["path"]), TOKENIZER)
        d["engine"]["n-threads"] = PHONE_THREADS  # the phone's cores, not this host's
        backend = d["engine"]["backend"]
        if backend.get("extensions"):
            ext = Path(backend["extensions"])
            backend["extensions"] = self.place(ext, ext.name)
        return cfg

    # -- running ------------------------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        return genie_t2t.t2t_argv(f"./{EXE}", CONFIG, embedding_file=EMBEDDINGS, lut=LUT_NAME, output_type="text",
                                  profile=PROFILE, check_profile_path=False)

    def env(self) -> dict[str, str]:
        return {"LD_LIBRARY_PATH": self.rd, "ADSP_LIBRARY_PATH": self.rd}

    def explain(self, message: str) -> str:
        """A genie-t2t-run failure line plus what to check for a known device error (still one line)."""
        return explain(message, self.soc.name, self.soc.arch, self.rd)

    def dialog_state(self, handle) -> AppDialogState | None:
        """A conversation's state kept on the phone by genie-app's dialog commands, or None without genie-app (the
        reason in ``no_state``)."""
        if self.app is None:
            return None
        device = AppDevice(self.adb, self.rd, LUT_NAME, self.env(), self.timeout, self.explain)
        return AppDialogState(device, lambda request: self.remote_config(handle.config(request)),
                              hidden=int(handle.model.hidden_size), tokenizer=handle.model.tokenizer,
                              context_length=int(handle.context_length))

    def generate(self, handle, request) -> Iterator[int]:
        """One query: token ids as genie-t2t-run's text streams in; ``handle.last_timings`` from Genie's profile."""
        prompt = int(request.inputs_embeds.shape[1])
        ctx = int(handle.context_length)
        if prompt >= ctx:
            raise InputError(f"the prompt is {prompt} tokens but the compiled decoder context holds {ctx}; compile"
                             " the decoder with a larger context_length")
        genie.check_context(prompt, request.max_new_tokens, ctx)  # before anything runs on the phone
        handle.last_timings = {}
        cfg = self.remote_config(handle.config(request))
        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-genie-phone-"))
        try:
            (tmp / CONFIG).write_text(json.dumps(cfg, indent=1))
            genie.write_embeddings(tmp / EMBEDDINGS, request.inputs_embeds)
            self.adb.push(tmp / CONFIG, f"{self.rd}/{CONFIG}", skip_same=False)
            self.adb.push(tmp / EMBEDDINGS, f"{self.rd}/{EMBEDDINGS}", skip_same=False)
            self.adb.shell(["rm", "-f", f"{self.rd}/{PROFILE}"], what="adb shell rm")
            self.last_command = Adb.command_line(self.argv(), cwd=self.rd, env=self.env())
            try:
                yield from self._run(handle, tmp)
            except genie.ContextLimitError:
                raise genie.ContextLimitError(
                    f"Genie on {self.adb.serial} stopped at its context limit of {ctx} tokens (prompt {prompt} tokens,"
                    f" up to {request.max_new_tokens} new): raise the decoder's context_length or lower"
                    " --max-new-tokens") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _run(self, handle, tmp: Path) -> Iterator[int]:
        what = f"genie-t2t-run on {self.adb.serial}"
        retok = Retokenizer(handle.model.tokenizer)
        run = self.adb.stream(self.argv(), cwd=self.rd, env=self.env(), timeout=self.timeout, what=what,
                              hint="raise the decoder's timeout option if the model is large")
        text = ""
        for piece in answer_pieces(run):  # the answer as genie-t2t-run prints it (vlmrun_qualcomm.adb.ShellStream)
            text += piece
            yield from retok.stable(text)
        profile = None
        if run.returncode == 0:
            profile = tmp / PROFILE
            try:
                self.adb.pull(f"{self.rd}/{PROFILE}", profile)
            except BackendError:
                pass  # finish_t2t names the missing profile
        try:
            result = genie_t2t.finish_t2t(run.stdout, run.stderr, run.returncode, profile, run.seconds, what)
        except genie.ContextLimitError:
            raise
        except BackendError as exc:
            raise BackendError(self.explain(str(exc))) from None
        handle.last_timings = dict(result.timings)
        yield from retok.final(result.text)
