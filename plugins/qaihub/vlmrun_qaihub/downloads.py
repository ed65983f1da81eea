"""What comes back from the hub into an artifact: a compiled model downloaded so it cannot escape its directory,
and a compiled model's inputs and outputs as manifest entries."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from vlmrun.errors import BackendError

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(name: str, default: str = "download") -> str:
    """A server-given file name reduced to a plain file name (no directories, no ``..``)."""
    base = os.path.basename(str(name).replace("\\", "/"))
    base = _SAFE_NAME.sub("_", base).lstrip(".")
    return base or default


def download_model_into(hub, model, out_dir: Path, final_name: str) -> tuple[Path, str]:
    """Download ``model`` into ``out_dir/final_name`` whatever name the server gives the file.

    The client is handed a *file* path inside a private directory (never a directory: the client would join
    the server's file name onto it), and the result must resolve inside that directory.
    :return: (path, the name the client gave the file (with the server's extension), sanitized)
    """
    out_dir = Path(out_dir)
    private = Path(tempfile.mkdtemp(prefix=".hub-dl-", dir=out_dir))
    try:
        target = private / "model"
        got = hub.call(f"download of model {model.model_id}", model.download, str(target))
        got_path = Path(str(got)).resolve()
        if got_path.parent != private.resolve() or not got_path.is_file():
            raise BackendError(f"AI Hub download of model {model.model_id} wrote outside its directory ({got_path.name});"
                               " refusing it")
        if got_path.stat().st_size == 0:
            raise BackendError(f"AI Hub returned an empty file for model {model.model_id}")
        final = out_dir / final_name
        os.replace(got_path, final)
        return final, safe_name(got_path.name)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def spec_entry(tensor) -> dict:
    """One tensor of a client IOSpec (a qai_hub TensorSpec) as a manifest I/O entry: name, shape, dtype and, when
    quantized, its scale and offset."""
    e = {"name": tensor.name, "shape": list(tensor.shape or []), "dtype": tensor.dtype}
    if tensor.scale is not None:
        e["quant"] = {"scale": tensor.scale, "offset": tensor.zero_point}
    return e
