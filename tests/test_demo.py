"""`vlmrun demo` (the README's first command) exports, answers correctly; a second run reuses everything."""

from __future__ import annotations

import json

from conftest import run_cli


def snapshot(root):
    return {p.name: p.stat().st_mtime_ns for p in (root / "artifacts").iterdir()}


def test_demo_runs_then_reuses_exports(tmp_path):
    from vlmrun.demo_image import DEMO_ANSWER

    first = run_cli(["demo", "--max-new-tokens", "24"], tmp_path)
    assert first.returncode == 0, first.stderr
    assert "building" not in first.stderr  # the default model is shipped trained, not built
    for stage in ("vision", "projector", "embed", "decoder"):
        assert f"exporting {stage}" in first.stderr
    assert "prefill/TTFT" in first.stderr and "tokens/s" in first.stderr and "vision" in first.stderr
    assert first.stdout.strip() == DEMO_ANSWER, "the demo streams the (correct) answer to stdout"
    before = snapshot(tmp_path)
    assert len(before) == 5  # 4 stage exports, the embedding LUT

    second = run_cli(["demo", "--max-new-tokens", "24", "--json"], tmp_path)
    assert second.returncode == 0, second.stderr
    assert "exporting" not in second.stderr and "building" not in second.stderr
    assert snapshot(tmp_path) == before
    out = json.loads(second.stdout)
    assert out["text"] == first.stdout.rstrip("\n")
    assert set(out["timings"]) >= {"vision_ms", "projector_ms", "embed_ms", "ttft_ms", "new_tokens"}

    rebuilt = run_cli(["export", "--rebuild", "--stage", "projector"], tmp_path)
    assert rebuilt.returncode == 0 and "exporting projector" in rebuilt.stderr
    assert "exporting vision" not in rebuilt.stderr
