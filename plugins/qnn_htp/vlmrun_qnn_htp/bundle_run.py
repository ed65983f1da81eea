"""Running a bundle (``bundle:DIR`` layouts): libGenie's pipeline API over the folder `.bundle` wrote, in a
worker process whose working directory is the bundle (its configs name their files relative to it, as genie-app
runs them on a phone); on a phone, genie-app over adb (`.bundle_phone`).

`BundleRuntime` runs whole requests (the ``run_request`` hook of `.bundle_stage`, whose `BundleStage` is what
``load_stage`` returns for each stage of the layout).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import attrs
import numpy as np

from vlmrun.errors import BackendError, InputError
from vlmrun.handles import RequestState
from vlmrun_qualcomm import genie_pipeline
from vlmrun_qualcomm.genie import ContextLimitError
from vlmrun_qualcomm.genie_pipeline import PipelineSession
from vlmrun.layouts import bundle_manifest

from .bundle import CONNECTIONS, LUT, NODES, split_prompt
from .plan import Runtime


@attrs.frozen
class Turn:
    """One conversation turn as a bundle's kept state sees it (`BundleRuntime.turn`): the rendered prompt, the hash of
    its picture, the generator config it runs with (``key``: that config as text; a state made under another one does
    not fit) and the image placeholder's text."""

    text: str
    picture: str
    config: dict
    key: str
    image_token: str

    def continues(self, held: str, held_picture: str | None) -> bool:
        """Does this turn's prompt extend ``held``, the text a kept state holds (``held_picture``: the hash of the
        picture where that text holds the image placeholder)?"""
        return (len(self.text) > len(held) and self.text.startswith(held)
                and (self.image_token not in held or held_picture == self.picture))


