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
to check for a known device error), whatever the exit status.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from vlmrun.errors import BackendError
from vlmrun_qualcomm import genie_app, genie_t2t
from vlmrun_qualcomm.adb import Adb
from vlmrun_qualcomm.sdk import ANDROID, Sdk, newer_than

from .netrun import REMOTE_ROOT, phone_sdk

EXE = "genie-app"
QUERY = "query"
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
        self.last_command = ""

    def env(self) -> dict[str, str]:
        return {"LD_LIBRARY_PATH": self.rd, "ADSP_LIBRARY_PATH": self.rd}

    def argv(self) -> list[str]:
        return [f"./{EXE}", "-s", f"{QUERY}/script.txt"]

    def explain(self, line: str) -> str:
        from .genie_phone import explain

        return explain(line, self.soc, self.arch, self.rd)

    def _run_script(self) -> tuple[str, float]:
        """genie-app over the pushed ``query/script.txt``: (stdout, seconds); any error line on stderr (a failing
        script line leaves the exit status at 0) or a non-zero status is one BackendError line."""
        from vlmrun import procs

        self.last_command = Adb.command_line(self.argv(), cwd=self.rd, env=self.env())
        what = f"genie-app on {self.adb.serial}"
        t0 = time.perf_counter()
        res = procs.run([self.adb.exe, "-s", self.adb.serial, "shell", self.last_command], timeout=self.timeout,
                        what=what, hint="raise the timeout option if the model is large")
        seconds = time.perf_counter() - t0
        stdout = res.stdout.decode("utf-8", "replace") if isinstance(res.stdout, bytes) else res.stdout
        stderr = res.stderr.decode("utf-8", "replace") if isinstance(res.stderr, bytes) else res.stderr
        errors = genie_app.app_errors(stderr)  # genie-app's error lines, its colour codes dropped
        if errors or res.returncode != 0:
            plain = genie_app.ANSI.sub("", stderr or "").strip()
            line = errors[0] if errors else (plain.splitlines() or [f"exit status {res.returncode}"])[-1]
            raise BackendError(self.explain(f"{what}: {line}"))
        return stdout or "", seconds

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

    def answer(self, req, before: str, after: str, generator_config: dict) -> str:
        """One query on the phone: its files pushed, genie-app run; the answer's text."""
        from .bundle import app_script

        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-bundle-phone-"))
        try:
            (tmp / "prompt_prefix.txt").write_text(before)
            (tmp / "prompt_suffix.txt").write_text(after)
            np.ascontiguousarray(req.pixel_values, np.float32).tofile(tmp / "pixel_values.raw")
            (tmp / "text-generator.json").write_text(json.dumps(generator_config, indent=1))
            script = app_script(f"{QUERY}/prompt_prefix.txt", f"{QUERY}/pixel_values.raw", f"{QUERY}/prompt_suffix.txt")
            (tmp / "script.txt").write_text(script.replace("text-generator.json", f"{QUERY}/text-generator.json"))
            for f in ("prompt_prefix.txt", "prompt_suffix.txt", "pixel_values.raw", "text-generator.json",
                      "script.txt"):
                self.adb.push(tmp / f, f"{self.rd}/{QUERY}/{f}", skip_same=False)
            stdout, seconds = self._run_script()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        what = f"genie-app on {self.adb.serial}"
        text, _, state = genie_t2t.split_t2t_stdout(stdout)
        if text is None or state != "end":
            raise BackendError(f"{what} printed no answer ([BEGIN]: ... [END]) and no error; check the bundle with"
                               " vlmrun bundle --verify")
        if not text:
            raise BackendError(f"{what}: the pipeline returned success with no text")
        self.runtime.last_timings = {"pipeline_wall_ms": seconds * 1e3}
        return text
