"""lmms-eval scores a vlmrun layout through ``vlmrun serve``, and gets what ``vlmrun eval`` gets.

    .venv/bin/python benchmarks/lmms_eval_serve.py --lmms-eval /path/to/venv/bin/lmms-eval [--layout reference]
        [--limit 24] [--port 8140]

lmms-eval (its own environment: it pins torch, wandb, sentence-transformers and more, which is why it is not in the
suite) talks to the server with its ``openai`` model (``openai_compatible``: the chat-completions API, images as
base64 data URIs). Its tasks load their data from the Hugging Face hub, which this machine cannot reach, so this
script writes a local task over vlmrun's generated held-out pictures (``dataset_path: json`` over a JSONL file,
exact match after vlmrun's own normalisation), starts ``vlmrun serve --layout L``, runs lmms-eval against it and
compares its accuracy with ``vlmrun eval`` of the same layout on the same items. Prints JSON.
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

import children  # benchmarks/children.py: vlmrun serve on loopback

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASK_YAML = """task: vlmrun_shapes
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
process_results: !function utils.process_results
generation_kwargs:
  max_new_tokens: 48
  temperature: 0
  top_p: 1.0
  num_beams: 1
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 0.0
"""

TASK_UTILS = '''import re
import unicodedata

from PIL import Image

_PUNCT = re.compile(r"[^\\w\\s]|_", re.UNICODE)


def _norm(text):  # vlmrun.eval.answers.normalize_answer
    text = unicodedata.normalize("NFKC", str(text)).casefold()
    return " ".join(_PUNCT.sub(" ", text).split())


def doc_to_visual(doc):
    return [Image.open(doc["image_path"]).convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def process_results(doc, results):
    return {"exact_match": float(_norm(results[0]) == _norm(doc["answer"]))}
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lmms-eval", required=True, help="the lmms-eval executable (its own virtualenv)")
    ap.add_argument("--layout", default="reference")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--port", type=int, default=8140)
    args = ap.parse_args()

    from vlmrun import eval as ev
    from vlmrun.eval.dataset import heldout_dataset, read_dataset
    from vlmrun.store import ArtifactStore

    store = ArtifactStore()
    data = heldout_dataset(store)
    records, _ = read_dataset(data, limit=args.limit)
    work = Path(tempfile.mkdtemp(prefix="vlmrun-lmms-"))
    task = work / "task"
    task.mkdir()
    with open(task / "data.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({"image_path": str(Path(r.image).resolve()), "question": r.question,
                                "answer": r.answer}) + "\n")
    (task / "vlmrun_shapes.yaml").write_text(TASK_YAML.format(data=task / "data.jsonl"))
    (task / "utils.py").write_text(TASK_UTILS)

    with children.serve_process(args.layout, args.port) as server:
        base, model_id = server.base, server.model_id
        t0 = time.perf_counter()
        env = {**os.environ, "OPENAI_API_KEY": "unused", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([args.lmms_eval, "--model", "openai", "--model_args",
                               f"model_version={model_id},base_url={base}/v1", "--tasks", "vlmrun_shapes",
                               "--include_path", str(task), "--batch_size", "1", "--output_path", str(work / "out")],
                              capture_output=True, text=True, env=env, timeout=3600)
        seconds = time.perf_counter() - t0
    found = sorted((work / "out").rglob("*results*.json"))
    if proc.returncode != 0 or not found:
        print(json.dumps({"failed": True, "exit": proc.returncode, "stderr": proc.stderr[-2000:]}))
        sys.exit(1)
    res = json.loads(found[-1].read_text())["results"]["vlmrun_shapes"]
    lmms_acc = next(v for k, v in res.items() if k.startswith("exact_match") and "stderr" not in k)
    run = ev.evaluate([args.layout], data, limit=args.limit, store=store)
    lay = next(x for x in run.report["layouts"] if x["label"] == args.layout)
    print(json.dumps({"layout": args.layout, "items": len(records), "lmms_eval_exact_match": lmms_acc,
                      "vlmrun_eval_accuracy": lay["accuracy"]["all"]["accuracy"], "lmms_eval_seconds":
                      round(seconds, 1), "work": str(work)}, indent=1))


if __name__ == "__main__":
    main()