class BundleRuntime:
    """A bundle run by libGenie's pipeline API in a worker process whose working directory is the bundle."""

    def __init__(self, path: Path, model, options: dict | None = None):
        """``options``: the runtime options the bundle runs with (`.bundle_phone.RUNTIME_OPTIONS`; the ones not
        given at their declared defaults, `.plan.Runtime.of`)."""
        rt = Runtime.of("decoder", options)
        self.path = Path(path).resolve()
        self.manifest = bundle_manifest(self.path)
        self.model = model
        self.timeout = rt.timeout
        self.last_timings: dict = {}
        self._lut = None
        self.phone = None
        if rt.target == "android":  # genie-app on the phone (bundle_phone.py)
            from .bundle_phone import BundlePhone

            self.phone = BundlePhone(self, rt)
            return
        from .genie_engine import libgenie_path

        self.lib = libgenie_path()
        self._check_files()
        if not self.manifest.get("loads_on_emulator", False):
            from . import ep

            if ep.is_emulator():
                raise BackendError(f"bundle {path} holds weight-shared binaries for a device, which this machine's"
                                   " HTP emulator cannot load; run it on a phone (--target android) or write an"
                                   " emulator bundle (vlmrun bundle without --target android)")

    def _check_files(self) -> None:
        """Every file the manifest lists is there at its recorded size (a stat each, no hashing: ``bundle
        --verify`` hashes). Genie meets a missing or truncated file with unrelated text ("lut-Encoder does not
        support kpis method"), so the bundle's own record says it first, in one line."""
        for name, info in sorted(self.manifest.get("files", {}).items()):
            f = self.path / name
            if not f.is_file():
                raise BackendError(f"bundle {self.path.name}: {name} is missing; copy the whole bundle folder again"
                                   f" (or write it again: vlmrun bundle)")
            size = f.stat().st_size
            if "bytes" in info and size != int(info["bytes"]):
                raise BackendError(f"bundle {self.path.name}: {name} is {size} bytes, the manifest records"
                                   f" {int(info['bytes'])} (truncated or replaced); copy the bundle again, or check it"
                                   f" with vlmrun bundle --verify")

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows of the bundle's token table as float32 [n, hidden], dequantized from its stored encoding (only the
        rows asked for: a full-size table is 136 M entries)."""
        if self._lut is None:
            info = self.manifest["lut"]
            self._lut = np.memmap(self.path / LUT, dtype=info.get("dtype", "float32"), mode="r",
                                  shape=tuple(info["shape"]))
        rows = np.asarray(self._lut[np.asarray(ids, np.int64).reshape(-1)])
        info = self.manifest["lut"]
        if info.get("dtype", "float32") == "float32":
            return rows.astype(np.float32)
        from .image_encoder import dequantize_values

        return dequantize_values(rows, info).astype(np.float32)

    def turn(self, req) -> Turn:
        """``req`` (a `vlmrun.stages.RequestRun`) as a conversation's kept state sees it."""
        config = self.generator_config(req.sampling, req.max_new_tokens, req.stop_ids)
        picture = hashlib.sha256(np.ascontiguousarray(req.pixel_values, np.float32).tobytes()).hexdigest()
        return Turn(req.prompt_text, picture, config, json.dumps(config, sort_keys=True),
                    self.model.tokenizer.id_to_token(self.model.image_token_id))

    def fed_positions(self, new: str, image_token: str) -> int:
        """The decoder positions the text ``new`` feeds: its tokens, and the picture's when it holds the
        placeholder."""
        fed = len(self.model.tokenizer.encode(new.replace(image_token, ""), add_special_tokens=False).ids)
        return fed + (self.model.image_tokens if image_token in new else 0)

    def generator_config(self, sampling, max_new_tokens: int, stop_ids, tap: bool = False) -> dict:
        """The bundle's text-generator config with this request's sampler, length and stop tokens; ``tap``: the
        custom sampler that hands every step's logits to the host and forces the teacher's tokens
        (`vlmrun_qualcomm.genie_sampler`)."""
        from vlmrun_qualcomm import genie_config
        from vlmrun_qualcomm.genie_sampler import custom_sampler_block

        cfg = json.loads((self.path / NODES["textGenerator"]).read_text())
        body = cfg["text-generator"]
        body["max-num-tokens"] = int(max_new_tokens)
        if tap:
            body["sampler"] = custom_sampler_block()
        elif sampling is not None:
            body["sampler"] = genie_config.sampler_config(sampling, body["context"]["n-vocab"])
        if stop_ids is not None:
            stops = sorted(stop_ids) or [body["context"]["n-vocab"] - 1]
            body["context"]["eos-token"] = stops[0] if len(stops) == 1 else stops
        return cfg

    def perplexity(self, text: str) -> float:
        """Perplexity of ``text`` through the bundle's own text generator (libGenie's accuracy API): on this machine
        in a worker process, on a phone through genie-app's ``accuracy`` commands. The text must hold at least one
        context window of tokens. A device-side check that needs no host-side logits (docs/bundles.md)."""
        cfg = json.loads((self.path / NODES["textGenerator"]).read_text())
        if self.phone is not None:
            return self.phone.perplexity(text, cfg)
        from vlmrun_qualcomm.genie_accuracy import perplexity

        return perplexity(self.lib, self.path, cfg, text, timeout=self.timeout)

    def request(self, prefix: str, pixels: Path, suffix: str, sampling, max_new_tokens: int, stop_ids,
                embeddings_out: Path, tap: dict | None = None) -> dict:
        """The worker's request: the nodes' configs (the bundle's; the generator's for this request), the
        connections, and the inputs in splice order; ``tap`` (``rows``, ``forced``, ``vocab_limit``): the logits
        tap of `vlmrun_qualcomm.genie_sampler`."""
        nodes = {node: (json.dumps(self.generator_config(sampling, max_new_tokens, stop_ids, tap is not None))
                        if node == "textGenerator" else (self.path / name).read_text())
                 for node, name in NODES.items()}
        req = {"nodes": nodes, "connections": CONNECTIONS,
               "inputs": [["lutEncoder", "text", prefix], ["imageEncoder", "image", str(pixels)],
                          ["lutEncoder", "text", suffix]],
               "embeddings_out": str(embeddings_out)}
        if tap is not None:
            req["logits"] = tap
        return req

    def generate(self, req) -> Iterator[int]:
        """Run one whole request (``req``: a `vlmrun.stages.RequestRun`); yield token ids.

        As it ships (the bundle's own sampler), Genie hands out text: each piece is tokenized back (the text is
        exact; the ids are those of the text, which may differ from the ones Genie sampled where two tokenizations
        spell the same text). Genie ends at a stop token it does not print, nor say which: an answer that ends
        before the budget gets the lowest stop id. A request that asks for logits or forces tokens
        (``on_logits``, ``teacher_tokens``) runs with the custom sampler instead: every step's logits row reaches
        ``on_logits``, the ids are the ones written back to Genie (the teacher's, else the argmax)."""
        tok = self.model.tokenizer
        before, after = split_prompt(req.prompt_text, tok.id_to_token(self.model.image_token_id))
        if self.phone is None and (req.on_logits is not None or req.teacher_tokens is not None):
            yield from self._tapped(req, before, after)
            return
        if self.phone is not None:
            gen = self.generator_config(req.sampling, req.max_new_tokens, req.stop_ids)
            pieces = self.phone.answer(req, before, after, gen)  # streamed as genie-app prints it
        else:
            pieces = self._pieces(req, before, after)
        count = 0
        for piece in pieces:
            ids = tok.encode(piece, add_special_tokens=False).ids
            count += len(ids)
            yield from ids
        if req.stop_ids and count < req.max_new_tokens:
            yield min(req.stop_ids)

    def _tapped(self, req, before: str, after: str) -> Iterator[int]:
        """The request with Genie's custom sampler: the ids it wrote back, as the steps come."""
        from vlmrun_qualcomm.genie_sampler import LogitsRows

        rows = LogitsRows(Path(tempfile.mkdtemp(prefix="vlmrun-bundle-logits-")) / "rows.f32", req.on_logits)
        try:
            sent = 0
            for _ in self._pieces(req, before, after, rows, need_text=False):
                while sent < len(rows.tokens):
                    sent += 1
                    yield rows.tokens[sent - 1]
            yield from rows.tokens[sent:]
            if not rows.tokens:
                raise BackendError(f"bundle {self.path.name}: Genie's custom sampler was never called (no step ran)")
        finally:
            shutil.rmtree(rows.path.parent, ignore_errors=True)

    def _pieces(self, req, before: str, after: str, rows=None, need_text: bool = True) -> Iterator[str]:
        """The answer's text pieces from the pipeline on this machine; the boundary tensors into ``req.tensors``
        before the first; a run whose image never reached the generator, or with no text, is an error. ``rows``
        (a `vlmrun_qualcomm.genie_sampler.LogitsRows`): tap the logits, force ``req.teacher_tokens``."""
        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-bundle-run-"))
        try:
            pixels = tmp / "pixel_values.raw"
            np.ascontiguousarray(req.pixel_values, np.float32).tofile(pixels)
            emb_out = tmp / "image_embeddings.npy"
            tap = None if rows is None else {"rows": str(rows.path), "forced": list(req.teacher_tokens or ()),
                                             "vocab_limit": self.model.vocab_limit}
            request = self.request(before, pixels, after, req.sampling, req.max_new_tokens, req.stop_ids, emb_out,
                                   tap)
            result: dict = {}
            t0 = time.perf_counter()
            text, first = "", None
            for piece in _in_context(self, req, genie_pipeline.stream_pipeline(
                    self.lib, request, cwd=self.path, timeout=self.timeout, result=result, logits=rows)):
                if first is None:
                    first = time.perf_counter()
                    if "embeddings_dims" not in result:  # the worker hands the image's output before any text
                        raise self._no_image()
                    self._boundary_tensors(req, np.load(emb_out), result["embeddings_dims"])
                text += piece
                yield piece
            if "embeddings_dims" not in result:
                raise self._no_image()
            if not text and need_text:
                raise BackendError(f"bundle {self.path.name}: Genie's pipeline returned success with no text; check"
                                   " the bundle with vlmrun bundle --verify (a generator without its LUT block"
                                   " stops silently)")
            self.last_timings = {"pipeline_wall_ms": (time.perf_counter() - t0) * 1e3,
                                 "ttft_wall_ms": (first - t0) * 1e3}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _out_of_context(self, req) -> InputError:
        """Genie's pipeline stopped at its context ("Context Size was exceeded.") on a prompt that fits the
        bundle's context_length: it runs a prompt through its prompt graphs in whole calls of their rows, and held
        fewer positions than the context (docs/bundles.md, "The context in Genie's pipeline")."""
        m = self.manifest
        return InputError(
            f"bundle {self.path.name}: Genie's pipeline ran out of its context ({m['context_length']} positions) on"
            f" a prompt of {int(req.input_ids.shape[1])} tokens with up to {req.max_new_tokens} new ones (\"Context"
            f" Size was exceeded.\"; it feeds a prompt in calls of its AR-{m['decoder']['ar']} graph and holds fewer"
            " positions than its context); shorten the conversation or start a new one, or write the bundle with a"
            " larger decoder context_length")

    def _no_image(self) -> BackendError:
        return BackendError(f"bundle {self.path.name}: the image encoder's embeddings never reached the text"
                            " generator (no output from the image-encoder node): the answer would be made without"
                            " the image; check the bundle with vlmrun bundle --verify")

    def _boundary_tensors(self, req, raw: np.ndarray, dims: list[int]) -> None:
        """What the host knows exactly of this request's boundaries, into ``req.tensors``: the image encoder's
        embeddings (from its node), the prompt's text rows (the bundle's LUT), and the spliced decoder input."""
        from vlmrun.preprocess import splice

        img = self._embeddings(raw, dims)
        txt = self.embed_rows(req.input_ids)[None]
        req.tensors.update(image_embeds=img, text_embeds=txt, inputs_embeds=splice(txt, img, req.image_start))

    def _embeddings(self, raw: np.ndarray, dims: list[int]) -> np.ndarray:
        """The image encoder's output as float32 [1, N, hidden] (a quantized output dequantized by its
        encoding)."""
        n = int(np.prod(dims)) if dims else raw.size // 4
        width = raw.size // max(n, 1)
        hidden = self.model.hidden_size
        if width == 4:
            x = raw.view(np.float32)
        elif width == 2:
            x = raw.view(np.float16).astype(np.float32)
        else:
            x = raw.astype(np.float32)
        return x.reshape(1, -1, hidden)


