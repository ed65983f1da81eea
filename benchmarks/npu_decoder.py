"""The all-NPU decoder per form and precision on this machine: bytes on the device, compile cost, Genie, accuracy.

    .venv/bin/python benchmarks/npu_decoder.py [--full-size] [--precisions fp16,w8a16,w4a16] [--steps 16]
        [--context-length 1024] [--prefill-ar 128] [--fixed-ar 64] [--no-fixed] [--cache-dir DIR]

Forms: ``fixed`` (today's all-npu decoder: fp16 AR-N and AR-1 graphs, one binary each) and ``parts`` (qnn_htp
``decoder_form = "parts"``: Qualcomm's shipping form). For each parts precision the decoder is compiled twice:
with weight sharing (the phone form: one binary per part holding its prompt and token graphs) and without (the
same graphs one per binary: the x86_64 HTP emulator cannot load weight-shared binaries). Both are compiled from
the same graphs (their sha256 is compared); sizes and compile cost come from the weight-shared compile, emulator
runs from the other.

Per form and precision it prints: parts, graphs per binary, bytes per part and in total (what goes to the device:
the ``.bin`` files), bytes over one copy of the weights at that precision, compile seconds and peak RSS (each
compile in its own process, after the export; quantization included), whether Genie loads the binaries (the
weight-shared ones are really tried, in a worker process), emulator seconds per prefill chunk and per token
(informational: an emulator, not a phone), host-engine and Genie tokens over the same binaries, and the
teacher-forced top-1 agreement and logits cosine against the ``reference`` layout over ``--steps`` reference
tokens. Every heavy step runs in a child process (``--child``), so one step's memory does not inflate the next.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import children  # benchmarks/children.py: a measured child process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "Describe the image in detail."


# -- children ---------------------------------------------------------------------------------------------------
def _model(spec):
    from vlmrun.model import FastVLMModel, default_model
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(spec["cache_dir"])
    model = FastVLMModel.open(spec["model"], store) if spec.get("model") else default_model(store, 256)
    return store, model


def _decoder_opts(spec, form, precision, sharing=None, engine="host") -> dict:
    if form == "fixed":
        return {"context_length": spec["ctx"], "prefill_ar": spec["fixed_ar"], "precision": precision,
                "engine": engine}
    return {"decoder_form": "parts", "context_length": spec["ctx"], "prefill_ar": spec["ar"], "precision": precision,
            "weight_sharing": sharing, "engine": engine, **({"parts": spec["parts"]} if spec.get("parts") else {}),
            **(spec.get("decoder_options") or {})}


def _pipe(spec, store, model, opts):
    from vlmrun import Pipeline
    from vlmrun.layouts import Layout, StageAssignment
    from vlmrun.stages import STAGES

    stages = {s: StageAssignment("ort_reference", {}) for s in STAGES}
    stages["decoder"] = StageAssignment("qnn_htp", opts)
    return Pipeline.build(model, Layout("bench-npu-decoder", stages), store=store, stages=("decoder",))


def child_prepare(spec) -> dict:
    """Reference side: prompt embeddings, the reference's greedy tokens and its teacher-forced logits rows."""
    import numpy as np

    from vlmrun import GenerationSettings, Pipeline
    from vlmrun.demo_image import demo_image

    store, model = _model(spec)
    ref = Pipeline.build(model, "reference", store=store)
    image = demo_image()
    gen = ref.generate(image, PROMPT, GenerationSettings(max_new_tokens=spec["steps"], ignore_eos=True)).run()
    emb = ref.embed_prompt(ref.prepare(image, PROMPT))
    tokens = np.asarray(gen.token_ids, np.int64)
    full = np.concatenate([emb, ref.embed_tokens(tokens)], axis=1)
    T = emb.shape[1]
    logits = ref.run_stage("decoder", {"inputs_embeds": full})["logits"][0, T - 1: T - 1 + len(tokens)]
    np.savez(spec["ref_file"], emb=emb, tokens=tokens, logits=logits)
    return {"prompt_tokens": int(T), "tokens": gen.token_ids, "hidden": model.hidden_size,
            "layers": model.num_layers, "vocab": model.vocab_size}


