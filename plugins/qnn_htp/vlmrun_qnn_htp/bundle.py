"""The artifact people ship: a folder Genie's VLM pipeline (libGenie's pipeline API, or the SDK's ``genie-app``)
loads, in Qualcomm AI Hub's VLM export layout, written (`write_bundle`), checked (`verify_bundle`) and
run (`.bundle_run.BundleRuntime`) by qnn_htp.

Files (``vlmrun bundle OUT``)::

    vision_encoder.bin            the image encoder: vision tower + projector, quantized pixel input (image_encoder.py)
    partK_of_N.bin                the decoder's parts, prompt + token (+ follow-up prompt) graphs, weight-shared
                                  (device target);
    partK_of_N_{prompt,token,followup}.bin   on the emulator the unshared compile of the same graphs
                                  (parts_compile.py); Genie pools them by (AR, CL): AR-128, AR-1, AR-32
    embedding_weights.raw         uint16 [vocab, hidden], no header: the LUT of the text encoder and generator, in
                                  the encoding of the decoder's quantized inputs_embeds (manifest: scale, zero point)
    tokenizer.json, tokenizer_config.json, config.json, generation_config.json, processor/preprocessor config,
    chat_template.jinja           the checkpoint's own files (what a runtime needs to build a prompt)
    img-enc-htp.json, text-encoder.json, text-generator.json   the pipeline's node configs
    genie_config.json             the generator as a dialog (genie-t2t-run, text only)
    htp_backend_ext_config.json   the HTP backend extensions (named by the configs of a device bundle)
    genie-app-script.txt          the genie-app script over sample_inputs/ (prompt prefix, pixels, suffix)
    metadata.json                 what GenieX reads (model files with their tensor shapes, vision preprocessing)
    vlmrun-bundle.json            vlmrun's manifest: every file's sha256, versions, recipes, the image input's
                                  encoding, the prompt split, and the figures the bundle was verified with
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from vlmrun.demo_image import demo_image
from vlmrun.errors import BackendError, InputError, UsageError
from vlmrun.layouts import BUNDLE_MANIFEST, bundle_manifest
from vlmrun.preprocess import preprocess_image

from . import ep, image_encoder
from .bundle_vision import vision_side
from .options import NAME
from .parts_compile import parts_artifact
from .plan import StagePlan

MANIFEST = BUNDLE_MANIFEST
FORMAT = 1
IMAGE_BIN = "vision_encoder.bin"
LUT = "embedding_weights.raw"
NODES = {"imageEncoder": "img-enc-htp.json", "lutEncoder": "text-encoder.json", "textGenerator": "text-generator.json"}
#: the text encoder connected FIRST: with the image encoder's connection first, libGenie 1.21 (emulator) spliced the
#: image ahead of the prompt whatever the setData order (the answers of an image-first prompt, checked against the
#: reference decoder on the same embeddings); with this order the prompt is prefix, image, suffix as set
CONNECTIONS = [
    ["lutEncoder", "GENIE_NODE_TEXT_ENCODER_EMBEDDING_OUTPUT", "textGenerator",
     "GENIE_NODE_TEXT_GENERATOR_EMBEDDING_INPUT"],
    ["imageEncoder", "GENIE_NODE_IMAGE_ENCODER_EMBEDDING_OUTPUT", "textGenerator",
     "GENIE_NODE_TEXT_GENERATOR_EMBEDDING_INPUT"],
]
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "preprocessor_config.json", "processor_config.json", "chat_template.jinja",
               "chat_template.json")
EXT_CONFIG = "htp_backend_ext_config.json"
SAMPLE_PROMPT = "Describe the image."


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prompt_split(model, prompt: str, system: str | None = None) -> tuple[str, str]:
    """The chat template of ``prompt`` split at the image placeholder: (text before, text after). Genie's
    pipeline splices by call order: prefix text, the image's embeddings, suffix text."""
    from vlmrun.preprocess import render_prompt

    return split_prompt(render_prompt(model.chat_template, prompt, system), model.tokenizer.id_to_token(model.image_token_id))


# -- writing ----------------------------------------------------------------------------------------------------
def decoder_options(options: dict, target: str) -> dict:
    """The decoder's layout options as a bundle needs them: the parts form, decoded by Genie; weight-shared
    binaries for a device, the unshared compile of the same graphs on the emulator."""
    o = {**options, "decoder_form": "parts", "engine": "genie"}
    if target == "android":
        o["weight_sharing"] = "on"
    o.pop("target", None)
    return o


