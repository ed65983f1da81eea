"""FastVLM checkpoints on disk, read without torch.

`FastVLMModel` reads a local checkpoint directory offline: transformers' native format
(``model_type: fast_vlm``) directly, Apple's original ``llava_qwen2`` format through a one-time conversion
into the artifact store (see `vlmrun.checkpoints`). Only `FastVLMModel.load_torch` imports torch.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path

import attrs

from .checkpoint_formats import SAFETENSORS_INDEX, SOURCE_WEIGHTS_FILE
from .checkpoint_stream import (ShardedWeights, check_budget, export_peak_bytes, is_sharded, load_part, memory_budget,
                                meta_model, part_bytes, read_source_weights)
from .errors import BackendError, InputError
from .store import ArtifactStore, sha256_file

def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from None


def _int_ids(value) -> set[int]:
    """Token ids from a config value: an int, a list of ints, or nothing."""
    values = value if isinstance(value, list) else [value]
    return {int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)}


@attrs.define(slots=False)
class FastVLMModel:
    """A native-format FastVLM checkpoint directory and what the pipeline needs to know about it."""

    path: Path
    source: Path
    source_layout: str  # the checkpoint format it was read from: fast_vlm or llava_qwen2
    #: export a sharded checkpoint part by part (`load_torch_part`); ``False``: load it whole, as before
    stream: bool = True

    @classmethod
    def open(cls, model_dir: str | os.PathLike, store: ArtifactStore | None = None,
             rebuild: bool = False) -> "FastVLMModel":
        from . import checkpoints

        src = Path(model_dir).expanduser()
        fmt = checkpoints.detect_format(src)
        checkpoints.check_shards(src)
        if fmt == checkpoints.NATIVE:
            return cls(src, src, fmt)
        store = store or ArtifactStore()
        # keyed by every file that shapes the conversion (weights, configs, tokenizer files, templates)
        digest = checkpoints.conversion_digest(src, store.root)
        # a sharded checkpoint's weights are read from its shards where they are (only the grown vocabulary
        # weights are written: 2.2 GB at 7B instead of a 15.5 GB copy); a one-file checkpoint is copied
        in_source = (src / SAFETENSORS_INDEX).is_file()

        def convert(tmp: Path) -> dict:
            checkpoints.convert_apple_to_native(src, tmp / "model", weights_in_source=digest if in_source else None)
            _flatten(tmp / "model", tmp)
            return {"files": ["config.json"], "converted_from": str(src)}

        # v3: written tensor by tensor, one shard per source shard (v2: one file, converted in memory); v4: a
        # sharded source's weights stay in it, so the entry is the source's place too (moved: a new entry of the
        # vocabulary weights alone, with the same weights hash: nothing built from it is built again)
        key = {"stage": "checkpoint", "kind": "native-from-llava_qwen2", "inputs": digest, "v": 3}
        if in_source:
            key.update(v=4, source=str(src.resolve()))
        art = store.get_or_build(key, convert, rebuild=rebuild)
        return cls(art.path, src, fmt)

    # -- configuration -------------------------------------------------------------------------------
    @cached_property
    def config(self) -> dict:
        return _read_json(self.path / "config.json")

    @property
    def text_config(self) -> dict:
        return self.config["text_config"]

    @property
    def vision_config(self) -> dict:
        return self.config["vision_config"]

    @cached_property
    def image_processor_config(self) -> dict:
        for name in ("preprocessor_config.json", "processor_config.json"):
            cfg = _read_json(self.path / name)
            if "image_processor" in cfg:
                cfg = cfg["image_processor"]
            if cfg.get("crop_size") or cfg.get("size"):
                return cfg
        raise InputError(f"{self.path} has no image processor config (preprocessor_config.json)")

    @property
    def image_size(self) -> int:
        crop = self.image_processor_config.get("crop_size") or self.image_processor_config.get("size")
        if isinstance(crop, dict):
            return int(crop.get("height") or crop.get("shortest_edge"))
        return int(crop)

    @property
    def image_tokens(self) -> int:
        return (self.image_size // 64) ** 2

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    @property
    def num_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def num_heads(self) -> int:
        return int(self.text_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.text_config.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self.text_config.get("head_dim") or self.hidden_size // self.num_heads)

    @property
    def rope_theta(self) -> float:
        rope = self.text_config.get("rope_parameters") or {}
        return float(rope.get("rope_theta") or self.text_config.get("rope_theta") or 10000.0)

    @property
    def max_context(self) -> int:
        return int(self.text_config.get("max_position_embeddings") or 32768)

    @property
    def image_token_id(self) -> int:
        return int(self.config.get("image_token_id", self.config.get("image_token_index")))

    @property
    def feature_dim(self) -> int:
        return int(self.vision_config["hidden_size"])

    def dims(self) -> dict[str, int]:
        """Symbolic dims of the stage contracts (`vlmrun.stages`)."""
        return {
            "S": self.image_size,
            "N": self.image_tokens,
            "F": self.feature_dim,
            "H": self.hidden_size,
            "V": self.vocab_size,
        }

    @cached_property
    def generation_config(self) -> dict:
        return _read_json(self.path / "generation_config.json")

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        """The ids a generation stops on, as the checkpoint says: its generation config's ``eos_token_id`` (an
        int or a list), else the tokenizer's eos token, else the model config's ``eos_token_id``."""
        ids = _int_ids(self.generation_config.get("eos_token_id"))
        if not ids:
            eos = (_read_json(self.path / "tokenizer_config.json").get("eos_token")
                   or _read_json(self.path / "special_tokens_map.json").get("eos_token"))
            eos = eos.get("content") if isinstance(eos, dict) else eos
            tid = self.tokenizer.token_to_id(eos) if isinstance(eos, str) else None
            ids = {tid} if tid is not None else set()
        if not ids:
            ids = _int_ids(self.text_config.get("eos_token_id")) or _int_ids(self.config.get("eos_token_id"))
        return frozenset(ids)

    @cached_property
    def vocab_limit(self) -> int | None:
        """How many logit rows the sampler may pick from (``None``: all). A converted Apple checkpoint has rows
        past Apple's ``vocab_size`` (``<image>`` and padding to a multiple of 64) that the original model does not
        have and so can never produce; they are masked."""
        from .checkpoints import CONVERSION_FILE

        limit = _read_json(self.path / CONVERSION_FILE).get("source_vocab_size")
        return int(limit) if isinstance(limit, int) and 0 < limit < self.vocab_size else None

    # -- tokenizer -----------------------------------------------------------------------------------
    @cached_property
    def tokenizer(self):
        from tokenizers import Tokenizer

        path = self.path / "tokenizer.json"
        if not path.is_file():
            raise InputError(f"{self.path} has no tokenizer.json (a fast tokenizer is required)")
        return Tokenizer.from_file(str(path))

    @cached_property
    def chat_template(self) -> str:
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        for name in ("tokenizer_config.json", "processor_config.json", "chat_template.json"):
            template = _read_json(self.path / name).get("chat_template")
            if isinstance(template, str):
                return template
        raise InputError(f"{self.path} has no chat template (chat_template.jinja or tokenizer_config.json)")

    # -- identity ------------------------------------------------------------------------------------
    def weights_hash(self, store: ArtifactStore | None = None) -> str:
        return weights_hash(self.path, store)

    @property
    def weight_file_bytes(self) -> int:
        """The bytes of the checkpoint's weight files (``*.safetensors``, ``*.bin``) as stored (bf16 for an Apple
        checkpoint): what sizes the memory of a build before anything is read. Weights read from the source
        checkpoint: its shards (the grown vocabulary copy beside them not counted twice)."""
        linked = read_source_weights(self.path)
        if linked is not None:
            source = Path(linked["source"])
            return sum((source / name).stat().st_size for name in {f for f, _ in linked["weight_map"].values()}
                       if (source / name).is_file())
        return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))

    # -- torch (export only) -------------------------------------------------------------------------
    @property
    def streams(self) -> bool:
        """Whether exports read only the weights they need (`load_torch_part`): a sharded checkpoint (an Apple
        one is converted shard for shard) unless ``stream`` is off. A single-file checkpoint loads whole."""
        return self.stream and is_sharded(self.path)

    def load_torch(self):
        """The model as ``transformers.FastVlmForConditionalGeneration`` in eval mode, float32 (loaded once)."""
        cached = self.__dict__.get("_torch_model")
        if cached is not None:
            return cached
        torch, FastVlmForConditionalGeneration = _torch_classes()
        if read_source_weights(self.path) is not None:  # weights in the source: every one read through the map
            model = load_part(self.path, ("",), "loading the whole model")
            self.__dict__["_torch_model"] = model
            return model
        if memory_budget() is not None:
            check_budget("loading the whole model", export_peak_bytes(part_bytes(meta_model(self.path), ("",))))
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = FastVlmForConditionalGeneration.from_pretrained(self.path, dtype=torch.float32).eval()
        self.__dict__["_torch_model"] = model
        return model

    def load_torch_part(self, prefixes, what: str = "this export"):
        """The torch model with only the weights whose native names start with one of ``prefixes`` loaded
        (float32; the others on torch's meta device), read lazily from the shards
        (`vlmrun.checkpoint_stream.load_part`); the whole model (`load_torch`) when the checkpoint does not
        stream. The last part asked for is kept until another is asked for or `release_torch_part`."""
        if not self.streams:
            return self.load_torch()
        key = tuple(prefixes)
        cached = self.__dict__.get("_torch_part")
        if cached is not None and cached[0] == key:
            return cached[1]
        self.release_torch_part()
        _torch_classes()
        part = load_part(self.path, key, what)
        self.__dict__["_torch_part"] = (key, part)
        return part

    def release_torch_part(self) -> None:
        """Drop the part `load_torch_part` keeps (its memory is freed)."""
        if self.__dict__.pop("_torch_part", None) is not None:
            import gc

            gc.collect()

    def read_weight(self, name: str):
        """One weight by its native name, float32, read alone from its shard (a tied lm_head is the embedding)."""
        torch, _ = _torch_classes()
        return ShardedWeights(self.path).read(name, torch.float32)


def _torch_classes():
    """torch and transformers' ``FastVlmForConditionalGeneration``; `BackendError` saying how to install them."""
    try:
        import torch
        from transformers import FastVlmForConditionalGeneration
    except ImportError as exc:
        raise BackendError(
            f"loading the torch model needs torch, timm and transformers ({exc}); pip install 'vlmrun[export]'"
        ) from None
    return torch, FastVlmForConditionalGeneration


def _flatten(src: Path, dst: Path) -> None:
    """Move a checkpoint's files from ``src`` up into the artifact directory ``dst``."""
    for item in src.iterdir():
        os.replace(item, dst / item.name)
    src.rmdir()


def weights_hash(model_dir: Path, store: ArtifactStore | None = None) -> str:
    """sha256 over config.json and the weight files; cached by (path, size, mtime) in the store root."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in {".safetensors", ".bin", ".json"} and p.is_file())
    stamp = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}
    cache_file = (store.root if store else None) and store.root / "weights-hashes.json"
    cache = _read_json(cache_file) if cache_file else {}
    entry = cache.get(str(model_dir.resolve()))
    if entry and entry.get("stamp") == stamp:
        return entry["sha256"]
    import hashlib

    h = hashlib.sha256()
    for p in files:
        if p.name == SOURCE_WEIGHTS_FILE:  # weights read from the source: its digest and the map, not its place
            linked = read_source_weights(model_dir)
            h.update(p.name.encode())
            h.update(json.dumps({"inputs": linked.get("inputs"), "weight_map": linked["weight_map"]},
                                sort_keys=True).encode())
            continue
        if p.suffix == ".json" and p.name not in {"config.json"}:
            continue
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    digest = h.hexdigest()[:16]
    if cache_file:
        cache[str(model_dir.resolve())] = {"stamp": stamp, "sha256": digest}
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)
    return digest


#: The default model: a small FastVLM (the real architecture) trained by ``scripts/train_tiny.py`` to answer
#: questions about the pictures `vlmrun.shapes` draws; shipped with vlmrun (``training.json`` next to the
#: weights records how it was trained and its accuracy).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "models" / "shapes-tiny"
DEFAULT_MODEL_VERSION = "shapes-tiny-v1"


def default_model(store: ArtifactStore, image_size: int | None = None, progress=None) -> FastVLMModel:
    """The trained tiny FastVLM shipped with vlmrun (`DEFAULT_MODEL_DIR`, 256 x 256 images).

    ``image_size`` other than its own (``None``: its own) gives the same weights with the image processor and
    ``image_seq_length`` set for that size (a copy in the artifact store, made once): the architecture runs at any
    multiple of 64, but the answers were trained at 256 only."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise BackendError(f"the default model is missing from {DEFAULT_MODEL_DIR}; reinstall vlmrun")
    native = FastVLMModel(DEFAULT_MODEL_DIR, DEFAULT_MODEL_DIR, "fast_vlm")
    if image_size is None or int(image_size) == native.image_size:
        return native
    size = int(image_size)
    if size < 64 or size % 64:
        raise InputError(f"image size must be a positive multiple of 64, got {size}")
    from .progress import no_progress

    def build(tmp: Path) -> dict:
        with (progress or no_progress)(f"preparing the default FastVLM at {size}x{size} (trained at"
                                       f" {native.image_size}; once)"):
            _resized_copy(DEFAULT_MODEL_DIR, tmp, size)
        return {"files": ["config.json"], "image_size": size}

    key = {"stage": "model", "kind": DEFAULT_MODEL_VERSION, "image_size": size,
           "weights": weights_hash(DEFAULT_MODEL_DIR, store)}
    art = store.get_or_build(key, build)
    return FastVLMModel(art.path, art.path, "fast_vlm")


def _resized_copy(src: Path, dst: Path, size: int) -> None:
    """``src`` with its image processor (resize, crop) and ``image_seq_length`` set for ``size``."""
    import shutil

    for f in src.iterdir():
        if f.is_file() and f.name != "training.json":
            shutil.copy2(f, dst / f.name)
    config = _read_json(dst / "config.json")
    config["image_seq_length"] = (size // 64) ** 2
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("preprocessor_config.json", "processor_config.json"):
        cfg = _read_json(dst / name)
        if not cfg:
            continue
        proc = cfg.get("image_processor", cfg)
        proc["size"] = {"shortest_edge": size}
        proc["crop_size"] = {"height": size, "width": size}
        (dst / name).write_text(json.dumps(cfg, indent=2) + "\n")


def open_model(model, store: ArtifactStore, image_size: int | None = None, progress=None,
               rebuild: bool = False) -> FastVLMModel:
    """A FastVLMModel from an instance, a checkpoint directory, or ``None`` (the default model, at
    ``image_size`` or its own).

    ``rebuild``: convert an Apple-format checkpoint again even when the store holds its conversion."""
    if isinstance(model, FastVLMModel):
        return model
    if model is None:
        return default_model(store, image_size, progress)
    return FastVLMModel.open(model, store, rebuild=rebuild)