def child_export(spec) -> dict:
    """The ONNX export of one decoder form (its own process: torch's memory is not the compile's)."""
    from vlmrun import plugins
    from vlmrun.pipeline import export_artifact
    from vlmrun.stages import ExportForm
    from vlmrun_qnn_htp.options import forms, stage_options
    from vlmrun_qualcomm.parts import plan

    store, model = _model(spec)
    opts = stage_options("decoder", _decoder_opts(spec, spec["form"], spec["precision"], "on"))
    if spec["form"] == "parts":
        p = plan(model, opts)
        fs = [ExportForm.of("decoder", "decoder/parts", ar=p["ar"], ctx=p["ctx"],
                            layers=",".join(map(str, p["layers"])), rmsnorm=opts.get("rmsnorm") or "safe")]
    else:
        fs = forms("decoder", opts)
    t0 = time.perf_counter()
    built = [export_artifact(plugins.load(), store, model, f) for f in fs]
    return {"export_s": round(time.perf_counter() - t0, 1), "forms": [f.label() for f in fs],
            "built": any(a.path.name in store.builds for a in built)}


def child_compile(spec) -> dict:
    store, model = _model(spec)
    t0 = time.perf_counter()
    pipe = _pipe(spec, store, model, _decoder_opts(spec, spec["form"], spec["precision"], spec.get("sharing")))
    wall = time.perf_counter() - t0
    h = pipe.handles["decoder"]
    arts = list(h.artifacts)
    out = {"wall_s": round(wall, 1), "built": any(a.path.name in store.builds for a in arts),
           "artifacts": [str(a.path) for a in arts]}
    m = arts[0].manifest
    if "decoder_parts" in m:
        d = m["decoder_parts"]
        out.update(parts=d["count"], layers=d["layers"], ar=d["ar"], ctx=d["ctx"],
                   graphs_per_binary=d["graphs_per_binary"],
                   binaries=d["binaries_in_order"], bytes_per_part=[p["bytes"] for p in d["parts"]],
                   total_bytes=d["total_bytes"], weight_bytes=d["weight_bytes"],
                   bytes_over_weights=d["bytes_over_weights"], limit_bytes=d["limit_bytes"],
                   qnn_compile_s=m.get("compile_s"), compile_wall_s=m.get("compile_wall_s"),
                   binary_bytes=m.get("binary_bytes"),
                   prompt_binaries=[p["graphs"]["prompt"]["binary"] for p in d["parts"]],
                   quantize_s=(m.get("quantization") or {}).get("quantize_s"),
                   source_sha256=[p["source_sha256"] for p in d["parts"]])
    else:
        sizes = [sum(a.manifest.get("binary_bytes", {}).values()) for a in arts]
        out.update(parts=1, graphs_per_binary=1, binaries=[b for a in arts for b in a.manifest.get("binary_bytes", {})],
                   bytes_per_binary=sizes, total_bytes=sum(sizes),
                   qnn_compile_s=round(sum(a.manifest.get("compile_s", 0) for a in arts), 1))
    return out


class _Timed:
    """Wraps a decoder graph (``run(feeds)``) and records the seconds of each call."""

    def __init__(self, graph, log):
        self.graph, self.log = graph, log

    def __getattr__(self, name):
        return getattr(self.graph, name)

    def run(self, feeds):
        t0 = time.perf_counter()
        out = self.graph.run(feeds)
        self.log.append(time.perf_counter() - t0)
        return out


