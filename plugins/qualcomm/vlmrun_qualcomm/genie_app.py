"""genie-app's dialog on a phone: a conversation kept there between turns.

genie-app runs one script and exits, so a dialog cannot stay alive between turns: each turn is one script run over
adb (`dialog_script`) that restores the state the previous turn saved (``dialog restore``), queries only the
turn's new rows (``dialog embeddingQuery``) and saves the new state (``dialog save``). `AppDialogState` is the
host's side (a `vlmrun.handles.DecoderState`); `app_errors` reads genie-app's stderr, where a failing script line
is printed (in red) while the script goes on with exit status 0. The answer streams back as genie-app prints it
(`AppDevice.start`); the errors are read once the run ended.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import attrs
import numpy as np

from vlmrun.errors import BackendError, UsageError
from vlmrun.handles import DecoderState

from .adb import Adb
from .genie import CONTEXT_LIMIT, ContextLimitError, check_context, last_error_line, write_embeddings
from .genie_t2t import BENIGN_LINE, Retokenizer, answer_pieces, split_t2t_stdout

APP = "genie-app"
#: colour codes: genie-app prints each failing script line's exception in red on Linux and Android
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RED = "\x1b[91m"
#: an error line of genie-app on stderr: its own exceptions (`[SOURCE LINE]: reason`), Genie's, the loader's
APP_ERROR = re.compile(r"^\s*(\[\d+\]: .*|\[ERROR\].*|ERROR\b.*|Error\b.*|Failed to .*|.*\bfailed\b.*|"
                       r"Unknown command.*|Ill-formatted command.*|CANNOT LINK.*|.*No such file.*|"
                       r".*does not exist.*)$", re.M)
DIALOG, DIALOG_CONFIG = "vlmrunDialog", "vlmrunDialogConfig"
#: where each conversation's files and saved states live, under genie-app's working directory
DIALOGS = "dialogs"


def app_errors(stderr: str) -> list[str]:
    """genie-app's error lines in ``stderr``, colour codes dropped: every line it printed in red (the exception of a
    failing script line) and every line that reads as an error (Genie's, the loader's). A failing script line is
    printed there and the script goes on: the exit status says nothing about it."""
    found = []
    for raw in (stderr or "").splitlines():
        line = ANSI.sub("", raw).strip()
        if line and (RED in raw or APP_ERROR.match(line)) and not BENIGN_LINE.match(line):
            found.append(line)
    return found


def dialog_script(config: str, embeddings: str, lut: str, save: str, restore: str | None = None) -> str:
    """One conversation turn as a genie-app script (``genie-app -s``): a dialog made from ``config``, the state an
    earlier turn saved at ``restore`` put back (none: a new dialog), the turn's rows (``embeddings``, float32
    [N, hidden]) queried with the token table ``lut`` (Genie embeds each generated token with it), the dialog's new
    state saved at ``save`` (a directory). Paths are relative to genie-app's working directory; genie-app splits its
    lines at spaces, so no path may hold one."""
    for path in (config, embeddings, lut, save, restore):
        if path is not None and (not path or any(c.isspace() for c in path)):
            raise UsageError(f"a genie-app script path cannot hold spaces (genie-app splits lines at them): {path!r}")
    lines = [f"dialog config create {DIALOG_CONFIG} {config}", f"dialog create {DIALOG} {DIALOG_CONFIG}"]
    if restore:
        lines.append(f"dialog restore {DIALOG} {restore}")
    lines += [f"dialog embeddingQuery {DIALOG} {embeddings} {lut}", f"dialog save {DIALOG} {save}",
              f"dialog free {DIALOG}", f"dialog config free {DIALOG_CONFIG}"]
    return "\n".join(lines) + "\n"


def state_key(config: Mapping) -> str:
    """What a saved dialog state depends on: the dialog config but its per-turn settings (sampler, length, stops)."""
    body = dict(config.get("dialog", config))
    for key in ("sampler", "max-num-tokens", "stop-sequence"):
        body.pop(key, None)
    body["context"] = {k: v for k, v in dict(body.get("context") or {}).items() if k != "eos-token"}
    return json.dumps(body, sort_keys=True)


@attrs.define
class AppDevice:
    """Where genie-app runs on a phone: ``adb`` (a `vlmrun_qualcomm.adb.Adb`), the working directory ``rd`` holding
    genie-app, the libraries and the model's files (a dialog config names them relative to it), the token table's
    name there (``lut``: float32 [vocab, hidden]), the tool's environment, ``timeout`` (seconds per turn) and
    ``explain`` (a failure line -> the same line plus what to check for a known device error)."""

    adb: Any
    rd: str
    lut: str
    env: Mapping[str, str]
    timeout: float = 600.0
    explain: Callable[[str], str] = attrs.field(default=lambda line: line)
    last_command: str = ""

    @property
    def what(self) -> str:
        return f"genie-app on {self.adb.serial}"

    def start(self, script: str):
        """``./genie-app -s SCRIPT`` in ``rd``, its stdout read as it arrives: a `vlmrun_qualcomm.adb.ShellStream`
        to iterate (the answer with `vlmrun_qualcomm.genie_t2t.answer_pieces`), then `errors` of it."""
        argv = [f"./{APP}", "-s", script]
        self.last_command = Adb.command_line(argv, cwd=self.rd, env=self.env)
        return self.adb.stream(argv, cwd=self.rd, env=self.env, timeout=self.timeout, what=self.what,
                               hint="raise the timeout option if the model is large")

    @staticmethod
    def errors(run) -> list[str]:
        """The error lines of an ended run (its stderr: a failing script line leaves the exit status at 0); a
        non-zero exit (the script could not be read, the tool could not start) is an error line too."""
        errors = app_errors(run.stderr)
        if run.returncode != 0 and not errors:
            errors = [last_error_line(ANSI.sub("", run.stderr)) or f"exit status {run.returncode}"]
        return errors

    def run(self, script: str) -> tuple[str, list[str], float]:
        """`start` read to its end: (stdout, error lines, seconds)."""
        run = self.start(script)
        for _ in run:
            pass
        return run.stdout, self.errors(run), run.seconds

    def exists(self, path: str) -> bool:
        return self.adb.shell(["test", "-e", f"{self.rd}/{path}"], check=False, what="adb shell test").returncode == 0

    def remove(self, path: str) -> None:
        self.adb.shell(["rm", "-rf", f"{self.rd}/{path}"], what="adb shell rm")

    def bytes_of(self, path: str) -> int:
        """The bytes ``path`` takes on the phone (``du -sk``); 0 when unknown."""
        res = self.adb.shell(["du", "-sk", f"{self.rd}/{path}"], check=False, what="adb shell du")
        words = _text(res.stdout).split()
        return int(words[0]) * 1024 if res.returncode == 0 and words and words[0].isdigit() else 0

    def saved_positions(self, save: str) -> int | None:
        """The positions a saved dialog state holds (``n-past`` of the ``dialog.json`` Genie's `dialog save` writes
        into its directory); None when it cannot be read."""
        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-genie-app-state-"))
        try:
            local = self.adb.pull(f"{self.rd}/{save}/dialog.json", tmp / "dialog.json")
            return int(json.loads(local.read_text())["n-past"])
        except (BackendError, OSError, ValueError, KeyError, TypeError):
            return None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _text(out) -> str:
    return out.decode("utf-8", "replace") if isinstance(out, bytes) else (out or "")


class AppDialogState(DecoderState):
    """A conversation kept on a phone by genie-app's dialog commands (``decoder_state`` of a decoder Genie runs on a
    phone). genie-app runs one script and exits, so the dialog does not stay alive between turns: each turn is one
    script (`dialog_script`) that restores the state the previous turn saved (``dialog restore``), queries only the
    turn's new rows (``dialog embeddingQuery``: text and picture rows alike) and saves the new state
    (``dialog save``) under ``dialogs/<conversation>/turn_<n>`` on the phone.

    The host keeps the rows the dialog holds (prompt rows, and each generated token's row but the last, as
    `vlmrun_qualcomm.genie_session.DialogState` does) and, per saved state, the positions it holds. A turn starts
    from the newest saved state within what the conversation keeps and feeds the kept rows after it, then the new
    ones: an undo (`truncate`) restores an older state, and what lies between is fed again (``replayed``). A saved
    state is used only when Genie's own count (``n-past`` in its ``dialog.json``) equals vlmrun's: an answer the
    tokenizer spells otherwise than Genie sampled it is fed again next turn, as a recompute from scratch sees it.
    Other engine settings start from nothing. A saved state that has gone from the phone is a BackendError, and the
    next turn starts from the beginning.

    ``make_config(request)``: the dialog config of a request, its files named relative to ``device.rd``."""

    def __init__(self, device: AppDevice, make_config: Callable[[Any], dict], *, hidden: int, tokenizer,
                 context_length: int):
        self.device, self.make_config, self.tokenizer = device, make_config, tokenizer
        self.context = int(context_length)
        self.dir = f"{DIALOGS}/{uuid.uuid4().hex[:12]}"
        self.rows = np.zeros((0, int(hidden)), np.float32)
        self.length = 0
        self.saves: list[tuple[int, str]] = []  # (positions held, directory under rd), oldest first
        self.key = ""
        self.turns = 0
        self.device_bytes = 0
        self.last_timings: dict = {}
        self._made = False  # the conversation's directory exists on the phone

    # -- the contract ---------------------------------------------------------------------------------------------
    def truncate(self, n: int) -> bool:
        if n < self.length:
            self.rows, self.length = self.rows[:n], int(n)
            self._drop(lambda held: held > n)
        return True

    def reset(self) -> None:
        if self._made:
            self.device.remove(self.dir)
        self._made, self.saves, self.device_bytes = False, [], 0
        self.rows, self.length = self.rows[:0], 0

    def close(self) -> None:
        """Remove the conversation's files from the phone (the host rows go with the state)."""
        self.reset()

    @property
    def nbytes(self) -> int:
        """The host rows and the saved states on the phone (``du`` after each turn)."""
        return int(self.rows.nbytes) + int(self.device_bytes)

    def decode(self, request) -> Iterator[int]:
        """Plan the turn (what to restore, what to feed; ``replayed`` is known before the first token), then run it
        when the tokens are asked for."""
        config = self.make_config(request)
        key = state_key(config)
        if key != self.key:  # other engine settings: no saved state fits
            self._drop(lambda held: True)
            self.key = key
        new = np.asarray(request.inputs_embeds, np.float32).reshape(-1, self.rows.shape[1])
        base = np.concatenate([self.rows[: self.length], new])
        check_context(len(base), request.max_new_tokens, self.context)  # before anything runs on the phone
        held, restore = next(((n, p) for n, p in reversed(self.saves) if n <= self.length), (0, None))
        self.replayed = self.length - held
        return self._turn(request, config, base, held, restore)

    # -- one turn -----------------------------------------------------------------------------------------------
    def _turn(self, request, config: dict, base: np.ndarray, held: int, restore: str | None) -> Iterator[int]:
        """The turn on the phone, its tokens given out as genie-app prints the answer (those whose tokenization
        can no longer change); the conversation's rows and saved states once it ended. A turn stopped before its
        end (genie-app killed) leaves the state as it was: the core recomputes what it needs next turn."""
        self.turns += 1
        save = f"{self.dir}/turn_{self.turns}"
        retok, text = Retokenizer(self.tokenizer), ""
        for piece in self._query(config, base[held:], restore, save):
            text += piece
            yield from retok.stable(text)
        rest = retok.final(text)
        ids = list(retok.sent)
        # Genie hands out no end token (sampled, not fed): an answer ended before the budget had every token fed
        fed = ids if len(ids) < request.max_new_tokens else ids[: max(request.max_new_tokens - 1, 0)]
        tail = (np.asarray(request.embed_tokens(np.asarray(fed, np.int64)), np.float32).reshape(-1, base.shape[1])
                if fed else base[:0])
        self.rows = np.concatenate([base, tail])
        self.length = len(self.rows)
        if self.device.saved_positions(save) == self.length:
            self.saves.append((self.length, save))
        else:  # Genie holds another sequence than the one vlmrun counts: never restored
            self.device.remove(save)
        self.device_bytes = self.device.bytes_of(self.dir)
        yield from rest

    def _query(self, config: dict, feed: np.ndarray, restore: str | None, save: str) -> Iterator[str]:
        """The turn's files pushed and genie-app run: the answer's text pieces as they are printed; an error line
        on stderr is a BackendError once the run ended."""
        dev, n = self.device, self.turns
        names = {"config": f"{self.dir}/genie_config.json", "embeddings": f"{self.dir}/turn_{n}.raw",
                 "script": f"{self.dir}/turn_{n}.txt"}
        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-genie-app-"))
        try:
            (tmp / "config").write_text(json.dumps(config, indent=1))
            write_embeddings(tmp / "embeddings", feed)
            (tmp / "script").write_text(dialog_script(names["config"], names["embeddings"], dev.lut, save, restore))
            if not self._made:
                dev.adb.mkdir(f"{dev.rd}/{self.dir}")
                self._made = True
            for local, name in names.items():
                dev.adb.push(tmp / local, f"{dev.rd}/{name}", skip_same=False)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        run = dev.start(names["script"])
        yield from answer_pieces(run)
        errors = dev.errors(run)
        if errors:
            self._failed(errors[0], restore, save)
        text, _, state = split_t2t_stdout(run.stdout)
        if text is None or state != "end":
            dev.remove(save)
            raise BackendError(f"{dev.what} printed no answer ([BEGIN]: ... [END]) and no error for {names['script']}")
        self.last_timings = {"dialog_wall_ms": run.seconds * 1e3}

    def _failed(self, line: str, restore: str | None, save: str):
        dev = self.device
        dev.remove(save)  # whatever the failing script saved is not the conversation
        if CONTEXT_LIMIT.search(line):
            raise ContextLimitError(f"{dev.what} stopped at the Genie context limit of {self.context} tokens; raise"
                                    " the decoder's context_length or lower --max-new-tokens")
        if restore and not dev.exists(f"{restore}/dialog.json"):
            self._drop(lambda held: True)
            raise BackendError(f"{dev.what}: {line} (dialog restore {restore}): the dialog state saved on the phone"
                               f" after an earlier turn is gone from {dev.rd}; the next turn starts the conversation"
                               " from its beginning")
        raise BackendError(dev.explain(f"{dev.what}: {line}"))

    def _drop(self, which: Callable[[int], bool]) -> None:
        """Forget (and remove from the phone) the saved states ``which(positions)`` selects."""
        gone = [p for n, p in self.saves if which(n)]
        self.saves = [(n, p) for n, p in self.saves if not which(n)]
        for path in gone:
            self.device.remove(path)
        if gone:
            self.device_bytes = self.device.bytes_of(self.dir)
