"""``vlmrun bundle --ray`` over several Ray nodes: the parts each node made give the bundle one process writes.

    .venv/bin/python benchmarks/bundle_ray.py [--nodes 2] [--address HOST:PORT] [--parts 2] [--precision w8a16]
        [--cache-dir DIR]

Tiny model, the all-npu layout with the decoder's parts quantized at ``--precision`` in ``--parts`` parts, no verify
items. The bundle is written in one process (into ``--cache-dir``, by default a fresh store), then with ``--ray`` on a
copy of that store (hard links) without the compiled decoder, so that its parts are quantized and compiled again, one
Ray task a part. Each step runs in a child process of its own. Printed as JSON:

* the cluster's nodes and the node each part was made on (``part_processes`` of the decoder's manifest), and how many
  different nodes made parts;
* per part, whether the quantized (QDQ) graphs are the same bytes (``source_sha256``);
* per bundle file, whether both bundles hold the same bytes (the compiled binaries do not: each compile names its
  graphs anew, see tests/test_bundle_ray.py);
* the tokens and teacher-forced logits of both bundles (Genie's pipeline on the HTP emulator, each in a process of its
  own): equal tokens, the largest logit difference.

Without ``--address`` it starts ``--nodes`` Ray nodes on this machine, one CPU each (two tasks of one CPU cannot
share a node), each ``ray start --block`` in a process group and temp dir of its own, stopped at the end. They listen
on the machine's own network address, not on loopback: several nodes on one host need
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1``, under which Ray replaces a loopback address with that address when a node
joins (so the tests' loopback-only ``ray_cluster`` is one node). Run it where that address is private.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import children  # benchmarks/children.py: a measured child process
from vlmrun.procs import kill_group
from vlmrun.store import sha256_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "Describe the image."
MULTI_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}


def child_write(spec: dict) -> dict:
    from vlmrun import layouts
    from vlmrun.bundle import write
    from vlmrun.model import default_model
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(spec["cache_dir"])
    opts = {"decoder": {"precision": spec["precision"], "parts": spec["parts"]}}
    t0 = time.perf_counter()
    m = write(layouts.resolve("all-npu", options=opts), spec["out"], model=default_model(store, 256), store=store,
              verify_items=0, ray=spec.get("address"))
    return {"write_s": round(time.perf_counter() - t0, 1), "decoder_source": m["decoder"]["source"],
            "bytes": m["bytes"]}


def child_capture(spec: dict) -> dict:
    from vlmrun import GenerationSettings, Pipeline
    from vlmrun.model import default_model
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(spec["cache_dir"])
    pipe = Pipeline.build(default_model(store, 256), f"bundle:{spec['out']}", store=store)
    got = pipe.capture(spec["image"], PROMPT, GenerationSettings(max_new_tokens=spec["tokens"]))
    import numpy as np

    np.save(spec["logits"], np.asarray(got["logits"], np.float32))
    return {"tokens": [int(t) for t in got["tokens"]]}


CHILDREN = {"write": child_write, "capture": child_capture}


def run_child(kind: str, spec: dict, log, env: dict | None = None) -> dict:
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        res = children.run_child([__file__, "--child", kind, "--spec", json.dumps(spec)], log)
    finally:
        os.environ.clear()
        os.environ.update(old)
    if res.get("failed"):
        raise SystemExit(f"benchmarks/bundle_ray.py: the {kind} step failed (exit {res.get('exit')}); see {log.name}")
    return res


def own_address() -> str:
    """This machine's address on its network (the one a UDP socket would send from; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
        except OSError as exc:
            raise SystemExit(f"benchmarks/bundle_ray.py: this machine has no network address for Ray's nodes ({exc});"
                             " give a cluster with --address") from None
        return s.getsockname()[0]


class Nodes:
    """``count`` Ray nodes on this machine (``ray start --block``, one CPU each, each in a process group of its own),
    the first the head."""

    def __init__(self, count: int, work: Path):
        self.ray = str(Path(sys.executable).with_name("ray"))
        self.env = dict(os.environ, **MULTI_NODE_ENV)
        self.ip = own_address()
        with socket.socket() as s:
            s.bind((self.ip, 0))
            self.port = s.getsockname()[1]
        self.address = f"{self.ip}:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.work = work
        common = ["--block", "--num-cpus", "1", "--node-ip-address", self.ip, "--disable-usage-stats"]
        self._start("head", ["--head", "--port", str(self.port), "--include-dashboard=false", "--temp-dir",
                             str(work / "rt"), *common])
        for i in range(1, count):
            self._start(f"node{i}", ["--address", self.address, *common])

    def _start(self, name: str, args: list[str]) -> None:
        log = self.work / f"{name}.log"
        with open(log, "w") as out:
            self.procs.append(subprocess.Popen([self.ray, "start", *args], stdout=out, stderr=subprocess.STDOUT,
                                               env=self.env, start_new_session=True))
        deadline = time.monotonic() + 180
        while "will now block" not in log.read_text():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"benchmarks/bundle_ray.py: Ray {name} did not start: {log.read_text()[-600:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            kill_group(p)  # whatever of that node is left (its group only)