def child_run(spec) -> dict:
    """Teacher forcing, host-engine and Genie generation over one compiled artifact on the emulator."""
    import numpy as np

    from vlmrun.sampling import Sampler
    from vlmrun.stages import DecodeRequest

    store, model = _model(spec)
    genie = spec.get("genie", True)
    pipe = _pipe(spec, store, model, _decoder_opts(spec, spec["form"], spec["precision"], spec.get("sharing"),
                                                   "genie" if genie else "host"))
    h = pipe.handles["decoder"]
    ref = np.load(spec["ref_file"])
    emb, tokens, ref_logits = ref["emb"], ref["tokens"], ref["logits"]
    t0 = time.perf_counter()
    dec = h.decoder  # the parts form opens its sessions here
    load_s = time.perf_counter() - t0 + float(getattr(h, "load_s", 0.0) if spec["form"] == "fixed" else 0.0)
    times = {ar: [] for ar in dec.graphs}
    dec.graphs = {ar: _Timed(g, times[ar]) for ar, g in dec.graphs.items()}
    # one prefill of the prompt; from that state the reference tokens are fed one by one through the token graph
    # (teacher forcing: row k predicts reference token k) and, from a copy of the same state, the host engine
    # generates greedily: the emulator is slow (minutes per AR-128 chunk at full size), so the prompt runs once
    t0 = time.perf_counter()
    dec.reset()
    last = dec.prefill(emb.astype(np.float32))[0, -1]
    prefill_s = time.perf_counter() - t0
    state = ([k.copy() for k in dec.k], [v.copy() for v in dec.v], dec.n_past)
    prefill_ar = max(times)
    chunk_s = list(times[prefill_ar])
    rows = [last]
    for t in tokens[:-1]:
        rows.append(dec._step(pipe.embed_tokens(np.array([t])), 1)[0, -1])
    logits = np.stack(rows)
    tf_s = time.perf_counter() - t0
    agree = float((logits.argmax(-1) == tokens).mean())
    a, b = logits.astype(np.float64).ravel(), ref_logits.astype(np.float64).ravel()
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    token_s = list(times.get(1, []))
    dec.k, dec.v, dec.n_past = [k.copy() for k in state[0]], [v.copy() for v in state[1]], state[2]
    n = int(spec["gen_steps"])
    t0 = time.perf_counter()
    host = [int(np.argmax(last))]
    while len(host) < n:
        host.append(int(np.argmax(dec._step(pipe.embed_tokens(np.array([host[-1]])), 1)[0, -1])))
    host_s = time.perf_counter() - t0 + prefill_s
    req = DecodeRequest(emb, n, Sampler(), frozenset(), pipe.embed_tokens, int(h.context_length))
    out = {"load_s": round(load_s, 2), "teacher_forced_steps": len(tokens), "top1_agreement": agree,
           "logits_cosine": round(cos, 6), "teacher_forced_s": round(tf_s, 1),
           "teacher_forcing": "prompt prefilled once in AR-N chunks, then the reference tokens through the AR-1 graph",
           "emulator_s_per_prefill_chunk": round(float(np.median(chunk_s)), 3) if chunk_s else None,
           "prefill_ar": int(prefill_ar),
           "emulator_s_per_token": round(float(np.median(token_s)), 3) if token_s else None,
           "host_tokens": host, "host_generate_s": round(host_s, 1), "reference_tokens": tokens[:n].tolist()}
    if genie and hasattr(h, "genie_generate"):
        t0 = time.perf_counter()
        try:
            g = list(h.genie_generate(req))
            out.update(genie_load_ok=True, genie_tokens=g, genie_equals_host=g == host,
                       genie_s=round(time.perf_counter() - t0, 1), genie_profile=dict(h.last_timings))
        except Exception as exc:  # reported, not hidden
            out.update(genie_load_ok=False, genie_error=str(exc)[:400])
    return out