def lut_block(enc: dict | None) -> dict:
    """A LUT's datatype (and quant-param: value = scale * (q + offset), offset = -zero point) for Genie."""
    if enc is None:
        return {"datatype": "float32"}
    return {"datatype": "ufixed16", "quant-param": {"scale": enc["scale"], "offset": -int(enc["zero_point"])}}


def text_generator_config(model, ctx: int, ctx_bins: list[str], target: str, max_new_tokens: int = 512,
                          sampling=None, eos=None, lut: dict | None = None) -> dict:
    """The generator node's config: the dialog body under ``text-generator`` plus the ``embedding`` LUT block
    (without it Genie stops after one token and says nothing)."""
    from vlmrun_qualcomm import genie_config

    facts = genie_config.GenieModel.from_model(model)
    kwargs = {"sampling": sampling} if sampling is not None else {}
    cfg = genie_config.dialog_config(facts, "QnnHtp", tokenizer="tokenizer.json", context_size=ctx,
                                     max_new_tokens=max_new_tokens, ctx_bins=ctx_bins, eos=eos, **kwargs)["dialog"]
    cfg["embedding"] = {"version": 1, "type": "lut", "lut-path": LUT, "size": facts.hidden, **lut_block(lut)}
    if target == "android":
        cfg["engine"]["backend"]["extensions"] = EXT_CONFIG
    return {"text-generator": cfg}


def image_encoder_config(target: str) -> dict:
    backend = {"version": 1, "type": "QnnHtp",
               "QnnHtp": {"version": 1, "spill-fill-bufsize": 0, "use-mmap": False, "allow-async-init": False}}
    if target == "android":
        backend["extensions"] = EXT_CONFIG
    return {"image-encoder": {"version": 1, "engine": {
        "version": 1, "mode": "image", "backend": backend,
        "model": {"version": 1, "type": "binary", "binary": {"version": 1, "ctx-bins": [IMAGE_BIN]}}}}}


def text_encoder_config(hidden: int, lut: dict | None = None) -> dict:
    return {"text-encoder": {"version": 1, "type": "lut",
                             "lut": {"version": 1, "lut-path": LUT, "size": int(hidden), **lut_block(lut)},
                             "tokenizer": {"version": 1, "path": "tokenizer.json"}}}


def ext_config(soc) -> dict:
    return {"devices": [{"soc_model": int(soc.soc_model), "dsp_arch": soc.arch,
                         "cores": [{"core_id": 0, "perf_profile": "burst", "rpc_control_latency": 100}]}],
            "memory": {"mem_type": "shared_buffer"}, "context": {"weight_sharing_enabled": True}}


def app_script(prefix_file: str, pixels_file: str, suffix_file: str) -> str:
    """A genie-app script (``genie-app -s``) running the pipeline on one request's files."""
    lines = ["version", "pipeline config create pipelineConfig", "pipeline create GeniePipeline pipelineConfig", ""]
    for node, cfg in NODES.items():
        lines += [f"node config create {node}Config {cfg}", f"node create {node} {node}Config"]
        if node == "textGenerator":
            lines.append(f"node set textCallback {node} GENIE_NODE_TEXT_GENERATOR_TEXT_OUTPUT")
        lines.append("")
    lines += [f"pipeline add GeniePipeline {node}" for node in NODES] + [""]
    lines += [f"pipeline connect GeniePipeline {p} {pio} {c} {cio}" for p, pio, c, cio in CONNECTIONS] + [""]
    lines += [f"node set textFile lutEncoder GENIE_NODE_TEXT_ENCODER_TEXT_INPUT {prefix_file}",
              f"node set image imageEncoder GENIE_NODE_IMAGE_ENCODER_IMAGE_INPUT {pixels_file}",
              f"node set textFile lutEncoder GENIE_NODE_TEXT_ENCODER_TEXT_INPUT {suffix_file}", "",
              "pipeline execute GeniePipeline", ""]
    lines += [f"node free {node}" for node in NODES] + ["pipeline free GeniePipeline"]
    return "\n".join(lines) + "\n"


