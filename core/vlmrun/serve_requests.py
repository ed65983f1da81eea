"""What ``vlmrun serve`` accepts: the body of ``/v1/chat/completions`` parsed into a `ChatRequest` (the whole
conversation, its pictures decoded, local paths read only under ``--allowed-local-media-path``), and the OpenAI-style
error (`RequestError`) every bad request gets before anything runs."""

import base64
import binascii
import io
import math
import os
import stat
import warnings
from pathlib import Path

import attrs

from .errors import InputError, VlmrunError
from .preprocess import IMAGE_PLACEHOLDER, placeholder_in_text
from .sampling import SEED_MAX

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # a request's image, decoded
MAX_IMAGE_PIXELS = 40_000_000  # above this PIL's decompression-bomb check refuses the image
DEFAULT_MAX_TOKENS = 256


class RequestError(Exception):
    """A bad request: ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


MAX_PICTURES = 8  # pictures in one request's conversation


@attrs.define
class ChatRequest:
    images: list  # the conversation's pictures (PIL images), in the order they appear
    prompt: str  # the last user turn's text
    system: str | None
    messages: list  # the whole conversation (system, user and assistant turns), as vlmrun.preprocess.render_messages takes it
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    plan: object = None  # the conversation's TurnPlan (vlmrun.conversation), made once by the handler when it checks it

    @property
    def image(self):
        """The first picture (None in a text-only conversation)."""
        return self.images[0] if self.images else None


# -- parsing --------------------------------------------------------------------------------------------------
def _number(body: dict, key: str, kind, default, lo=None, hi=None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise RequestError(400, f"'{key}' must be {'an integer' if kind is int else 'a number'}", key)
    value = kind(value)
    if not math.isfinite(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise RequestError(400, f"'{key}' must be {rng}, got {value}", key)
    return value


def _forbidden_path(url: str, allowed: Path | None) -> RequestError:
    """The one answer for a local path the server will not read: the same whether the file exists or not."""
    if allowed is None:
        return RequestError(400, "local image paths are not accepted by this server (it was started without"
                            " --allowed-local-media-path); send a data: URI", "messages", "local_path_forbidden")
    return RequestError(400, "the image path is not under the server's allowed local media folder"
                        " (--allowed-local-media-path)", "messages", "local_path_forbidden")


def read_local_image(url: str, allowed: Path | None) -> bytes:
    """The bytes of a local image ``url`` (``file://`` or a plain path; a relative one is taken under ``allowed``),
    read only when it resolves (symlinks and ``..`` followed) to a regular file under ``allowed``; at most
    ``MAX_IMAGE_BYTES + 1`` bytes are read. Anything else: a RequestError that says nothing about the file."""
    if allowed is None:
        raise _forbidden_path(url, None)
    raw = url[len("file://"):] if url.startswith("file://") else url
    if url.startswith("file://localhost/"):  # RFC 8089: the local host named
        raw = raw[len("localhost"):]
    try:
        real = (allowed / raw).resolve()  # an absolute raw replaces allowed; a symlink loop raises
    except (OSError, RuntimeError, ValueError):
        raise _forbidden_path(url, allowed) from None
    if not real.is_relative_to(allowed):
        raise _forbidden_path(url, allowed)
    try:  # the resolved path, not following a link swapped in since; not blocking on a FIFO
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RequestError(400, f"image {url} does not exist", "messages", "image_not_found") from None
    except OSError:
        raise _forbidden_path(url, allowed) from None
    try:  # checked before it becomes a file object (a folder cannot be one); the descriptor closed whatever happens
        st, proc = os.fstat(fd), Path(f"/proc/self/fd/{fd}")
        if not stat.S_ISREG(st.st_mode) or (proc.exists() and not Path(os.readlink(proc)).is_relative_to(allowed)):
            raise _forbidden_path(url, allowed)
        if st.st_size > MAX_IMAGE_BYTES:
            raise RequestError(413, f"the image is {st.st_size} bytes; the limit is {MAX_IMAGE_BYTES}", "messages")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_IMAGE_BYTES + 1)
    except OSError:
        raise _forbidden_path(url, allowed) from None
    finally:
        os.close(fd)


def decode_image(url: str, allowed_media: Path | None = None):
    """An ``image_url``: a ``data:`` URI (base64), or a local path (``file://`` or plain) under ``allowed_media``
    (a resolved folder; None: no local path is read); a PIL image, or a RequestError (400) saying what is wrong."""
    from PIL import Image, UnidentifiedImageError

    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise RequestError(400, "an image data: URI must be base64 (data:image/png;base64,...)", "messages")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(400, "the image's base64 data is malformed", "messages", "bad_base64") from None
    elif url.startswith(("http://", "https://")):
        raise RequestError(400, "remote image URLs are not fetched; send a data: URI", "messages")
    else:
        data = read_local_image(url, allowed_media)
    if len(data) > MAX_IMAGE_BYTES:
        raise RequestError(413, f"the image is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}", "messages")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, MAX_IMAGE_PIXELS
            try:
                img = Image.open(io.BytesIO(data))
                if img.width * img.height > MAX_IMAGE_PIXELS:
                    raise Image.DecompressionBombError("too many pixels")
                img.load()
            finally:
                Image.MAX_IMAGE_PIXELS = saved
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise RequestError(400, f"the image has more than {MAX_IMAGE_PIXELS} pixels (a decompression bomb?)",
                           "messages", "image_too_large") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise RequestError(400, "the image cannot be decoded (not an image, or truncated)", "messages",
                           "bad_image") from None
    return img.convert("RGB")


def parse_chat(body, model_id: str, allowed_media: Path | None = None) -> ChatRequest:
    """The JSON body of /v1/chat/completions as a `ChatRequest`, or a RequestError; local image paths are
    read only under ``allowed_media`` (see `decode_image`)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_id:
        raise RequestError(404, f"model '{model}' does not exist; this server serves '{model_id}' (GET /v1/models)",
                           "model", "model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    system, images, turns = None, [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise RequestError(400, f"messages[{i}] must be an object with role system, user or assistant",
                               "messages")
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise RequestError(400, f"messages[{i}].content must be a string or a list of parts", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        turn: list[dict] = []  # this turn as the chat template takes it: text parts and the picture where it is
        for p in parts:
            if not isinstance(p, dict):
                raise RequestError(400, f"messages[{i}].content has a part that is not an object", "messages")
            if p.get("type") == "text" and isinstance(p.get("text"), str):
                if IMAGE_PLACEHOLDER in p["text"]:
                    raise RequestError(400, placeholder_in_text(i), "messages", "image_placeholder_in_text")
                turn.append({"type": "text", "text": p["text"]})
                if role == "system":
                    system = p["text"]
            elif p.get("type") == "image_url":
                if role != "user":
                    raise RequestError(400, f"messages[{i}]: only a user turn can hold the picture", "messages")
                url = p.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise RequestError(400, f"messages[{i}] has an image_url part without a url", "messages")
                images.append(url)
                turn.append({"type": "image"})
            else:
                raise RequestError(400, f"messages[{i}] has a part of unknown type {p.get('type')!r}", "messages")
        if role == "assistant" and any(t.get("type") != "text" for t in turn):
            raise RequestError(400, f"messages[{i}]: an assistant turn holds text only", "messages")
        if not any(t.get("type") == "image" or t.get("text", "").strip() for t in turn):
            raise RequestError(400, f"messages[{i}] is an empty turn (no text, no picture)", "messages", "empty_turn")
        # the picture first in its turn, whatever order the client sent the parts in: FastVLM's prompts put it there
        turns.append({"role": role, "content": sorted(turn, key=lambda t: t.get("type") != "image")})
    if len(images) > MAX_PICTURES:
        raise RequestError(400, f"a conversation holds at most {MAX_PICTURES} pictures; this one has {len(images)}",
                           "messages", "too_many_images")
    if turns[-1]["role"] != "user":
        raise RequestError(400, "the last message must be the user's (the turn to answer)", "messages")
    prompt = "".join(t["text"] for t in turns[-1]["content"] if t.get("type") == "text").strip()
    if not prompt and not any(t.get("type") == "image" for t in turns[-1]["content"]):
        raise RequestError(400, "the user message has no text", "messages")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
        raise RequestError(400, "'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError(400, "'stream_options' must be an object ({\"include_usage\": true})", "stream_options")
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):  # several answers per request are not made: refused, not silently one
        raise RequestError(400, f"'n' must be 1 (this server makes one answer per request), got {body.get('n')!r}",
                           "n")
    return ChatRequest(
        images=[decode_image(u, allowed_media) for u in images], prompt=prompt, system=system, messages=turns,
        max_tokens=_number(body, "max_tokens", int, _number(body, "max_completion_tokens", int, DEFAULT_MAX_TOKENS,
                                                            1), 1),
        temperature=_number(body, "temperature", float, 0.0, 0.0, 2.0),
        top_p=_number(body, "top_p", float, 1.0, 0.0, 1.0),
        # none given: a fresh one per request (OpenAI's meaning); at most SEED_MAX, what every runtime takes
        seed=_number(body, "seed", int, None, 0, SEED_MAX),
        stop=stop, stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
    )


def as_request_error(exc: Exception) -> RequestError:
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, InputError):
        return RequestError(400, str(exc))
    if isinstance(exc, VlmrunError):
        return RequestError(500, str(exc), kind="server_error", code="backend_error")
    return RequestError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