# -- a conversation kept in Genie's pipeline ----------------------------------------------------------------------
class BundleConversation(RequestState):
    """A conversation kept in Genie's pipeline (``request_state``): the pipeline stays alive in its worker between
    turns (`vlmrun_qualcomm.genie_pipeline.PipelineSession`) and each turn executes again without reset, fed
    only the text (and picture) the conversation added since; the generator continues from its KV cache. What the
    pipeline holds is tracked as text: the rendered prompt and the answer (the end token Genie stopped at is sampled,
    not fed: the next turn's new text starts with it). A turn that does not extend it (an undo, an edit, other sampling settings, another picture) starts
    the pipeline again from nothing; so does a turn stopped before Genie finished (its worker is ended)."""

    def __init__(self, runtime: BundleRuntime):
        self.rt = runtime
        self.session: PipelineSession | None = None
        self.held = ""  # the text the pipeline holds (the image placeholder where the picture went in)
        self.picture: str | None = None
        self.config_key = ""
        self.length = self.reused = 0

    @property
    def nbytes(self) -> int:
        """The memory the kept worker holds: its resident set (the loaded bundle, libGenie, the runtime), else the
        bundle's files."""
        if self.session is None or not self.session.alive:
            return 0
        return self.session.rss() or sum(int(f["bytes"]) for f in self.rt.manifest["files"].values())

    def reset(self) -> None:
        if self.session is not None:
            self.session.close()
        self.session, self.held, self.picture, self.length = None, "", None, 0

    def close(self) -> None:
        self.reset()

    def run(self, req) -> Iterator[int]:
        rt, tok = self.rt, self.rt.model.tokenizer
        turn = rt.turn(req)
        text, picture, config, key, image_token = turn.text, turn.picture, turn.config, turn.key, turn.image_token
        extends = (self.session is not None and self.session.alive and key == self.config_key and self.held
                   and turn.continues(self.held, self.picture))
        if not extends:
            self.reset()
            nodes = rt.request("", Path("unused"), "", req.sampling, req.max_new_tokens, req.stop_ids, Path("unused"))
            try:
                self.session = PipelineSession(rt.lib, {"nodes": {**nodes["nodes"],
                                                                  "textGenerator": json.dumps(config)},
                                                        "connections": nodes["connections"]},
                                               cwd=rt.path, timeout=rt.timeout)
            except BackendError as exc:
                raise node_failure(rt, exc) from None
            self.config_key = key
        new = text[len(self.held):]
        total = int(req.input_ids.shape[1])
        self.reused = max(total - rt.fed_positions(new, image_token), 0)
        self.length = self.reused
        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-bundle-turn-"))
        finished = False
        try:
            if image_token in new:
                pixels = tmp / "pixel_values.raw"
                np.ascontiguousarray(req.pixel_values, np.float32).tofile(pixels)
                before, after = split_prompt(new, image_token)
                inputs = [["lutEncoder", "text", before], ["imageEncoder", "image", str(pixels)],
                          ["lutEncoder", "text", after]]
                self.picture = picture
            else:
                inputs = [["lutEncoder", "text", new]]
            inputs = [i for i in inputs if i[1] != "text" or i[2]]  # Genie takes no empty text
            result: dict = {}
            self.length, count, answer, sampled = total, 0, "", []
            t0 = time.perf_counter()
            first = None
            pieces = _in_context(rt, req, self.session.turn(inputs, str(tmp / "image_embeddings.npy"), result))
            try:
                for piece in pieces:
                    if first is None:
                        first = time.perf_counter()
                        if image_token in new and "embeddings_dims" not in result:
                            raise rt._no_image()
                    ids = tok.encode(piece, add_special_tokens=False).ids
                    answer += piece
                    sampled += ids
                    count += len(ids)
                    self.length = total + count
                    yield from ids
            except GeneratorExit:  # the caller stopped (its budget, a stop string): Genie ends its turn anyway
                for piece in pieces:  # its rest, bounded by the session's timeout, so that the state stays known
                    answer += piece
                    sampled += tok.encode(piece, add_special_tokens=False).ids
                finished = True
                self._after(text, answer, sampled, req, t0, first)
                raise
            self._after(text, answer, sampled, req, t0, first)
            finished = True
            if bool(req.stop_ids) and count < req.max_new_tokens:
                yield min(req.stop_ids)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if not finished:  # failed mid-turn: Genie's state is not what vlmrun knows; start again next turn
                self.reset()

    def _after(self, text: str, answer: str, sampled: list[int], req, t0: float, first) -> None:
        """What the pipeline holds after a turn: the prompt and the answer as Genie sampled it. The end token it
        stopped at is sampled, not fed: the next turn's new text starts with it (measured: with it, a continued turn
        answers as the same conversation from scratch). An answer whose tokens are not the tokenizer's own spelling
        of its text (the model wrote "Re" as two tokens) holds a sequence a re-rendered history does not have: the
        next turn starts again, as a recompute from scratch sees it."""
        tok = self.rt.model.tokenizer
        canonical = tok.encode(answer, add_special_tokens=False).ids == sampled
        self.held = text + answer if canonical else ""
        self.length = int(req.input_ids.shape[1]) + len(sampled)
        self.rt.last_timings = {"pipeline_wall_ms": (time.perf_counter() - t0) * 1e3,
                                **({"ttft_wall_ms": (first - t0) * 1e3} if first is not None else {})}


