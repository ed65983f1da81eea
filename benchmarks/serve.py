"""``vlmrun serve`` measured on this machine, as JSON: overhead against the Python API, a load test, sampling cost.

    .venv/bin/python benchmarks/serve.py [--layout reference] [--requests 10] [--clients 50] [--soak-s 60]
        [--max-queue 64] [--full-size]

* overhead: the same greedy request (demo picture, "Describe the image.") through the Python API in this process
  and through the server (a ``vlmrun serve`` subprocess on loopback, streaming, via httpx): tokens/s and TTFT,
  medians over ``--requests``;
* load: ``--clients`` concurrent streaming clients, each sending requests back to back for ``--soak-s`` seconds;
  every answer is checked against the API's; reported: answered, refused (429), dropped (anything else: must be
  0), latency percentiles, the server's RSS at the start and end of the soak and its peak;
* sampling: ms per token at a 151,936-entry vocabulary (FastVLM-0.5B's) for temperature, top-k and top-p, the
  plain algorithm (a stable sort of the whole vocabulary) against vlmrun's partial selection;
* ``--body-mb N`` (only this, then exit): the server's peak RSS for one N MB request body (a base64 image as big),
  declared by Content-Length and sent chunked, each against a fresh server: refused with 413 before it is read.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import children  # benchmarks/children.py: vlmrun serve on loopback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "Describe the image."


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def sampling_cost() -> dict:
    import numpy as np

    from vlmrun.sampling import SamplingSettings, sample, sample_sorted

    r = np.random.default_rng(0)
    logits = (r.standard_normal(151936) * 2.5).astype(np.float32)
    logits[r.integers(0, 151936, 8)] += 12  # a peaked distribution, as a trained LM's
    out = {}
    for name, st in (("temperature 0.7", SamplingSettings(0.7)), ("top-k 40, top-p 0.9", SamplingSettings(1.0, 40, 0.9)),
                     ("top-p 0.9", SamplingSettings(0.8, 0, 0.9))):
        row = {}
        for label, fn in (("plain_ms", sample_sorted), ("partial_ms", sample)):
            g = np.random.default_rng(0)
            times = []
            for _ in range(30):
                t = time.perf_counter()
                fn(logits, st, g)
                times.append((time.perf_counter() - t) * 1e3)
            row[label] = round(statistics.median(times), 3)
        out[name] = row
    return out


async def _stream_once(client, url: str, body: dict, stats: dict | None = None) -> tuple[str, float, float, int]:
    """One streaming request: (text, seconds to the first text, seconds in all, status); ``stats`` gets the
    completion tokens (the usage chunk) and the seconds between the first and the last text."""
    t0 = time.perf_counter()
    first = last = None
    text = ""
    async with client.stream("POST", url, json={**body, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            await r.aread()
            return "", 0.0, 0.0, r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage") and stats is not None:
                stats["tokens"] = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content") or ""
                if piece:
                    last = time.perf_counter()
                    first = first or last
                text += piece
    if stats is not None:
        stats["span_s"] = (last - first) if first else 0.0
    return text, (first or time.perf_counter()) - t0, time.perf_counter() - t0, 200


async def load(url: str, body: dict, want: str, clients: int, seconds: float, pid: int) -> dict:
    import httpx

    answered = refused = dropped = wrong = 0
    latencies: list[float] = []
    rss: list[float] = []
    stop = time.perf_counter() + seconds

    async def one_client():
        nonlocal answered, refused, dropped, wrong
        async with httpx.AsyncClient(timeout=600) as client:
            while time.perf_counter() < stop:
                try:
                    text, _, total, status = await _stream_once(client, url, body)
                except Exception:
                    dropped += 1
                    continue
                if status == 429:
                    refused += 1
                    await asyncio.sleep(0.5)
                elif status != 200:
                    dropped += 1
                else:
                    answered += 1
                    wrong += text != want
                    latencies.append(total)

    async def sample_rss():
        while time.perf_counter() < stop:
            rss.append(rss_mb(pid))
            await asyncio.sleep(1.0)

    await asyncio.gather(sample_rss(), *[one_client() for _ in range(clients)])
    lat = sorted(latencies)
    pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3)) if lat else (lambda q: None)
    return {"clients": clients, "seconds": seconds, "answered": answered, "wrong": wrong, "refused_429": refused,
            "dropped": dropped, "latency_s": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)},
            "server_rss_mb": {"first": round(rss[0], 1) if rss else None, "last": round(rss[-1], 1) if rss else None,
                              "max": round(max(rss), 1) if rss else None, "peak_hwm": round(peak_mb(pid), 1),
                              # after the first tenth (warm-up) and at the end: flat memory means these agree
                              "at_10pct": round(rss[len(rss) // 10], 1) if rss else None,
                              "at_50pct": round(rss[len(rss) // 2], 1) if rss else None}}


def big_body(layout: str, port: int, mb: int) -> dict:
    """Peak RSS of a fresh ``vlmrun serve`` while it gets one ``mb`` MB body, declared and chunked."""
    body = bytearray(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe."}, '
                     b'{"type": "image_url", "image_url": {"url": "data:image/png;base64,')
    body += b"A" * (mb * 2**20 - len(body) - 8 - (mb * 2**20 - len(body) - 8) % 4) + b'"}}]}]}'
    out = {}
    for how in ("declared", "chunked"):
        with children.serve_process(layout, port) as server:
            idle = rss_mb(server.pid)
            Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # the peak from here on
            head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            head += "Transfer-Encoding: chunked\r\n\r\n" if how == "chunked" else f"Content-Length: {len(body)}\r\n\r\n"
            sent, reply = 0, b""
            with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
                try:
                    s.sendall(head.encode())
                    for i in range(0, len(body), 2**20):
                        piece = bytes(body[i:i + 2**20])
                        s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if how == "chunked" else piece)
                        sent += len(piece)
                    s.sendall(b"0\r\n\r\n" if how == "chunked" else b"")
                except OSError:  # refused and closed while the client still sends: expected
                    pass
                try:
                    while b"\r\n" not in reply:
                        reply += s.recv(4096) or b"\r\n"
                except OSError:
                    pass
            time.sleep(0.5)
            import httpx

            out[how] = {"idle_rss_mb": round(idle), "peak_rss_mb": round(peak_mb(server.pid)),
                        "sent_mb": round(sent / 2**20, 1), "status": reply.split(b"\r\n")[0].decode() or None,
                        "health_after": httpx.get(f"{server.base}/health").status_code}
            print(f"[serve] {mb} MB body, {how}: {json.dumps(out[how])}", file=sys.stderr)
    return {"body_mb": mb, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="reference")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--soak-s", type=float, default=60.0)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--model", default=None, help="a checkpoint (default: the tiny default model)")
    ap.add_argument("--body-mb", type=int, default=None, help="only the peak RSS for one request body of N MB")
    args = ap.parse_args()
    if args.body_mb:
        print(json.dumps(big_body(args.layout, args.port, args.body_mb), indent=1))
        return

    import httpx

    from vlmrun import GenerationSettings, Pipeline
    from vlmrun.demo_image import demo_image

    pic = demo_image()
    buf = io.BytesIO()
    pic.save(buf, format="PNG")
    url_img = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    pipe = Pipeline.build(args.model, args.layout)
    api_tps, api_ttft, api_wall, want = [], [], [], None
    for _ in range(args.requests):  # measured as the server's client measures: wall clock, first to last text
        t0 = time.perf_counter()
        gen = pipe.generate(pic, PROMPT, GenerationSettings(max_new_tokens=args.max_tokens))
        first = last = None
        for piece in gen:
            if piece:
                last = time.perf_counter()
                first = first or last
        want = gen.text
        n = len([t for t in gen.token_ids if t not in pipe.model.stop_ids])
        api_ttft.append(((first or time.perf_counter()) - t0) * 1e3)
        api_wall.append((time.perf_counter() - t0) * 1e3)
        api_tps.append((n - 1) / (last - first) if first and last > first and n > 1 else 0.0)
    extra = ["--max-queue", str(args.max_queue), *(["--model", args.model] if args.model else [])]
    with children.serve_process(args.layout, args.port, extra) as server:
        base, model_id = server.base, server.model_id
        body = {"model": model_id, "stream": True, "max_tokens": args.max_tokens, "messages": [{"role": "user", "content": [
            {"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url_img}}]}]}
        srv_tps, srv_ttft, srv_wall = [], [], []

        async def serial():
            async with httpx.AsyncClient(timeout=600) as client:
                for _ in range(args.requests):
                    stats: dict = {}
                    text, ttft, total, status = await _stream_once(client, f"{base}/v1/chat/completions", body,
                                                                   stats)
                    assert status == 200 and text == want, (status, text, want)
                    n = stats.get("tokens", 0)
                    srv_ttft.append(ttft * 1e3)
                    srv_wall.append(total * 1e3)
                    srv_tps.append((n - 1) / stats["span_s"] if n > 1 and stats.get("span_s") else 0.0)

        asyncio.run(serial())
        result = {"layout": args.layout, "answer": want, "overhead": {
            "api": {"tokens_per_s": round(statistics.median(api_tps), 1), "ttft_ms": round(statistics.median(api_ttft), 1)},
            "server": {"tokens_per_s": round(statistics.median(srv_tps), 1), "ttft_ms": round(statistics.median(srv_ttft), 1)}}}
        o = result["overhead"]
        o["api"]["wall_ms"] = round(statistics.median(api_wall), 1)
        o["server"]["wall_ms"] = round(statistics.median(srv_wall), 1)
        # a model whose text comes out in few pieces (random weights: bytes that only join at the end) has no
        # text-based tokens/s: the whole request's wall time says what the server adds
        if o["api"]["tokens_per_s"] > 0:
            o["tokens_per_s_loss"] = round(1 - o["server"]["tokens_per_s"] / o["api"]["tokens_per_s"], 3)
        o["ttft_extra_ms"] = round(o["server"]["ttft_ms"] - o["api"]["ttft_ms"], 1)
        o["wall_extra_ms"] = round(o["server"]["wall_ms"] - o["api"]["wall_ms"], 1)
        o["wall_extra_fraction"] = round(o["wall_extra_ms"] / o["api"]["wall_ms"], 4)
        print(f"[serve] overhead {json.dumps(o)}", file=sys.stderr)
        result["load"] = asyncio.run(load(f"{base}/v1/chat/completions", body, want, args.clients, args.soak_s,
                                          server.pid))
        print(f"[serve] load {json.dumps(result['load'])}", file=sys.stderr)
    result["sampling_151936"] = sampling_cost()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
