"""The quantization recipe: what `vlmrun_qnn_htp.quantizer.quantize` does to a graph, in one value.

A `Recipe` is built from a stage's options (`from_options`) and applies alike to every form qnn_htp
compiles (vision, projector, embed, the fixed and parts decoders, and their probes: a probe keeps its stage's
recipe). Its fields:

* ``precision``: ``int8`` (a8w8, 16-bit Softmax), ``a16w8``, ``w8a16`` or ``w4a16`` (the decoder's parts form);
* ``quantizer``: the engine, ``onnxruntime`` (default: onnxruntime's QNN-aware QDQ tools, lightweight) or ``aimet``
  (AIMET-ONNX, Qualcomm's own toolkit: an optional extra, ``pip install 'vlmrun-qnn-htp[aimet]'``);
* ``weight_scheme``: ``per_channel`` or ``lpbq`` (low-power blockwise int4: 4-bit weights in blocks of
  ``block_size`` along the input channel, the block scales expanded from a per-channel scale; AIMET, w4a16);
* ``algorithm``: how the weights' encodings are chosen: ``minmax``, ``seq_mse`` (Sequential MSE,
  ``seq_mse_candidates`` per weight) or ``adaround`` (``adaround_iterations`` per layer); the last two AIMET only;
* per-layer overrides (`LAYER_PRECISIONS`): ``keep_fp`` (left in float), ``keep_a16w16`` (16-bit
  activations and weights), and ``layer_precision``, a map ``layer=fp16|a16w16|w8|w4`` that a search can write
  (``w8`` / ``w4``: that layer's weights at 8 / 4 bits, per channel, activations as the stage's).

`Recipe.key` is what keys the binary (with the layers' resolved boundaries); the default recipe keys
nothing new, so binaries built before recipes existed are still found.
"""

from __future__ import annotations

import importlib.util

import attrs

from vlmrun.errors import UsageError

QUANTIZERS = ("onnxruntime", "aimet")
WEIGHT_SCHEMES = ("per_channel", "lpbq")
ALGORITHMS = ("minmax", "seq_mse", "adaround")
BLOCK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_BLOCK_SIZE = 64  # ai-hub-models' LLM exports
DEFAULT_SEQ_MSE_CANDIDATES = 20  # AIMET's default
DEFAULT_ADAROUND_ITERATIONS = 2000  # AIMET recommends 10-15k; 2000 reached 26.0 dB on the tiny decoder in 150 s
#: per-layer precisions (``layer_precision`` values) and the option each is the same as
LAYER_PRECISIONS = {"fp16": "keep_fp", "a16w16": "keep_a16w16", "w8": "keep_w8", "w4": "keep_w4"}
#: per stage precision, the per-layer precisions above it, cheapest first (what ``vlmrun tune`` searches over)
TUNE_LADDERS = {"w4a16": ("w8", "a16w16"), "w8a16": ("a16w16",), "int8": ("a16w16",), "a16w8": ("a16w16",)}
AIMET_EXTRA = "pip install 'vlmrun-qnn-htp[aimet]'"
#: what the AIMET engine quantizes (the fixed decoder's additive -65504 mask needs onnxruntime's Softmax ranges)
AIMET_FORMS = ("vision", "projector", "embed", "decoder/parts")


@attrs.frozen
class Recipe:
    """How one stage's graphs are quantized (see the module docstring)."""

    precision: str
    quantizer: str = "onnxruntime"
    weight_scheme: str = "per_channel"
    block_size: int | None = None
    algorithm: str = "minmax"
    seq_mse_candidates: int = DEFAULT_SEQ_MSE_CANDIDATES
    adaround_iterations: int = DEFAULT_ADAROUND_ITERATIONS

    @property
    def weight_bits(self) -> int:
        return 4 if self.precision == "w4a16" else 8

    @property
    def activation_bits(self) -> int:
        return 8 if self.precision == "int8" else 16

    @property
    def is_default(self) -> bool:
        return (self.quantizer, self.weight_scheme, self.algorithm) == ("onnxruntime", "per_channel", "minmax")

    def key(self) -> dict:
        """The recipe's entries of the compile key: none for the default recipe (its binaries key as before)."""
        if self.is_default:
            return {}
        out = {"quantizer": self.quantizer, "weight_scheme": self.weight_scheme, "algorithm": self.algorithm}
        if self.weight_scheme == "lpbq":
            out["block_size"] = self.block_size
        if self.algorithm == "seq_mse":
            out["seq_mse_candidates"] = self.seq_mse_candidates
        if self.algorithm == "adaround":
            out["adaround_iterations"] = self.adaround_iterations
        if self.quantizer == "aimet":
            out["aimet"] = aimet_version()
        return out

    def describe(self) -> str:
        """One line for messages and manifests: ``aimet lpbq(64) seq_mse w4a16``."""
        scheme = f"lpbq(block {self.block_size})" if self.weight_scheme == "lpbq" else "per-channel"
        return f"{self.quantizer} {self.precision} {scheme} {self.algorithm}"


def aimet_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("aimet-onnx")
    except Exception:
        return None


def require_aimet() -> None:
    """UsageError naming the extra when AIMET-ONNX is not installed (checked before any export)."""
    try:
        found = importlib.util.find_spec("aimet_onnx") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UsageError(f"quantizer = \"aimet\" needs AIMET-ONNX, which is not installed: {AIMET_EXTRA}")