def write_bundle(request) -> dict:
    """Compile (through the store) and write the bundle of ``request`` (a `vlmrun.stages.BundleRequest`)
    into ``request.out_dir``; return the manifest."""
    model, out, target = request.model, Path(request.out_dir), request.target
    soc = StagePlan.of("vision", request.context("vision").options).soc
    side = vision_side(request)  # the image encoder, the LUT, the decoder input's range (a child for a big model)
    enc_art, embeds = side.image_encoder, side.embeds
    lut = np.load(side.lut.file("embed_lut_f32.npy"), mmap_mode="r")
    dec_options = {**decoder_options(dict(request.layout.stages["decoder"].options), target),
                   "embeds_input": embeds["option"]}
    dec_ctx = request.context("decoder", dec_options)
    dec = StagePlan.of("decoder", dec_ctx.options)
    if dec.soc.name != soc.name:
        raise UsageError(f"the bundle's stages are compiled for two SoCs ({soc.name}, {dec.soc.name}); give one")
    dec_art = parts_artifact(dec_ctx, dec)  # prompt (AR-128), token (AR-1) and follow-up (AR-32) graphs
    with request.progress("writing the bundle"):
        shutil.copyfile(enc_art.path / next(f for f in enc_art.manifest["files"] if f.endswith(".bin")), out / IMAGE_BIN)
        parts = dec_art.manifest["decoder_parts"]
        bins = list(parts["binaries_in_order"])
        shared = parts["weight_sharing"]
        P = parts["count"]
        names = {}
        for b in bins:  # Genie's names: partK_of_N.bin when shared (GenieX reads these), else per graph kind
            new = b.replace("_qnn.bin", ".bin")
            names[b] = new
            shutil.copyfile(dec_art.path / b, out / new)
        ctx_bins = [names[b] for b in bins]
        enc = dec_art.manifest["decoder_parts"]["embeds_input"]  # the table in the decoder input's encoding
        lut_sqnr = image_encoder.write_quantized_rows(lut, enc, out / LUT)
        copied = []
        for name in MODEL_FILES:
            if (model.path / name).is_file():
                shutil.copyfile(model.path / name, out / name)
                copied.append(name)
        ctx_len = int(parts["ctx"])
        stops = sorted(model.stop_ids) or None
        configs = {
            "img-enc-htp.json": image_encoder_config(target),
            "text-encoder.json": text_encoder_config(model.hidden_size, enc),
            "text-generator.json": text_generator_config(model, ctx_len, ctx_bins, target, eos=stops, lut=enc),
        }
        dialog = {"dialog": configs["text-generator.json"]["text-generator"]}
        configs["genie_config.json"] = dialog
        configs[EXT_CONFIG] = ext_config(soc)
        for name, cfg in configs.items():
            (out / name).write_text(json.dumps(cfg, indent=2) + "\n")
        samples = out / "sample_inputs"
        samples.mkdir()
        before, after = prompt_split(model, SAMPLE_PROMPT)
        (samples / "prompt_prefix.txt").write_text(before)
        (samples / "prompt_suffix.txt").write_text(after)
        np.ascontiguousarray(preprocess_image(demo_image(), model.image_processor_config), np.float32).tofile(
            samples / "pixel_values.raw")
        (out / "genie-app-script.txt").write_text(app_script("sample_inputs/prompt_prefix.txt",
                                                             "sample_inputs/pixel_values.raw",
                                                             "sample_inputs/prompt_suffix.txt"))
        enc_info = enc_art.manifest
        metadata = {
            "model_id": f"fastvlm-{model.path.name}",
            "model_files": {  # each binary's tensors, as GenieX reads them (a part: per graph)
                IMAGE_BIN: {"inputs": _tensors(enc_info["inputs"]), "outputs": _tensors(enc_info["outputs"])},
                **{names[b]: {"part": e["index"], "of": P, "graphs": {
                    g["name"]: {"inputs": _tensors(g["inputs"]), "outputs": _tensors(g["outputs"])}
                    for g in e["graphs"].values() if g["binary"] == b}}
                   for e in parts["parts"] for b in e["binaries"]},
            },
            "genie": {
                "supports_vision": True, "supports_streaming": True, "context_lengths": [ctx_len],
                "pipeline": {"nodes": NODES, "connections": [dict(zip(("producer_node", "producer_node_io",
                                                                       "consumer_node", "consumer_node_io"), c))
                                                             for c in CONNECTIONS]},
                "vision_preprocessing": {
                    "image_width": model.image_size, "image_height": model.image_size,
                    "normalize_mean": model.image_processor_config.get("image_mean", [0.0, 0.0, 0.0]),
                    "normalize_std": model.image_processor_config.get("image_std", [1.0, 1.0, 1.0]),
                    "rescale_factor": model.image_processor_config.get("rescale_factor", 1 / 255),
                    "pixel_input": enc_info["image_input"]},
                "sample_inputs": [{"node": "lutEncoder", "node_io": "GENIE_NODE_TEXT_ENCODER_TEXT_INPUT",
                                   "file": "sample_inputs/prompt_prefix.txt"},
                                  {"node": "imageEncoder", "node_io": "GENIE_NODE_IMAGE_ENCODER_IMAGE_INPUT",
                                   "file": "sample_inputs/pixel_values.raw"},
                                  {"node": "lutEncoder", "node_io": "GENIE_NODE_TEXT_ENCODER_TEXT_INPUT",
                                   "file": "sample_inputs/prompt_suffix.txt"}],
            },
        }
        # keys sorted: its dicts come from artifact manifests, whose key order differs between one just built (the
        # order things were made in) and one read from the store (sorted); the same bundle is the same bytes
        (out / "metadata.json").write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    files = sorted(str(f.relative_to(out)) for f in out.rglob("*") if f.is_file())
    versions = {"qnn": ep.qnn_version(), "onnxruntime-qnn": _version("onnxruntime-qnn"),
                "vlmrun-qnn-htp": _version("vlmrun-qnn-htp"), "vlmrun": _version("vlmrun")}
    manifest = {
        "format": FORMAT, "backend": NAME, "runtime": "genie-pipeline",
        "target": target, "soc": soc.name, "soc_model": soc.soc_model, "arch": soc.arch,
        "qnn_version": versions["qnn"], "versions": versions,
        "weight_sharing": bool(shared), "loads_on_emulator": not shared,
        "context_length": ctx_len, "image_input": enc_info["image_input"],
        "image_encoder": {"file": IMAGE_BIN, "precision": enc_info.get("precision"),
                          "quantization": _recipe(enc_info), "source": enc_art.path.name},
        "decoder": {"files": ctx_bins, "parts": P, "precision": dec_art.manifest.get("precision"),
                    "ar": parts["ar"], "followup_ar": parts.get("followup_ar", 0), "quantization": _recipe(dec_art.manifest), "source": dec_art.path.name},
        "lut": {"file": LUT, "dtype": enc["dtype"], "scale": enc["scale"], "zero_point": enc["zero_point"],
                "shape": [int(lut.shape[0]), int(lut.shape[1])], "sqnr_db": round(lut_sqnr, 2),
                "why": "the decoder's inputs_embeds take this encoding; Genie's generator embeds generated tokens"
                       " from this table without dequantizing it, so table and input share one encoding"},
        "embeds_input": {"encoding": embeds, "image_embeds_range": embeds["image_range"]},
        # each stage's precision as its layout said (what a diff's thresholds follow)
        "precisions": {"vision": enc_info.get("precision"), "projector": enc_info.get("precision"),
                       "decoder": dec_art.manifest.get("precision")},
        "model_files": copied, "nodes": NODES, "connections": CONNECTIONS,
        "bytes": {"image_encoder": (out / IMAGE_BIN).stat().st_size,
                  "decoder": sum((out / b).stat().st_size for b in ctx_bins), "lut": (out / LUT).stat().st_size},
        "files": {f: {"sha256": sha256(out / f), "bytes": (out / f).stat().st_size} for f in files},
        "verified": {},
    }
    manifest["bytes"]["total"] = sum(v["bytes"] for v in manifest["files"].values())
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _tensors(tensors: list[dict]) -> dict:
    """A manifest's tensor list as ``{name: {shape, dtype}}`` (metadata.json's form)."""
    return {t["name"]: {"shape": t["shape"], "dtype": t["dtype"]} for t in tensors}


