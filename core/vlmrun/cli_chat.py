"""``vlmrun chat``: a conversation in the terminal, over `vlmrun.conversation.Chat` (registered in
`vlmrun.cli` as ``chat_command``)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import click

from .cli_options import build_pipeline, generation_options, pipeline_options, settings_from
from .errors import InputError, UsageError

HELP = """commands:
  /image PATH   bring a picture into the next question
  /undo         forget the last question and its answer
  /regenerate   answer the last question again
  /reset        start a new conversation
  /help         this text
Ctrl-C stops an answer (the session stays); Ctrl-D (or /quit) leaves."""


def _turns_from(script: Path | None, prompts: tuple[str, ...], image: Path | None) -> list[dict]:
    """The scripted turns: ``--script FILE`` (JSON lines ``{"prompt": ..., "image": PATH}``, a relative picture
    path taken beside the file) or the repeated ``--prompt``s, ``--image`` with the first."""
    if script is not None:
        if prompts:
            raise UsageError("give --script or --prompt, not both")
        try:
            lines = script.read_text().splitlines()
        except OSError as exc:
            raise UsageError(f"cannot read --script {script}: {exc.strerror or exc}") from None
        turns = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                turn = json.loads(line)
            except ValueError:
                raise UsageError(f"{script}:{n}: not a JSON object") from None
            if not isinstance(turn, dict) or not isinstance(turn.get("prompt"), str):
                raise UsageError(f'{script}:{n}: a turn is {{"prompt": "...", "image": "PATH"}} (image optional)')
            pic = turn.get("image")
            turns.append({"prompt": turn["prompt"], "image": (script.parent / pic) if pic else None})
        if image is not None and turns and turns[0]["image"] is None:
            turns[0]["image"] = image
        return turns
    return [{"prompt": p, "image": image if i == 0 else None} for i, p in enumerate(prompts)]


class Session:
    """The terminal side of a conversation: slash commands, streamed answers, Ctrl-C."""

    def __init__(self, chat, settings, as_json: bool, timings: bool):
        self.chat, self.settings, self.as_json, self.timings = chat, settings, as_json, timings
        self.image: Path | None = None  # brought by /image, sent with the next question

    def line(self, text: str) -> bool:
        """Handle one line: a slash command or a question. ``False``: leave."""
        text = text.strip()
        if not text:
            return True
        if text.startswith("/"):
            return self.command(text)
        image, self.image = self.image, None
        self.answer(self.chat.ask(text, image=image, settings=self.settings))
        return True

    def command(self, text: str) -> bool:
        name, _, arg = text.partition(" ")
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            click.echo(HELP, err=True)
        elif name == "/image":
            path = Path(arg.strip()).expanduser()
            if not arg.strip():
                raise InputError("/image needs a path: /image photo.jpg")
            if not path.is_file():
                raise InputError(f"image not found: {path}")
            self.image = path
            click.echo(f"(picture {path} goes with the next question)", err=True)
        elif name == "/undo":
            self.chat.undo()
            click.echo(f"(undone; {len(self.chat.messages) // 2} turns left)", err=True)
        elif name == "/regenerate":
            self.answer(self.chat.regenerate(self.settings))
        elif name == "/reset":
            self.chat.reset()
            self.image = None
            click.echo("(a new conversation)", err=True)
        else:
            raise InputError(f"unknown command {name}; /help lists them")
        return True

    def answer(self, gen) -> None:
        if self.as_json:
            gen.run()
            click.echo(json.dumps({"text": gen.text, "token_ids": gen.token_ids, "stopped_by": gen.stopped_by,
                                   "prefill_tokens": gen.timings.get("prefill_tokens"),
                                   "reused_tokens": gen.timings.get("reused_tokens"), "timings": gen.timings}))
            return
        try:
            for piece in gen:
                click.echo(piece, nl=False)
                sys.stdout.flush()
        except KeyboardInterrupt:
            gen.close()
            click.echo(" [stopped]", nl=False)
        click.echo()
        if self.timings:
            t = gen.timings
            click.echo(f"(prefilled {t.get('prefill_tokens', 0)} tokens, reused {t.get('reused_tokens', 0)};"
                       f" TTFT {t.get('ttft_ms', 0):.1f} ms; {t.get('new_tokens', 0)} new tokens)", err=True)


def _interactive(session: Session) -> None:
    import readline  # noqa: F401  (line editing and history for input())

    from .errors import VlmrunError

    prompt = "> " if sys.stdin.isatty() else ""
    if sys.stdin.isatty():  # Ctrl-C stops an answer, even when started from a shell that ignores SIGINT for jobs
        signal.signal(signal.SIGINT, signal.default_int_handler)
        click.echo("(a conversation: type a question; /help for commands, Ctrl-D to leave)", err=True)
    while True:
        try:
            text = input(prompt)
        except EOFError:
            click.echo(err=True)
            return
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            click.echo(err=True)
            continue
        try:
            if not session.line(text):
                return
        except KeyboardInterrupt:  # during a command: the session stays
            click.echo(" [stopped]", err=True)
        except VlmrunError as exc:  # a bad picture, a turn past the context: say so, keep the session
            click.echo(f"vlmrun: error: {exc}", err=True)


@click.command("chat", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--image", type=click.Path(path_type=Path), help="A picture for the first question.")
@click.option("--system", default=None, help="The system prompt (default: the model's own).")
@click.option("--prompt", "prompts", multiple=True,
              help="A question (repeatable): answer each in turn and exit; the same /commands work.")
@click.option("--script", type=click.Path(path_type=Path), metavar="FILE.jsonl",
              help='Turns as JSON lines {"prompt": "...", "image": "PATH"} (image optional): answer each and exit.')
@click.option("--no-keep-state", is_flag=True,
              help="Recompute every turn from the start instead of continuing from the decoder's kept state.")
@click.option("--timings", is_flag=True, help="After each answer, how many tokens were prefilled and reused.")
@pipeline_options
@generation_options
def chat_command(image, system, prompts, script, no_keep_state, timings, **opts):
    """Hold a conversation: follow-up questions, a picture in any turn.

    \b
      vlmrun chat --image photo.jpg                              # interactive; /help lists the commands
      vlmrun chat --image photo.jpg --prompt "Describe the image." --prompt "What color is the shape?"
      vlmrun chat --layout all-npu --script turns.jsonl --json
    \b
    Each turn renders the whole history with the model's chat template; the decoder keeps its state between turns,
    so a follow-up prefills only its new tokens (a backend that cannot keep state recomputes: the same answer).
    """
    turns = _turns_from(script, prompts, image)
    first = [(t["image"], t["prompt"]) for t in turns[:1] if t["image"] is not None]
    pipe = build_pipeline(opts, requests=first)
    settings = settings_from(opts)
    chat = pipe.chat(system=system, settings=settings, keep_state=not no_keep_state)
    click.echo(f"[{pipe.layout.describe()}]", err=True)
    if not chat.keeps_state and not no_keep_state:
        click.echo(f"(the decoder's backend ({pipe.layout.backend('decoder')}) keeps no state between turns here:"
                   " each turn is computed from the start, the same answer, slower)", err=True)
    session = Session(chat, settings, opts["as_json"], timings)
    if turns:
        for turn in turns:
            if turn["image"] is not None:
                session.image = turn["image"]
            if not session.line(turn["prompt"]):
                break
        return
    session.image = image
    _interactive(session)