def nodes_of(address: str) -> list[str]:
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    try:
        return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    finally:
        ray.shutdown()


def main(args, log) -> dict:
    import numpy as np

    work = Path(tempfile.mkdtemp(prefix="vlmrun-bundle-ray-"))
    cache = Path(args.cache_dir) if args.cache_dir else work / "cache"
    one_out, ray_out, copy = work / "bundle-one", work / "bundle-ray", work / "cache-ray"
    nodes = None
    try:
        spec = {"cache_dir": str(cache), "precision": args.precision, "parts": args.parts}
        one = run_child("write", {**spec, "out": str(one_out)}, log)
        source = one["decoder_source"]
        shutil.copytree(cache, copy, copy_function=os.link,
                        ignore=lambda d, names: [n for n in names if n == source or n in ("eval", "tune", "locks")])
        if args.address:
            address = args.address
        else:
            nodes = Nodes(args.nodes, work)
            address = nodes.address
        members = nodes_of(address)
        on_ray = run_child("write", {**spec, "cache_dir": str(copy), "out": str(ray_out), "address": address}, log,
                           env=MULTI_NODE_ENV if nodes else None)
        a = json.loads((cache / "artifacts" / source / "manifest.json").read_text())
        b = json.loads((copy / "artifacts" / source / "manifest.json").read_text())
        made_on = {part: w.get("ray_node") for part, w in b.get("part_processes", {}).items()}
        parts = [{"part": pa["index"], "layers": pa["layers"], "qdq_same_bytes": pa["source_sha256"] == pb["source_sha256"]}
                 for pa, pb in zip(a["decoder_parts"]["parts"], b["decoder_parts"]["parts"], strict=True)]
        files = {f.name: f.is_file() and sha256_file(f) == sha256_file(ray_out / f.name) for f in sorted(one_out.iterdir())
                 if f.is_file()}
        image = work / "scene.jpg"
        from vlmrun.demo_image import demo_image

        demo_image().save(image, quality=95)
        cap = {}
        for name, out, store in (("one", one_out, cache), ("ray", ray_out, copy)):
            cap[name] = run_child("capture", {"cache_dir": str(store), "out": str(out), "image": str(image),
                                              "tokens": args.tokens, "logits": str(work / f"{name}.npy")}, log)
        la, lb = np.load(work / "one.npy").astype(np.float64), np.load(work / "ray.npy").astype(np.float64)
        return {
            "model": "shapes-tiny (trained, 256x256)", "precision": args.precision, "parts": args.parts,
            "cluster": {"address": "given" if args.address else f"{args.nodes} nodes started on this machine",
                        "nodes": len(members)},
            "parts_made_on_nodes": len(set(made_on.values()) & set(members)), "made_on": made_on,
            "qdq": parts, "bundle_files_same_bytes": files,
            "tokens_equal": cap["one"]["tokens"] == cap["ray"]["tokens"], "tokens": cap["ray"]["tokens"],
            "logits_max_abs_diff": float(np.abs(la - lb).max()), "logits_max_abs": float(np.abs(la).max()),
            "one_process": {"write_s": one["write_s"], "child_wall_s": one["child_wall_s"]},
            "on_ray": {"write_s": on_ray["write_s"], "child_wall_s": on_ray["child_wall_s"]},
        }
    finally:
        if nodes is not None:
            nodes.stop()
        shutil.rmtree(work, ignore_errors=True)


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2, help="Ray nodes to start on this machine (default 2)")
    p.add_argument("--address", help="an existing cluster's HOST:PORT instead (every node must see the store)")
    p.add_argument("--parts", type=int, default=2, help="the decoder's parts: one Ray task each (default 2)")
    p.add_argument("--precision", default="w8a16", choices=("w8a16", "w4a16"))
    p.add_argument("--tokens", type=int, default=8, help="tokens each bundle answers (default 8)")
    p.add_argument("--cache-dir", help="the store of the one-process bundle (default: a fresh one, removed after)")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child](json.loads(args.spec))))
        return
    if args.nodes < 1 or args.parts < 1:
        p.error("--nodes and --parts must be at least 1")
    with tempfile.NamedTemporaryFile("w", prefix="bundle-ray-", suffix=".log", delete=False) as log:
        print(f"child logs: {log.name}", file=sys.stderr)
        print(json.dumps(main(args, log), indent=1))


if __name__ == "__main__":
    cli()