def _recipe(manifest: dict) -> dict | None:
    q = manifest.get("quantization")
    if not q:
        return None
    return {k: q[k] for k in ("recipe", "quantizer", "quantizer_version", "stored", "calibration") if k in q}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


# -- verifying --------------------------------------------------------------------------------------------------
def verify_bundle(path: Path, soc_name: str | None = None, sdk_qnn: str | None = None, parse=None) -> list[str]:
    """Check a bundle before anything runs or is pushed: every file there with its hash, the node configs (by
    libGenie's own parser when ``parse`` is given: ``parse(json_text, what)``), the image input quantized, the
    generator's LUT block, the SoC (``soc_name``) and the QNN version against a phone's SDK (``sdk_qnn``). Returns
    what was checked; raises one BackendError line for the first problem."""
    from vlmrun_qualcomm.sdk import newer_than

    path = Path(path)
    m = bundle_manifest(path)
    checked = []
    for name, info in m["files"].items():
        f = path / name
        if not f.is_file():
            raise BackendError(f"bundle {path}: {name} is missing; write the bundle again (vlmrun bundle {path})")
        if f.stat().st_size != info["bytes"] or sha256(f) != info["sha256"]:
            raise BackendError(f"bundle {path}: {name} does not match its sha256 in {MANIFEST} (changed or"
                               " truncated); write the bundle again")
    for f in sorted(path.rglob("*")):  # a file the manifest does not hash would be pushed and read unchecked
        rel = f.relative_to(path).as_posix()
        if f.is_file() and rel != MANIFEST and rel not in m["files"]:
            raise BackendError(f"bundle {path}: {rel} is not in its manifest ({MANIFEST}), so nothing checks it;"
                               " remove it, or write the bundle again")
    for name in [*NODES.values(), "metadata.json"]:  # what the runtime and these checks read: hashed, present
        if name not in m["files"]:
            raise BackendError(f"bundle {path}: {name} is not a file of its manifest ({MANIFEST}); write the bundle"
                               " again")
    checked.append(f"{len(m['files'])} files present, sha256 as recorded, no file besides them")
    cfgs = {}
    for node, name in NODES.items():
        try:
            cfgs[node] = json.loads((path / name).read_text())
        except ValueError as exc:
            raise BackendError(f"bundle {path}: {name} is not valid JSON ({exc})") from None
        if parse is not None:
            parse(json.dumps(cfgs[node]), name)
    checked.append("node configs parse" + (" (libGenie's GenieNodeConfig_createFromJson)" if parse else ""))
    enc = m.get("image_input") or {}
    meta_in = json.loads((path / "metadata.json").read_text())["model_files"].get(IMAGE_BIN, {}).get("inputs", {})
    dtype = (meta_in.get(image_encoder.INPUT) or {}).get("dtype")
    if enc.get("dtype") not in ("uint8", "uint16") or dtype not in ("uint8", "uint16"):
        raise BackendError(f"bundle {path}: the image encoder's input pixel_values is {dtype or enc.get('dtype')},"
                           " not uint8/uint16: Genie drops a float image and answers without it; compile the"
                           " image-encoder form (vlmrun bundle writes it)")
    checked.append(f"image input {dtype} (scale {enc['scale']:.6g}, offset {-enc['zero_point']})")
    gen = cfgs["textGenerator"].get("text-generator") or {}
    emb = gen.get("embedding") or {}
    if emb.get("type") != "lut" or not emb.get("lut-path"):
        raise BackendError(f"bundle {path}: text-generator.json has no embedding LUT block (type lut, lut-path):"
                           " Genie would stop after one token; write the bundle again")
    if emb["lut-path"] not in m["files"]:  # a table read from elsewhere (../x) would be read unchecked
        raise BackendError(f"bundle {path}: the generator's LUT {emb['lut-path']} is not a file of its manifest;"
                           " write the bundle again")
    lut = m.get("lut") or {}
    if lut.get("dtype") == "uint16":
        want = {"scale": lut["scale"], "offset": -int(lut["zero_point"])}
        for node, block in (("text-generator.json", emb), ("text-encoder.json",
                                                           cfgs["lutEncoder"]["text-encoder"].get("lut", {}))):
            if block.get("datatype") != "ufixed16" or block.get("quant-param") != want:
                raise BackendError(f"bundle {path}: {node}'s LUT is not in the decoder input's encoding (ufixed16,"
                                   f" {want}): Genie would feed wrong embeddings; write the bundle again")
    bins = gen.get("engine", {}).get("model", {}).get("binary", {}).get("ctx-bins", [])
    img_bins = cfgs["imageEncoder"]["image-encoder"]["engine"]["model"]["binary"]["ctx-bins"]
    for node, names in ((NODES["textGenerator"], bins), (NODES["imageEncoder"], img_bins)):
        if not names:  # a node without a binary would pass every check below and then not run
            raise BackendError(f"bundle {path}: {node} names no context binary (ctx-bins is empty); write the"
                               " bundle again")
    for b in [*bins, *img_bins]:
        if b not in m["files"]:
            raise BackendError(f"bundle {path}: a config names {b}, which the bundle does not hold")
    checked.append(f"generator over {len(bins)} part binaries with its LUT; image encoder {', '.join(img_bins)}")
    if soc_name and soc_name != m["soc"]:
        raise BackendError(f"bundle {path} was compiled for {m['soc']} ({m['arch']}), not {soc_name}; write it"
                           f" again with -o soc={soc_name}")
    if sdk_qnn and newer_than(m["qnn_version"], sdk_qnn):
        raise BackendError(f"bundle {path} holds binaries from QNN {m['qnn_version']}, newer than the phone's SDK"
                           f" ({sdk_qnn}): the runtime cannot load them; use a QAIRT SDK >= {m['qnn_version']}")
    checked.append(f"binaries for {m['soc']} ({m['arch']}), QNN {m['qnn_version']}")
    return checked


def split_prompt(text: str, token: str) -> tuple[str, str]:
    if text.count(token) != 1:
        raise InputError(f"the prompt must hold the image placeholder {token!r} exactly once")
    before, after = text.split(token)
    return before, after