def child_try_shared(spec) -> dict:
    """Really try to open the weight-shared binaries here: Genie (worker process) and onnxruntime (a subprocess),
    bypassing vlmrun's refusal, to record what the emulator does with them."""
    import numpy as np

    from vlmrun import plugins
    from vlmrun.pipeline import export_artifact
    from vlmrun.stages import ExportForm
    from vlmrun_qnn_htp.genie_engine import libgenie_path
    from vlmrun_qualcomm import genie_config, genie_worker

    store, model = _model(spec)
    lut = export_artifact(plugins.load(), store, model, ExportForm.of("embed", "embed/lut")).file("embed_lut_f32.npy")
    art = Path(spec["artifact"])
    m = json.loads((art / "manifest.json").read_text())
    d = m["decoder_parts"]
    facts = genie_config.GenieModel.from_model(model)
    bins = [str(art / b) for b in d["binaries_in_order"]]
    cfg = genie_config.dialog_config(facts, "QnnHtp", tokenizer=model.path / "tokenizer.json", context_size=d["ctx"],
                                     ctx_bins=bins, max_new_tokens=2, eos=[facts.vocab - 1])
    ref = np.load(spec["ref_file"])
    out = {}
    try:
        toks = list(genie_worker.stream_tokens_worker(libgenie_path(), cfg, ref["emb"][:, :8], lut, timeout=600))
        out.update(genie_load_ok=True, genie_tokens=toks)
    except Exception as exc:
        out.update(genie_load_ok=False, genie_error=str(exc)[:300])
    wrapper = art / d["parts"][0]["graphs"]["token"]["wrapper"]
    code = ("import sys\nfrom vlmrun_qnn_htp import ep\nfrom vlmrun_qualcomm import socs\n"
            "ort, so = ep.session_options(socs.soc(None))\nso.add_session_config_entry('ep.share_ep_contexts', '1')\n"
            "ort.InferenceSession(sys.argv[1], so)\nprint('LOADED')\n")
    r = subprocess.run([sys.executable, "-c", code, str(wrapper)], capture_output=True, text=True, timeout=600)
    out.update(ort_load_exit=r.returncode, ort_loaded="LOADED" in r.stdout)
    return out


def dense_vocab(model_dir: str) -> str:
    """A copy of the full-size random model whose all-zero embedding rows (beyond the tiny tokenizer's few hundred
    tokens) are random like the others: the tied lm_head becomes dense, as in a real checkpoint."""
    import numpy as np
    import shutil
    from safetensors.numpy import load_file, save_file

    out = model_dir.rstrip("/") + "-dense"
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    rng = np.random.default_rng(0)
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors = load_file(str(f))
        for k, t in tensors.items():
            if k.endswith("embed_tokens.weight"):
                zero = np.abs(t).sum(1) == 0
                std = float(t[~zero].std()) or 0.02
                t[zero] = rng.standard_normal((int(zero.sum()), t.shape[1])).astype(t.dtype) * std
        save_file(tensors, str(Path(tmp) / f.name), metadata={"format": "pt"})
        del tensors
    os.replace(tmp, out)
    return out


CHILDREN = {"prepare": child_prepare, "export": child_export, "compile": child_compile, "run": child_run,
            "try_shared": child_try_shared}


