"""``vlmrun serve``: the OpenAI-compatible server, reached by the real ``openai`` client over loopback.

* the reference layout's answer for a picture, streaming and not, with usage and vlmrun's timings; an all-npu
  layout's (emulator) and a bundle's too;
* every bad request: its status and OpenAI-style error body, nothing written to the store, and the next good
  request answered;
* safe to expose: ``--api-key`` (401 without or with a wrong key, /health open), local image paths only under
  ``--allowed-local-media-path`` (the same 400 for a forbidden and a missing path, through ``..`` or a symlink), a
  body over ``--max-request-bytes`` refused with 413 before it is read (declared or chunked), the server still up;
* one generation at a time on a device layout: a full queue is 429 with Retry-After; a client that disconnects
  frees the device for the next request (measured by when the next one starts);
* sampling without sorting the vocabulary picks the same tokens as the plain algorithm for the same seeds.
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from vlmrun import GenerationSettings, Pipeline  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn serving ``create_app(pipe, ...)`` in a thread, on loopback."""

    def __init__(self, pipe, key: str = "unused", **kw):
        import uvicorn

        from vlmrun.serve import create_app

        self.port = free_port()
        self.app = create_app(pipe, **kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def data_uri(image, fmt="PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def messages(url: str, text: str = "Describe the image.") -> list:
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def picture():
    from vlmrun.demo_image import demo_image

    return demo_image()


@pytest.fixture(scope="module")
def ref_server(ref_pipe, image_path):
    s = Server(ref_pipe, allowed_local_media_path=image_path.parent)
    yield s
    s.stop()


def test_the_openai_client_gets_the_reference_answer(ref_server, ref_pipe, picture, image_path):
    want = ref_pipe.generate(picture, "Describe the image.", GenerationSettings(max_new_tokens=64)).run()
    c = ref_server.client
    r = c.chat.completions.create(model="fastvlm-shapes-tiny", messages=messages(data_uri(picture)), max_tokens=64)
    assert r.choices[0].message.content == want.text == "A red circle on a blue background."
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == 68 and r.usage.completion_tokens == len(want.token_ids) - 1  # not the eos
    assert {"vision_ms", "ttft_ms", "tokens_per_s"} <= set(r.model_extra["vlmrun"]["timings"])
    pieces, usage, finish = [], None, None
    for ch in c.chat.completions.create(model="fastvlm-shapes-tiny", messages=messages(str(image_path)),
                                        stream=True, stream_options={"include_usage": True}):
        if ch.choices:
            pieces.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    # streamed: a role chunk, then the text in chunks (pieces that are ready together go in one; the slow test
    # below sees them one by one), then the finish reason
    assert "".join(pieces) == want.text and pieces[0] == "" and len(pieces) >= 3 and finish == "stop"
    assert usage.completion_tokens == r.usage.completion_tokens
    # max_tokens and stop strings
    r = c.chat.completions.create(model="fastvlm-shapes-tiny", messages=messages(data_uri(picture)), max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = c.chat.completions.create(model="fastvlm-shapes-tiny", messages=messages(data_uri(picture)), stop=[" on"])
    assert r.choices[0].message.content == "A red circle" and r.choices[0].finish_reason == "stop"
    # streamed, the start of a stop string is held back until it is not one: never " on a" before " on a blue"
    for stop, want_text in (([" on a blue"], "A red circle"), ([" on a green"], want.text)):
        got = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="fastvlm-shapes-tiny", messages=messages(data_uri(picture)), stop=stop, stream=True) if ch.choices]
        assert "".join(got) == want_text, (stop, got)
    models = c.models.list().data
    assert [m.id for m in models] == ["fastvlm-shapes-tiny"]
    assert models[0].model_extra["layout"]["stages"]["decoder"]["backend"] == "ort_reference"


def test_seeded_sampling_through_the_server_is_the_python_apis(ref_server, ref_pipe, picture):
    from vlmrun.sampling import SamplingSettings

    want = ref_pipe.generate(picture, "Describe the image.", GenerationSettings(
        max_new_tokens=20, sampling=SamplingSettings(1.2, 0, 0.95, 7))).run()
    r = ref_server.client.chat.completions.create(model="fastvlm-shapes-tiny", messages=messages(data_uri(picture)),
                                                  max_tokens=20, temperature=1.2, top_p=0.95, seed=7)
    assert r.choices[0].message.content == want.text
    # without a seed, each request draws its own (OpenAI's meaning): every unseeded request was seed 0, the same
    # "random" answer for all; here the drawn seed is made 7, and the answer is seed 7's
    import vlmrun.serve_runs as runs

    drawn = []
    real = runs.secrets.randbits
    runs.secrets.randbits = lambda bits: drawn.append(bits) or 7
    try:
        r = ref_server.client.chat.completions.create(model="fastvlm-shapes-tiny", max_tokens=20, temperature=1.2,
                                                      top_p=0.95, messages=messages(data_uri(picture)))
    finally:
        runs.secrets.randbits = real
    assert drawn == [31] and r.choices[0].message.content == want.text


def _bomb(tmp_path) -> str:
    from PIL import Image

    path = tmp_path / "bomb.png"
    Image.new("1", (12000, 5000)).save(path)  # 60 M pixels in a few kB
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def test_bad_requests_are_4xx_with_a_json_body_and_harm_nothing(ref_server, picture, store, tmp_path):
    good = messages(data_uri(picture))
    before = sorted(p.name for p in store.artifacts_dir.iterdir())
    post = lambda body, raw=None: httpx.post(f"{ref_server.url}/v1/chat/completions",  # noqa: E731
                                             content=raw if raw is not None else json.dumps(body),
                                             headers={"Content-Type": "application/json"}, timeout=60)
    cases = [
        (None, b"{not json", 400, "bad_json"),
        ({"messages": messages("data:image/png;base64,@@@not-base64@@@")}, None, 400, "bad_base64"),
        ({"messages": messages("data:image/png;base64," + base64.b64encode(b"not an image").decode())}, None, 400,
         "bad_image"),
        ({"messages": messages(_bomb(tmp_path))}, None, 400, "image_too_large"),
        ({"messages": [{"role": "user", "content": [*good[0]["content"], *[good[0]["content"][1]] * 8]}]}, None, 400,
         "too_many_images"),
        ({"messages": [*good, {"role": "assistant", "content": ""}, {"role": "user", "content": "And?"}]}, None, 400,
         "empty_turn"),
        ({"messages": messages(data_uri(picture), "word " * 3000)}, None, 400, "context_length_exceeded"),
        ({"model": "gpt-4o", "messages": good}, None, 404, "model_not_found"),
        ({"messages": good, "temperature": -1}, None, 400, None),
        ({"messages": messages("https://example.com/a.png")}, None, 400, None),
        ({"messages": messages(str(tmp_path / "bomb.png"))}, None, 400, "local_path_forbidden"),  # not allowed
        ({"messages": good, "seed": -1}, None, 400, None),  # was a 500
        ({"messages": good, "seed": 2**31}, None, 400, None),  # past what Genie's sampler takes: a 500 there
        ({"messages": good, "temperature": float("nan")}, None, 400, None),  # NaN passed every range check
        ({"messages": good, "top_p": float("inf")}, None, 400, None),
        ({"messages": good, "n": 2}, None, 400, None),  # one answer was made, silently
        ({"messages": good, "stream": True, "stream_options": "x"}, None, 400, None),
        ({"messages": messages(data_uri(picture), "What is <image> here?")}, None, 400, "image_placeholder_in_text"),
    ]
    for body, raw, status, code in cases:
        r = post(body, raw)
        assert r.status_code == status, (code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"] and "\n" not in err["message"]
        assert err["code"] == code, err
    assert sorted(p.name for p in store.artifacts_dir.iterdir()) == before  # nothing written
    r = ref_server.client.chat.completions.create(model="fastvlm-shapes-tiny", messages=good)
    assert r.choices[0].message.content == "A red circle on a blue background."


def raw_http(port: int, head: str, chunks=(), timeout: float = 30) -> tuple[int, dict]:
    """One HTTP/1.1 request written by hand (``head``: the request line and headers), then ``chunks`` of body as
    they are; the response's status and JSON body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + b"\r\n\r\n")
        for c in chunks:
            s.sendall(c)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536) or b"\r\n\r\n"
        top, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(ln.split(b":")[1] for ln in top.split(b"\r\n") if ln.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += s.recv(65536)
    return int(top.split()[1]), json.loads(rest)


def one_line_error(r) -> dict:
    err = r.json()["error"] if hasattr(r, "json") else r["error"]
    assert err["message"] and "\n" not in err["message"], err
    return err


def test_an_api_key_is_required_on_v1_and_health_stays_open(ref_pipe, picture):
    s = Server(ref_pipe, key="s3cret-key", api_key="s3cret-key")
    try:
        r = s.client.chat.completions.create(model="fastvlm-shapes-tiny", messages=messages(data_uri(picture)))
        assert r.choices[0].message.content == "A red circle on a blue background."
        assert [m.id for m in s.client.models.list().data] == ["fastvlm-shapes-tiny"]
        wrong = openai.OpenAI(base_url=f"{s.url}/v1", api_key="s3cret-kez", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.chat.completions.create(model="fastvlm-shapes-tiny", messages=messages(data_uri(picture)))
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        for headers in ({}, {"Authorization": "s3cret-key"}, {"Authorization": "Basic s3cret-key"},
                        {"Authorization": "Bearer"}, {"Authorization": "Bearer s3cret-key-and-more"}):
            r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": messages(data_uri(picture))},
                           headers=headers)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", (headers, r.text)
            err = one_line_error(r)
            assert err["code"] == "invalid_api_key" and "s3cret" not in r.text
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        h = httpx.get(f"{s.url}/health")
        assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["running"] == 0
    finally:
        s.stop()


def test_the_api_key_option_reads_the_environment_and_a_public_host_without_one_warns(monkeypatch):
    from vlmrun.cli import cli
    from vlmrun.serve import exposure_warning

    monkeypatch.setenv("VLMRUN_API_KEY", "from-env")
    cmd = cli.commands["serve"]
    assert cmd.make_context("serve", []).params["api_key"] == "from-env"
    assert cmd.make_context("serve", ["--api-key", "flag"]).params["api_key"] == "flag"
    assert cmd.make_context("serve", []).params["max_request_bytes"] == 64 * 1024 * 1024
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("localhost", None) is None
    assert exposure_warning("::1", None) is None and exposure_warning("0.0.0.0", "k") is None
    for host in ("0.0.0.0", "192.168.1.5", "myhost.lan"):
        w = exposure_warning(host, None)
        assert w.startswith("warning:") and "--api-key" in w and "\n" not in w


def test_local_images_only_under_the_allowed_folder_and_no_existence_oracle(ref_pipe, picture, tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir()
    outside.mkdir()
    picture.save(allowed / "scene.png")
    picture.save(outside / "secret.png")
    (allowed / "link.png").symlink_to(outside / "secret.png")  # a link out of the folder
    (allowed / "linkdir").symlink_to(outside)
    (allowed / "sub").mkdir()
    post = lambda url, server: httpx.post(f"{server.url}/v1/chat/completions",  # noqa: E731
                                          json={"messages": messages(url)}, timeout=60)
    forbidden = [str(outside / "secret.png"), str(outside / "missing.png"), "/etc/passwd", "/etc/nonexistent",
                 f"{allowed}/../private/secret.png", f"{allowed}/../private/missing.png", "../private/secret.png",
                 str(allowed / "link.png"), str(allowed / "linkdir" / "secret.png"),
                 str(allowed / "linkdir" / "missing.png"), f"file://{outside}/secret.png"]
    plain = Server(ref_pipe)  # no folder: no local path at all, the same answer for each
    try:
        bodies = set()
        for url in [*forbidden, str(allowed / "scene.png"), "scene.png"]:
            r = post(url, plain)
            assert r.status_code == 400, (url, r.text)
            assert one_line_error(r)["code"] == "local_path_forbidden"
            bodies.add(r.content)
        assert len(bodies) == 1, bodies  # byte for byte: nothing tells an existing file from a missing one
    finally:
        plain.stop()
    s = Server(ref_pipe, allowed_local_media_path=allowed)
    try:
        bodies = set()
        for url in forbidden:
            r = post(url, s)
            assert r.status_code == 400, (url, r.text)
            err = one_line_error(r)
            assert err["code"] == "local_path_forbidden" and "--allowed-local-media-path" in err["message"]
            bodies.add(r.content)
        assert len(bodies) == 1, bodies
        for url in (str(allowed / "scene.png"), "scene.png", f"file://{allowed}/scene.png",
                    f"{allowed}/sub/../scene.png"):  # absolute, relative to the folder, file://, .. inside
            r = s.client.chat.completions.create(model="fastvlm-shapes-tiny", messages=messages(url))
            assert r.choices[0].message.content == "A red circle on a blue background.", url
        r = post(str(allowed / "missing.png"), s)  # inside the folder, what exists is no secret
        assert r.status_code == 400 and one_line_error(r)["code"] == "image_not_found"
        (allowed / "notes.txt").write_text("not an image")
        r = post("notes.txt", s)
        assert r.status_code == 400 and one_line_error(r)["code"] == "bad_image"
        def open_on_folders():
            return [link for fd in os.listdir("/proc/self/fd")
                    if (link := os.path.realpath(f"/proc/self/fd/{fd}")) in (str(allowed), str(allowed / "sub"))]

        for url in ("sub", str(allowed), f"file://{allowed}/sub"):  # a folder: refused, not a 500, no descriptor left
            r = post(url, s)
            assert r.status_code == 400 and one_line_error(r)["code"] == "local_path_forbidden", (url, r.text)
        assert open_on_folders() == []
        r = s.client.chat.completions.create(model="fastvlm-shapes-tiny",  # RFC 8089's local host
                                             messages=messages(f"file://localhost{allowed}/scene.png"))
        assert r.choices[0].message.content == "A red circle on a blue background."
    finally:
        s.stop()


def test_a_body_over_the_limit_is_413_before_it_is_read_and_the_server_stays_up(ref_pipe, picture):
    limit = 256 * 1024
    s = Server(ref_pipe, max_request_bytes=limit)
    try:
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        # declared: 300 MB announced, not one byte of it sent: the answer comes at once
        t = time.perf_counter()
        status, body = raw_http(s.port, head + f"\r\nContent-Length: {300 * 2**20}")
        assert status == 413 and time.perf_counter() - t < 5
        err = one_line_error(body)
        assert err["code"] == "request_too_large" and f"{300 * 2**20} bytes; the limit is {limit}" in err["message"]
        # chunked: no length said; refused once the bytes counted pass the limit (the rest never sent)
        piece = b"x" * 65536
        chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
        status, body = raw_http(s.port, head + "\r\nTransfer-Encoding: chunked", [chunk] * 5)
        assert status == 413 and one_line_error(body)["code"] == "request_too_large"
        # the same through httpx (a body just over the limit), then the server answers as before
        r = httpx.post(f"{s.url}/v1/chat/completions", content=b" " * (limit + 1),
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and one_line_error(r)["code"] == "request_too_large"
        assert httpx.get(f"{s.url}/health").json()["status"] == "ok"
        r = s.client.chat.completions.create(model="fastvlm-shapes-tiny", messages=messages(data_uri(picture)))
        assert r.choices[0].message.content == "A red circle on a blue background."
        chunks = [b"%x\r\n%s\r\n" % (len(c), c) for c in (json.dumps({"messages": messages(data_uri(picture))}
                                                                      ).encode(),)] + [b"0\r\n\r\n"]
        status, body = raw_http(s.port, head + "\r\nTransfer-Encoding: chunked", chunks)  # chunked under the limit
        assert status == 200 and body["choices"][0]["message"]["content"] == "A red circle on a blue background."
    finally:
        s.stop()


class SlowPipe:
    """The reference pipeline with a pause before every text piece: a generation that holds the device long
    enough to be queued behind, or abandoned. ``produced`` counts the pieces each generation really made."""

    def __init__(self, pipe, delay=0.3):
        self.pipe, self.delay, self.produced = pipe, delay, []
        self.model, self.layout, self.registry = pipe.model, pipe.layout, pipe.registry
        self.context_length = pipe.context_length
        self.prepare, self.prepare_messages = pipe.prepare, pipe.prepare_messages

    def new_kept_state(self):
        return self.pipe.new_kept_state()

    def generate_turn(self, plan, kept, settings):
        gen = self.pipe.generate_turn(plan, kept, settings)
        count = [0]
        self.produced.append(count)
        inner = gen._iter

        def slow():
            for piece in inner:
                time.sleep(self.delay)
                count[0] += 1
                yield piece

        gen._iter = slow()
        return gen


def test_one_at_a_time_on_a_device_a_full_queue_is_429_and_a_disconnect_frees_the_device(ref_pipe, picture):
    from vlmrun.errors import UsageError
    from vlmrun.serve import create_app

    slow = SlowPipe(ref_pipe)
    slow.registry = type("R", (), {"backend": lambda self, name: type("B", (), {"concurrent": False})()})()
    with pytest.raises(UsageError, match="serves one generation at a time"):
        create_app(slow, concurrency=2)
    s = Server(slow, max_queue=1)
    try:
        body = {"messages": messages(data_uri(picture)), "stream": True, "max_tokens": 40}
        waiting: dict = {}

        def second():
            waiting["response"] = httpx.post(f"{s.url}/v1/chat/completions", timeout=60,
                                             json={**body, "stream": False, "max_tokens": 2})
            waiting["done"] = time.perf_counter()

        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{s.url}/v1/chat/completions", json=body) as first:
                it = first.iter_lines()
                assert next(it).startswith("data: ")  # the role chunk: it holds the device now
                t = threading.Thread(target=second)
                t.start()
                for _ in range(100):  # the second request waits in the queue
                    if httpx.get(f"{s.url}/health").json()["waiting"] == 1:
                        break
                    time.sleep(0.05)
                busy = client.post(f"{s.url}/v1/chat/completions", json={**body, "stream": False})
                assert busy.status_code == 429 and int(busy.headers["Retry-After"]) >= 1
                assert busy.json()["error"]["type"] == "rate_limit_error"
                next(it)  # one text piece, then the client goes away mid-answer
                left = time.perf_counter()
            t.join(60)
        r = waiting["response"]
        assert r.status_code == 200, r.text
        # the abandoned answer had ~18 pieces left (5 s at 0.3 s each): the waiting request ran at once instead
        after = waiting["done"] - left
        assert after < 2.5 and slow.produced[0][0] <= 8, (after, slow.produced[0][0])
        assert httpx.get(f"{s.url}/health").json()["running"] == 0
    finally:
        s.stop()


def test_an_all_npu_layout_and_a_bundle_behind_the_server(tiny_model, store, picture, npu_pipe, bundle_dir):
    npu = npu_pipe
    want = npu.generate(picture, "Describe the image.", GenerationSettings(max_new_tokens=32)).run().text
    for pipe in (npu, Pipeline.build(tiny_model, f"bundle:{bundle_dir}", store=store)):
        s = Server(pipe)
        try:
            r = s.client.chat.completions.create(model="fastvlm-shapes-tiny", messages=messages(data_uri(picture)),
                                                 max_tokens=32)
            assert r.choices[0].message.content == want
            assert httpx.get(f"{s.url}/health").json()["concurrency"] == 1  # a device: one at a time
            turns = _three_turns(s.client, picture)  # a conversation: the answers of the reference's
            assert [t[0] for t in turns] == ["A red circle on a blue background.", "Red.", "A circle."]
            # the emulator's parts engine keeps its KV buffers, Genie's pipeline (the bundle) its KV cache
            # 67: the request before was the same turn; a bundle's Genie holds that turn's answer too, and starts again
            assert [t[2] for t in turns] == ([67, 87, 118] if pipe is npu else [0, 87, 118])
        finally:
            s.stop()


def test_partial_selection_samples_the_same_tokens_for_the_same_seeds():
    from vlmrun.sampling import SamplingSettings, sample, sample_sorted

    r = np.random.default_rng(0)
    V = 151936
    n = 0
    for trial in range(12):
        logits = (r.standard_normal(V) * r.choice([0.5, 2, 6])).astype(np.float32)
        logits[r.integers(0, V, 4)] += r.choice([0, 8, 20])
        logits[r.integers(0, V, 50)] = logits.max()  # ties at the top: the stable order decides
        for st in (SamplingSettings(0.7, 0, 1.0), SamplingSettings(1.0, 40, 0.9), SamplingSettings(0.8, 0, 0.9),
                   SamplingSettings(1.5, 0, 1.0), SamplingSettings(1.0, 50, 1.0), SamplingSettings(2.0, 0, 0.5)):
            for seed in range(4):
                assert sample(logits, st, np.random.default_rng(seed)) == sample_sorted(
                    logits, st, np.random.default_rng(seed))
                n += 1
    assert n == 288


def test_a_conversation_reaches_the_model_whole(ref_server, ref_pipe, picture):
    """Every turn goes into the prompt, the assistant's included, and the picture in the turn where it appears
    (the answers are what the Python API gives for the same conversation; a second turn once lost its history)."""
    first = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(picture)}},
                                         {"type": "text", "text": "Describe the image."}]}
    cases = [
        [first, {"role": "assistant", "content": "A red circle on a blue background."},
         {"role": "user", "content": "How many shapes are there?"}],
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello."},
         {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": [{"type": "text", "text": "What shape is in the image?"},
                                      {"type": "image_url", "image_url": {"url": data_uri(picture)}}]}],
    ]
    for conversation in cases:
        turns = []
        for m in conversation:
            parts = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            turns.append({"role": m["role"], "content": sorted(
                [{"type": "image"} if p["type"] == "image_url" else p for p in parts],
                key=lambda t: t["type"] != "image")})
        prepared = ref_pipe.prepare_messages(picture, turns)
        assert prepared.prompt_text.count("<|im_start|>") == len(conversation) + 1 + (
            conversation[0]["role"] != "system")  # every turn, the default system turn, the generation prompt
        want = ref_pipe.generate_prepared(prepared, GenerationSettings(max_new_tokens=32)).run()
        r = ref_server.client.chat.completions.create(model="fastvlm-shapes-tiny", messages=conversation,
                                                      max_tokens=32)
        assert r.choices[0].message.content == want.text
        assert r.usage.prompt_tokens == prepared.input_ids.shape[1]
    assert r.choices[0].message.content == "A circle."  # the picture in the second user turn
    bad = [first, {"role": "assistant", "content": "A red circle."}]
    with pytest.raises(openai.BadRequestError, match="the last message must be the user's"):
        ref_server.client.chat.completions.create(model="fastvlm-shapes-tiny", messages=bad, max_tokens=8)


def _turn(client, conversation, max_tokens=32):
    r = client.chat.completions.create(model="fastvlm-shapes-tiny", messages=conversation, max_tokens=max_tokens)
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens, \
        r.model_extra["vlmrun"]["timings"]["prefill_tokens"]


def _three_turns(client, picture, interleave=None):
    """A three-turn conversation through the openai client (``interleave``: called between turns)."""
    conv = messages(data_uri(picture))
    out = []
    for q in ("What color is the shape?", "What shape is it?", None):
        text, prompt, cached, prefill = _turn(client, conv)
        out.append((text, prompt, cached, prefill))
        if q is None:
            break
        if interleave is not None:
            interleave()
        conv = conv + [{"role": "assistant", "content": text}, {"role": "user", "content": q}]
    return out


def _scratch(pipe, picture):
    chat = pipe.chat(settings=GenerationSettings(max_new_tokens=32), keep_state=False)
    return [chat.ask(q, image=picture if i == 0 else None).run().text
            for i, q in enumerate(("Describe the image.", "What color is the shape?", "What shape is it?"))]


def test_a_conversation_continues_from_its_kept_state_and_never_shares_it(ref_pipe, picture):
    import random

    from vlmrun.shapes import random_scene

    other = random_scene(random.Random(7), n_shapes=1).render()
    s = Server(ref_pipe)
    try:
        solo_other = _three_turns(s.client, other)
        turns = _three_turns(s.client, picture, interleave=lambda: _turn(s.client, messages(data_uri(other))))
        assert [t[0] for t in turns] == _scratch(ref_pipe, picture)
        assert turns[0][0] == "A red circle on a blue background."
        # turn 1: everything prefilled; turn 2: the kept 87 positions (prompt 68 + 19 of the answer's 20 tokens)
        assert [(t[2], t[3]) for t in turns] == [(0, 68), (87, 27), (118, 24)]
        assert all(prompt == cached + prefill for _, prompt, cached, prefill in turns)
        assert [t[0] for t in solo_other] == _scratch(ref_pipe, other)
        # a history that diverges (the client edited the first answer): it extends a prompt this conversation
        # answered (turn 1's), so its state is taken and kept up to the divergence; the answer of a fresh computation
        conv = messages(data_uri(picture)) + [{"role": "assistant", "content": "A red circle."},
                                              {"role": "user", "content": "What color is the shape?"}]
        text, prompt, cached, prefill = _turn(s.client, conv)
        chat = ref_pipe.chat(settings=GenerationSettings(max_new_tokens=32), keep_state=False)
        chat.messages = [{"role": "user", "content": [{"type": "image", "picture": 0},
                                                      {"type": "text", "text": "Describe the image."}]},
                         {"role": "assistant", "content": "A red circle."}]
        from vlmrun.conversation import Picture

        chat.pictures = [Picture.of(picture, ref_pipe.model.image_processor_config)]
        assert text == chat.ask("What color is the shape?").run().text
        assert 68 < cached < 87 and prompt == cached + prefill
        # bounded: --max-conversations 0 keeps none
        s0 = Server(ref_pipe, max_conversations=0)
        try:
            assert [t[2] for t in _three_turns(s0.client, picture)] == [0, 0, 0]
        finally:
            s0.stop()
    finally:
        s.stop()


def test_a_port_in_use_is_one_line_and_nothing_says_serving(cache_dir, ref_pipe):
    from conftest import run_cli

    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        r = run_cli(["serve", "--port", str(port)], cache_dir, timeout=300)
    finally:
        taken.close()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "serving" not in r.stderr  # it said "serving ... on" before it tried to listen
