"""A bundle on a phone (``vlmrun --bundle OUT --target android``): the SDK's ``genie-app`` runs the bundle's
pipeline script on the phone's HTP, over adb.

What goes to the phone, into ``/data/local/tmp/vlmrun/bundles/<bundle name>`` (each file pushed once and skipped
when the remote sha256 matches, `vlmrun_qualcomm.adb.Adb.push`):

* every file of the bundle (its manifest's list), as written;
* from the QAIRT SDK, for the phone's HTP arch NN: ``bin/aarch64-android/genie-app``,
  ``lib/aarch64-android/{libGenie.so, libQnnHtp.so, libQnnHtpV<NN>Stub.so, libQnnSystem.so,
  libQnnHtpNetRunExtensions.so}``, ``lib/hexagon-v<NN>/unsigned/libQnnHtpV<NN>Skel.so`` and ``libc++_shared.so``;
* per query, under ``query/``: the prompt's text before and after the image (``prompt_prefix.txt``,
  ``prompt_suffix.txt``), the preprocessed pixels (``pixel_values.raw``, float32: genie-app hands the file's bytes
  to ``GenieNode_setData``, which quantizes them to the encoder's uint8 input), the generator's config with this
  query's sampler and length (``text-generator.json``) and the script (``script.txt``, `.bundle.app_script`).

Then ``cd <dir> && env LD_LIBRARY_PATH=<dir> ADSP_LIBRARY_PATH=<dir> ./genie-app -s query/script.txt``. genie-app
prints the answer as ``[BEGIN]: ... [END]`` on stdout. A failing script line is printed on stderr and the script
goes on (the exit status stays 0), so errors are read from stderr: any error line there is a BackendError (with what
to check for a known device error), whatever the exit status. The answer is read as genie-app prints it
(`vlmrun_qualcomm.adb.ShellStream`): its text streams back while the phone generates.

Conversations (`PhoneConversation`, the bundle's ``request_state`` on a phone): genie-app runs one script and exits,
so each turn is one script that builds the pipeline, puts back the state the previous turn saved (``pipeline restore
GeniePipeline PATH``), sets only the text (and picture) the conversation added since, executes, and saves the new
state (``pipeline save GeniePipeline PATH``) under ``conversations/<id>/turn_<n>`` on the phone; genie-app's
PipelineCommand takes ``pipeline save|restore PIPELINE_NAME PATH`` and ``pipeline reset PIPELINE_NAME``.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np

from vlmrun.errors import BackendError
from vlmrun.handles import RequestState
from vlmrun_qualcomm import genie_t2t
from vlmrun_qualcomm.adb import Adb
from vlmrun_qualcomm.genie_app import AppDevice
from vlmrun_qualcomm.genie_t2t import Retokenizer, answer_pieces
from vlmrun_qualcomm.sdk import ANDROID, Sdk, newer_than

from .netrun import REMOTE_ROOT, phone_sdk

EXE = "genie-app"
QUERY = "query"
#: where each conversation's files and saved pipeline states live, under genie-app's working directory
CONVERSATIONS = "conversations"
PIPELINE = "GeniePipeline"
#: how a genie-app older than its `pipeline save` / `pipeline restore` commands refuses them (PipelineCommand's
#: validation: any other subcommand is "Ill-formatted command: <line>.")
REFUSED = re.compile(r"^(Ill-formatted command|Unknown command): pipeline (save|restore)\b")
#: runtime options a bundle takes (where and how it runs); everything else was fixed when it was written
RUNTIME_OPTIONS = {"target", "sdk_root", "ndk_root", "device", "adb", "adb_timeout", "timeout"}


def device_files(sdk: Sdk, arch: str, ndk_root=None) -> dict[str, Path]:
    """genie-app and the HTP runtime, ``{name on the phone: local file}``; one BackendError line naming every
    missing SDK file."""
    why = "to run a bundle on a phone (genie-app)"
    files = {k: v for k, v in sdk.require_genie_htp(arch, ndk_root, why=why).items() if k != "genie-t2t-run"}
    app = sdk.root / "bin" / ANDROID / EXE
    if not app.is_file():
        raise BackendError(f"the QAIRT SDK lacks bin/{ANDROID}/{EXE}, needed {why}; {sdk.where}")
    return {EXE: app, **files}


class BundlePhone:
    """A bundle placed on a phone; `generate` runs one query through genie-app."""

    def __init__(self, runtime, rt):
        """``runtime``: the `.bundle_run.BundleRuntime`; ``rt``: its runtime options (a `.plan.Runtime`)."""
        from .bundle import verify_bundle

        m = runtime.manifest
        self.runtime, self.timeout = runtime, rt.timeout
        sdk = phone_sdk(rt.sdk_root)
        if newer_than(m["qnn_version"], sdk.version()):  # before adb is even asked for a device
            raise BackendError(f"bundle {runtime.path.name} holds binaries from QNN {m['qnn_version']}, newer than"
                               f" the phone's SDK ({sdk.version()}): use a QAIRT SDK >= {m['qnn_version']}")
        verify_bundle(runtime.path)  # files and hashes before anything is pushed
        if not m.get("weight_sharing"):
            raise BackendError(f"bundle {runtime.path.name} was written for this machine (unshared part binaries);"
                               " write one for the phone: vlmrun bundle OUT --target android")
        self.files = device_files(sdk, m["arch"], rt.ndk_root)
        self.arch, self.soc = m["arch"], m["soc"]
        self.rd = f"{REMOTE_ROOT}/bundles/{runtime.path.name}"
        self.adb = Adb.connect(rt.device, rt.adb, timeout=rt.adb_timeout)
        t0 = time.perf_counter()
        self.adb.mkdir(f"{self.rd}/{QUERY}")
        dirs = set()
        for name in m["files"]:
            parent = name.rpartition("/")[0]
            if parent and parent not in dirs:
                self.adb.mkdir(f"{self.rd}/{parent}")
                dirs.add(parent)
            self.adb.push(runtime.path / name, f"{self.rd}/{name}")
        for name, local in self.files.items():
            self.adb.push(local, f"{self.rd}/{name}")
        self.adb.shell(["chmod", "755", f"{self.rd}/{EXE}"], what="adb shell chmod")
        self.load_s = time.perf_counter() - t0
        self.device = AppDevice(self.adb, self.rd, "", self.env(), self.timeout, self.explain)

    @property
    def last_command(self) -> str:
        """The last genie-app command line run on the phone."""
        return self.device.last_command

    def env(self) -> dict[str, str]:
        return {"LD_LIBRARY_PATH": self.rd, "ADSP_LIBRARY_PATH": self.rd}

    def explain(self, line: str) -> str:
        from .genie_phone import explain

        return explain(line, self.soc, self.arch, self.rd)

    def start(self, script: str = f"{QUERY}/script.txt"):
        """genie-app over a pushed script (relative to the bundle's directory on the phone), its stdout read as it
        arrives (a `vlmrun_qualcomm.adb.ShellStream`); `check` it once read."""
        return self.device.start(script)

    def check(self, run) -> None:
        """An ended genie-app run: any error line on stderr (a failing script line leaves the exit status at 0) or a
        non-zero status is one BackendError line."""
        errors = self.device.errors(run)
        if errors:
            raise BackendError(self.explain(f"{self.device.what}: {errors[0]}"))

    def _run_script(self) -> tuple[str, float]:
        """genie-app over the pushed ``query/script.txt`` read to its end: (stdout, seconds)."""
        run = self.start()
        for _ in run:
            pass
        self.check(run)
        return run.stdout or "", run.seconds

    def perplexity(self, text: str, generator_config: dict) -> float:
        """The perplexity of ``text`` by the bundle's text generator (``generator_config``, e.g. the bundle's
        ``text-generator.json``), computed on the phone by genie-app's ``accuracy`` commands (libGenie's
        GenieAccuracy): the text, the configs and the script pushed under ``query/``, the result JSON read back."""
        from vlmrun_qualcomm.genie_accuracy import accuracy_config, accuracy_script, read_perplexity

        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-bundle-phone-ppl-"))
        q = f"{self.rd}/{QUERY}"
        names = ("dataset.txt", "text-generator.json", "accuracy.json", "script.txt")
        try:
            (tmp / "dataset.txt").write_text(text, encoding="utf-8")
            (tmp / "text-generator.json").write_text(json.dumps(generator_config, indent=1))
            (tmp / "accuracy.json").write_text(json.dumps(accuracy_config(f"{QUERY}/dataset.txt")))
            (tmp / "script.txt").write_text(accuracy_script(f"{QUERY}/text-generator.json", f"{QUERY}/dataset.txt",
                                                            f"{QUERY}/accuracy.json", f"{QUERY}/perplexity.json"))
            self.adb.shell(["rm", "-f", f"{q}/perplexity.json"], what="adb shell rm")  # no stale result
            for f in names:
                self.adb.push(tmp / f, f"{q}/{f}", skip_same=False)
            stdout, seconds = self._run_script()
            try:
                local = self.adb.pull(f"{q}/perplexity.json", tmp / "perplexity.json")
            except BackendError:
                raise BackendError(f"genie-app on {self.adb.serial} wrote no perplexity ({QUERY}/perplexity.json)"
                                   " and printed no error") from None
            ppl = read_perplexity(local.read_text(encoding="utf-8", errors="replace"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.runtime.last_timings = {"perplexity_wall_ms": seconds * 1e3}
        return ppl

    def push_turn(self, files: dict[str, str | bytes], where: str = QUERY) -> None:
        """``{name: content}`` written and pushed into ``where`` (relative to the bundle's directory)."""
        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-bundle-phone-"))
        try:
            for name, content in files.items():
                local = tmp / name
                local.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
                self.adb.push(local, f"{self.rd}/{where}/{name}", skip_same=False)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def answer(self, req, before: str, after: str, generator_config: dict) -> Iterator[str]:
        """One query on the phone, from the start: its files pushed, genie-app run; the answer's text in pieces as
        it is generated, each cut where the tokenization can no longer change (a piece tokenizes as it does in the
        whole answer)."""
        from .bundle import app_script

        script = app_script(f"{QUERY}/prompt_prefix.txt", f"{QUERY}/pixel_values.raw", f"{QUERY}/prompt_suffix.txt")
        self.push_turn({"prompt_prefix.txt": before, "prompt_suffix.txt": after,
                        "pixel_values.raw": np.ascontiguousarray(req.pixel_values, np.float32).tobytes(),
                        "text-generator.json": json.dumps(generator_config, indent=1),
                        "script.txt": script.replace("text-generator.json", f"{QUERY}/text-generator.json")})
        run = self.start()
        retok, text, sent = Retokenizer(self.runtime.model.tokenizer), "", 0
        for piece in answer_pieces(run):
            text += piece
            cut = retok.cut(text)
            if cut > sent:
                yield text[sent:cut]
                sent = cut
        self.check(run)
        self.answered(run)
        self.runtime.last_timings = {"pipeline_wall_ms": run.seconds * 1e3}
        if len(text) > sent:
            yield text[sent:]

    def answered(self, run) -> str:
        """The answer of an ended, error-free run; a run that printed none, or an empty one, is a BackendError."""
        text, _, state = genie_t2t.split_t2t_stdout(run.stdout)
        if text is None or state != "end":
            raise BackendError(f"{self.device.what} printed no answer ([BEGIN]: ... [END]) and no error; check the"
                               " bundle with vlmrun bundle --verify")
        if not text:
            raise BackendError(f"{self.device.what}: the pipeline returned success with no text")
        return text


def turn_script(generator: str, inputs: list[tuple[str, str]], save: str | None, restore: str | None = None) -> str:
    """One conversation turn as a genie-app script: the bundle's pipeline built with the generator config
    ``generator``, the state an earlier turn saved at ``restore`` put back (none: from nothing), the turn's
    ``inputs`` set in order (``("text", FILE)`` into the text encoder, ``("image", FILE)``, float32 pixels, into the
    image encoder), the pipeline executed and its state saved at ``save`` (a directory; none: not saved). Paths are
    relative to genie-app's working directory (the bundle's); genie-app splits lines at spaces, so none may hold
    one."""
    from .bundle import CONNECTIONS, NODES

    for path in (generator, save, restore, *(f for _, f in inputs)):
        if path is not None and (not path or any(c.isspace() for c in path)):
            raise BackendError(f"a genie-app script path cannot hold spaces (genie-app splits lines at them): {path!r}")
    lines = ["pipeline config create pipelineConfig", f"pipeline create {PIPELINE} pipelineConfig"]
    for node, cfg in NODES.items():
        lines += [f"node config create {node}Config {generator if node == 'textGenerator' else cfg}",
                  f"node create {node} {node}Config"]
        if node == "textGenerator":
            lines.append(f"node set textCallback {node} GENIE_NODE_TEXT_GENERATOR_TEXT_OUTPUT")
    lines += [f"pipeline add {PIPELINE} {node}" for node in NODES]
    lines += [f"pipeline connect {PIPELINE} {p} {pio} {c} {cio}" for p, pio, c, cio in CONNECTIONS]
    if restore:
        lines.append(f"pipeline restore {PIPELINE} {restore}")
    for kind, path in inputs:
        lines.append(f"node set textFile lutEncoder GENIE_NODE_TEXT_ENCODER_TEXT_INPUT {path}" if kind == "text" else
                     f"node set image imageEncoder GENIE_NODE_IMAGE_ENCODER_IMAGE_INPUT {path}")
    lines.append(f"pipeline execute {PIPELINE}")
    if save:
        lines.append(f"pipeline save {PIPELINE} {save}")
    lines += [f"node free {node}" for node in NODES] + [f"pipeline free {PIPELINE}"]
    return "\n".join(lines) + "\n"


class PhoneConversation(RequestState):
    """A conversation kept in Genie's pipeline on a phone (``request_state`` of a bundle run there). genie-app runs
    one script and exits, so the pipeline does not stay alive between turns: each turn is one script
    (`turn_script`) that restores the state an earlier turn saved (``pipeline restore``), sets only the text (and
    picture) the conversation added since, executes and saves the new state (``pipeline save``) under
    ``conversations/<id>/turn_<n>`` on the phone.

    As on this machine (`.bundle_run.BundleConversation`), what a saved state holds is tracked as text: the rendered
    prompt and the answer (the end token Genie stopped at is sampled, not fed: the next turn's new text starts with
    it). A turn starts from the newest saved state whose text the conversation extends (an undo or an edit restores
    an older one; other sampling settings or another picture start from nothing, the same answer, slower). An answer
    that reached the token budget leaves Genie holding all but its last token, which no text says: its state is not
    kept. A saved state gone from the phone is a BackendError, and the next turn starts from the beginning. A turn
    stopped before its end (genie-app killed) saves nothing. A genie-app that refuses ``pipeline save`` (older than
    the command) answers the turn all the same; ``no_state`` then says so (one warning line) and every later turn
    runs from the start: the same answer, slower."""

    def __init__(self, phone: BundlePhone):
        self.phone, self.rt = phone, phone.runtime
        self.dir = f"{CONVERSATIONS}/{uuid.uuid4().hex[:12]}"
        self.saves: list[tuple[str, str, str | None]] = []  # (text held, directory under rd, picture), oldest first
        self.key = ""
        self.turns = self.device_bytes = 0
        self.length = self.reused = 0
        self.no_state = ""
        self._made = False

    @property
    def nbytes(self) -> int:
        """The saved states on the phone (``du`` after each turn)."""
        return int(self.device_bytes)

    def reset(self) -> None:
        if self._made:
            self.phone.device.remove(self.dir)
        self._made, self.saves, self.device_bytes, self.length = False, [], 0, 0

    def close(self) -> None:
        """Remove the conversation's files from the phone."""
        self.reset()

    def _drop(self, which) -> None:
        """Forget (and remove from the phone) the saved states ``which((text, path, picture))`` selects."""
        gone = [s for s in self.saves if which(s)]
        self.saves = [s for s in self.saves if not which(s)]
        for _, path, _ in gone:
            self.phone.device.remove(path)

    def run(self, req) -> Iterator[int]:
        rt, tok = self.rt, self.rt.model.tokenizer
        turn = rt.turn(req)
        text, picture, config, key, image_token = turn.text, turn.picture, turn.config, turn.key, turn.image_token
        if key != self.key:  # other sampling settings or length: no saved state fits
            self._drop(lambda s: True)
            self.key = key
        self._drop(lambda s: not text.startswith(s[0]))  # states of undone or edited turns: never again
        held, restore = next(((h, p) for h, p, pic in reversed(self.saves) if turn.continues(h, pic)), ("", None))
        new = text[len(held):]
        total = int(req.input_ids.shape[1])
        self.reused = self.length = max(total - rt.fed_positions(new, image_token), 0)
        self.turns += 1
        save = None if self.no_state else f"{self.dir}/turn_{self.turns}"
        run = self._start(req, new, image_token, config, save, restore)
        retok, answer, count, kept = Retokenizer(tok), "", 0, False
        try:
            for piece in answer_pieces(run):
                answer += piece
                ids = retok.stable(answer)
                count += len(ids)
                self.length = total + count
                yield from ids
            self._check(run, restore, save)
            rest = retok.final(answer)
            count = len(retok.sent)
            self.length = total + count
            if save and count < req.max_new_tokens and self.phone.device.exists(save):  # Genie holds it all
                self.saves.append((text + answer, save, picture if image_token in text else None))
                kept = True
        finally:
            if save and not kept:  # failed, stopped, or a state no text describes: never restored
                self.phone.device.remove(save)
            self.device_bytes = self.phone.device.bytes_of(self.dir)
        rt.last_timings = {"pipeline_wall_ms": run.seconds * 1e3}
        yield from rest
        if req.stop_ids and count < req.max_new_tokens:
            yield min(req.stop_ids)

    def _start(self, req, new: str, image_token: str, config: dict, save: str, restore: str | None):
        """The turn's files pushed (the generator config, the new text around the picture if it comes now, the
        pixels, the script) and genie-app started on them."""
        n, files, inputs = self.turns, {}, []
        parts = new.split(image_token, 1) if image_token in new else [new]
        for k, part in enumerate(parts):
            if k:
                files[f"turn_{n}_pixels.raw"] = np.ascontiguousarray(req.pixel_values, np.float32).tobytes()
                inputs.append(("image", f"{self.dir}/turn_{n}_pixels.raw"))
            if part:  # Genie takes no empty text
                files[f"turn_{n}_text_{k}.txt"] = part
                inputs.append(("text", f"{self.dir}/turn_{n}_text_{k}.txt"))
        files["text-generator.json"] = json.dumps(config, indent=1)
        files[f"turn_{n}.txt"] = turn_script(f"{self.dir}/text-generator.json", inputs, save, restore)
        if not self._made:
            self.phone.adb.mkdir(f"{self.phone.rd}/{self.dir}")
            self._made = True
        self.phone.push_turn(files, self.dir)
        return self.phone.start(f"{self.dir}/turn_{n}.txt")

    def _check(self, run, restore: str | None, save: str | None) -> None:
        """An ended turn: an error line, no answer or an empty one is a BackendError (`run` removes the save); a
        restore whose saved state has gone from the phone says so, and the next turn starts from nothing; a
        refused ``pipeline save`` (an older genie-app) turns the conversation's state off (`no_state`)."""
        device = self.phone.device
        errors = device.errors(run)
        if errors and save and all(REFUSED.match(e) for e in errors):
            self.no_state = (f"{device.what} refuses `pipeline save` (a genie-app older than the command): each turn"
                             " of a conversation on the phone runs from the start, the same answer, slower")
            warnings.warn(self.no_state, RuntimeWarning, stacklevel=2)
            errors = []
        try:
            if errors:
                raise BackendError(self.phone.explain(f"{device.what}: {errors[0]}"))
            self.phone.answered(run)
        except BackendError as exc:
            if restore and not device.exists(restore):
                self._drop(lambda s: True)
                raise BackendError(f"{device.what}: {(errors or [str(exc)])[0]} (pipeline restore {restore}): the"
                                   " pipeline state saved on the phone after an earlier turn is gone from"
                                   f" {self.phone.rd}; the next turn starts the conversation from its beginning"
                                   ) from None
            raise