def from_options(stage: str, o, precision: str, form: str) -> Recipe | None:
    """The recipe of a stage's filled options ``o`` (every declared default in, `vlmrun_qnn_htp.options.fill`;
    None at fp16); UsageError for values that cannot work. ``form``: ``fixed`` or ``parts`` (the decoder's),
    ``fixed`` for other stages."""
    quantizer = str(o["quantizer"]).lower()
    scheme = str(o["weight_scheme"] or "").lower()  # declared without a default: it depends on the quantizer
    algorithm = str(o["algorithm"]).lower()
    if precision == "fp16":  # nothing to quantize: a recipe flag given for every stage (--quantizer) has no effect
        return None
    if quantizer not in QUANTIZERS:
        raise UsageError(f"{stage}: quantizer '{quantizer}' is not one of {', '.join(QUANTIZERS)}")
    if algorithm not in ALGORITHMS:
        raise UsageError(f"{stage}: algorithm '{algorithm}' is not one of {', '.join(ALGORITHMS)}")
    where = "decoder/parts" if stage == "decoder" and form == "parts" else stage
    if quantizer == "aimet":
        if where not in AIMET_FORMS:
            raise UsageError(f"{stage}: quantizer = \"aimet\" quantizes vision, projector, embed and the decoder's"
                             " parts form (--decoder-form parts); the fixed decoder takes quantizer = \"onnxruntime\"")
        require_aimet()
    elif algorithm != "minmax":
        raise UsageError(f"{stage}: algorithm {algorithm} is AIMET's: add quantizer = \"aimet\" ({AIMET_EXTRA})")
    if not scheme:
        scheme = "lpbq" if quantizer == "aimet" and precision == "w4a16" else "per_channel"
    if scheme not in WEIGHT_SCHEMES:
        raise UsageError(f"{stage}: weight_scheme '{scheme}' is not one of {', '.join(WEIGHT_SCHEMES)}")
    block = None
    if scheme == "lpbq":
        if quantizer != "aimet":
            raise UsageError(f"{stage}: weight_scheme lpbq is built by AIMET: add quantizer = \"aimet\""
                             f" ({AIMET_EXTRA})")
        if precision != "w4a16":
            raise UsageError(f"{stage}: weight_scheme lpbq is 4-bit blockwise weights: precision w4a16 (the"
                             " decoder's parts form), not " + precision)
        block = int(o.get("block_size") or DEFAULT_BLOCK_SIZE)  # declared without a default: lpbq's only
        if block not in BLOCK_SIZES:
            raise UsageError(f"{stage}: block_size {block} is not one of {', '.join(map(str, BLOCK_SIZES))}")
    elif o.get("block_size"):
        raise UsageError(f"{stage}: block_size applies to weight_scheme = \"lpbq\"")
    return Recipe(precision=precision, quantizer=quantizer, weight_scheme=scheme, block_size=block,
                  algorithm=algorithm,
                  seq_mse_candidates=int(o["seq_mse_candidates"]), adaround_iterations=int(o["adaround_iterations"]))


def decoder_input_channels(model) -> dict[str, int]:
    """The input channels of the decoder's weights (what an LPBQ block divides): per projection."""
    H, nh, D = model.hidden_size, model.num_heads, model.head_dim
    inter = int(model.text_config.get("intermediate_size") or 4 * H)
    return {"q/k/v, gate/up, lm_head (hidden size)": H, "o_proj (heads x head dim)": nh * D,
            "down_proj (intermediate size)": inter}


def check_block_size(recipe: Recipe | None, model) -> None:
    """UsageError when the LPBQ block does not divide every decoder weight's input channels (before any export)."""
    if recipe is None or recipe.weight_scheme != "lpbq":
        return
    for what, channels in decoder_input_channels(model).items():
        if channels % recipe.block_size:
            raise UsageError(f"block_size {recipe.block_size} does not divide the {channels} input channels of the"
                             f" decoder's {what}; choose a block size that divides it (e.g."
                             f" {max(b for b in (*BLOCK_SIZES, 1) if channels % b == 0)})")


def parse_layer_precision(value, stage: str) -> dict[str, str]:
    """``layer_precision`` (``"decoder.layer0=w8, decoder.lm_head=a16w16"`` or a TOML table) as {layer: precision}."""
    if not value:
        return {}
    if isinstance(value, dict):
        items = list(value.items())
    else:
        items = []
        for part in str(value).replace(";", ",").split(","):
            if not part.strip():
                continue
            name, sep, p = part.partition("=")
            if not sep:
                raise UsageError(f"{stage}: layer_precision wants LAYER=PRECISION entries (e.g. decoder.layer0=w8),"
                                 f" got '{part.strip()}'")
            items.append((name, p))
    out = {}
    for name, p in items:
        name, p = str(name).strip(), str(p).strip().lower()
        if p not in LAYER_PRECISIONS:
            raise UsageError(f"{stage}: layer_precision {name}={p}: precision must be one of"
                             f" {', '.join(LAYER_PRECISIONS)}")
        out[name] = p
    return out


#: the fields of a `Recipe` a compile key names (`Recipe.key`) when they differ from the default recipe's
KEY_FIELDS = ("quantizer", "weight_scheme", "block_size", "algorithm", "seq_mse_candidates", "adaround_iterations")


def from_key(key) -> Recipe | None:
    """The recipe a compile key names (a compile request's options, or `vlmrun_qnn_htp.options.stage_options`'
    result): its ``precision``, and the fields `Recipe.key` wrote, the default recipe's where it wrote none (the
    default recipe keys nothing); None at fp16."""
    precision = str(key["precision"])
    if precision == "fp16":
        return None
    return Recipe(precision=precision, **{f: key[f] for f in KEY_FIELDS if key.get(f) is not None})