# -- parent -----------------------------------------------------------------------------------------------------
def run_child(kind: str, spec: dict, log) -> dict:
    """One child process; its JSON result plus its wall seconds and peak RSS."""
    return children.run_child([__file__, "--child", kind, "--spec", json.dumps(spec)], log)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full-size", action="store_true", help="FastVLM-0.5B dimensions, random weights")
    ap.add_argument("--model", help="a FastVLM checkpoint directory (default: the tiny default model)")
    ap.add_argument("--precisions", default="fp16,w8a16,w4a16")
    ap.add_argument("--no-fixed", action="store_true", help="skip today's fixed form")
    ap.add_argument("--steps", type=int, default=16, help="teacher-forced reference tokens")
    ap.add_argument("--gen-steps", type=int, default=None, help="tokens generated by host and Genie (default --steps)")
    ap.add_argument("--context-length", type=int, default=None, help="default 1024 (full size) or 256")
    ap.add_argument("--prefill-ar", type=int, default=128)
    ap.add_argument("--fixed-ar", type=int, default=64, help="today's fixed form: AR-N")
    ap.add_argument("--parts", type=int, default=0, help="parts (0: the fewest under the 1000 MB limit)")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "vlmrun-bench"))
    ap.add_argument("--log", default=None, help="children's stderr (default: a temporary file)")
    ap.add_argument("--dense-vocab", action="store_true",
                    help="full size: fill the embedding rows the tiny tokenizer leaves at zero with random values, so"
                         " the tied lm_head is dense like a real checkpoint's (QNN stores zero weights compactly)")
    ap.add_argument("--sizes-only", action="store_true",
                    help="export and compile only (weight-shared parts, fixed form): bytes and compile cost")
    ap.add_argument("--decoder-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a qnn_htp decoder option for the parts form, e.g. quantizer=aimet (repeatable)")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        real_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # native banners (QNN's LIBNATIVE) go to stderr; the result line has its own fd
        real_out.write(json.dumps(CHILDREN[args.child](json.loads(args.spec))) + "\n")
        real_out.flush()
        return

    if args.full_size and not args.model:
        from vlmrun.tiny import make_tiny

        args.model = os.path.join(args.cache_dir, "full-size-fastvlm")
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            print("building the full-size random FastVLM (once) ...", file=sys.stderr)
            make_tiny(args.model, image_size=1024, full_size=True)
    if args.dense_vocab:
        args.model = dense_vocab(args.model)
    work = Path(tempfile.mkdtemp(prefix="vlmrun-bench-npu-"))
    log_path = Path(args.log) if args.log else work / "children.log"
    ctx = args.context_length or (1024 if args.full_size else 256)
    spec = {"cache_dir": args.cache_dir, "model": args.model, "ctx": ctx, "ar": args.prefill_ar,
            "fixed_ar": args.fixed_ar, "parts": args.parts, "steps": args.steps,
            "gen_steps": args.gen_steps or args.steps, "ref_file": str(work / "reference.npz"),
            "decoder_options": dict(o.split("=", 1) for o in args.decoder_option)}
    result = {"model": ("FastVLM-0.5B dims (random weights" + (", dense vocabulary rows)" if args.dense_vocab else ")")
                        if args.full_size else (args.model or "tiny default")),
              "context_length": ctx, "steps": args.steps, "decoder_options": spec["decoder_options"], "forms": {}}
    with open(log_path, "a") as log:
        def step(kind, **more):
            r = run_child(kind, {**spec, **more}, log)
            print(f"[npu_decoder] {kind} {more or ''}: {json.dumps(r)[:300]}", file=sys.stderr, flush=True)
            return r

        from vlmrun_qnn_htp import ep

        result["versions"] = ep.versions()
        result["reference"] = {} if args.sizes_only else step("prepare")
        if result["reference"].get("failed"):
            raise SystemExit(f"the reference run failed; see {log_path}")
        combos = [] if args.no_fixed else [("fixed", "fp16")]
        combos += [("parts", p) for p in args.precisions.split(",") if p]
        for form, precision in combos:
            key = f"{form}-{precision}"
            entry = {"export": step("export", form=form, precision=precision)}
            if form == "fixed":
                entry["compile"] = step("compile", form=form, precision=precision)
                if not args.sizes_only:
                    entry["run"] = step("run", form=form, precision=precision, genie=False)
            else:
                phone = step("compile", form=form, precision=precision, sharing="on")
                entry["compile"] = phone
                if args.sizes_only:
                    result["forms"][key] = entry
                    continue
                if not phone.get("failed"):  # what the emulator does with the weight-shared binaries
                    entry["shared_here"] = step("try_shared", artifact=phone["artifacts"][0])
                twin = step("compile", form=form, precision=precision, sharing="off")
                entry["emulator_twin"] = {k: twin.get(k) for k in ("binaries", "total_bytes", "graphs_per_binary",
                                                                     "child_wall_s", "failed")}
                entry["same_graphs"] = (phone.get("source_sha256") == twin.get("source_sha256")
                                        and phone.get("source_sha256") is not None)
                if twin.get("binary_bytes") and phone.get("total_bytes"):  # each prompt-graph binary: one copy of
                    one = sum(twin["binary_bytes"][b] for b in twin["prompt_binaries"])  # its part's weights, as
                    entry["one_copy_bytes"] = one  # QNN stores them, plus one graph
                    entry["bytes_over_one_copy"] = round(phone["total_bytes"] / one, 4)
                entry["run"] = step("run", form=form, precision=precision, sharing="off", genie=True)
            result["forms"][key] = entry
    result["log"] = str(log_path)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