def _in_context(rt: BundleRuntime, req, pieces: Iterator[str]) -> Iterator[str]:
    """``pieces`` of Genie's pipeline; its context limit as the one-line input error of `BundleRuntime._out_of_context`."""
    try:
        yield from pieces
    except ContextLimitError:
        raise rt._out_of_context(req) from None
    except BackendError as exc:
        raise node_failure(rt, exc) from None


def node_failure(rt: BundleRuntime, exc: BackendError) -> BackendError:
    """A node Genie could not create (a config or a file it names) with the check that says which:
    ``vlmrun bundle --verify``."""
    if "GenieNode_create" not in str(exc):
        return exc
    return BackendError(f"{exc}; check the bundle's files and configs: vlmrun bundle --verify {rt.path}")


def request_state(handles: dict) -> RequestState | None:
    """The ``request_state`` hook: a bundle's conversation kept in Genie's pipeline, on this machine or on a phone
    (`.bundle_phone.PhoneConversation`: genie-app's ``pipeline save/restore`` between turns)."""
    rt = getattr(handles.get("decoder"), "runtime", None)
    if rt is not None and rt.phone is not None:
        from .bundle_phone import PhoneConversation

        return PhoneConversation(rt.phone)
    return BundleConversation(rt) if rt is not None else None
