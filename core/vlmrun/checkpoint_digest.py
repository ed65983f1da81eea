"""What a checkpoint conversion depends on, hashed: the artifact store's key for a converted checkpoint.

`conversion_inputs` lists every file that shapes a conversion (weights, config, generation config, tokenizer
files, chat template, processor config); `conversion_digest` hashes their names and contents, reusing the hash of
a large weight file while it is unchanged (`FILE_HASHES` in the store's root).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re

from . import store
from .checkpoint_formats import EXTRA_ROWS_FILE, weight_files

__all__ = ["FILE_HASHES", "conversion_inputs", "conversion_digest"]

#: Suffixes of the configuration and tokenizer files a conversion reads (config.json, generation_config.json,
#: preprocessor_config.json, tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, added_tokens.json,
#: special_tokens_map.json, chat_template.jinja / .json, ...).
_INPUT_SUFFIXES = frozenset({".json", ".txt", ".jinja", ".model", ".tiktoken"})
#: Files that describe the checkpoint to people, not to the conversion.
_NOT_INPUTS = re.compile(r"(readme|licen[cs]e|notice|copying|citation)([._-].*)?", re.IGNORECASE)
#: Per-file hash cache in the artifact store's root (for weight files over the store's full-hash limit).
FILE_HASHES = "file-hashes.json"


def conversion_inputs(model_dir: str | os.PathLike) -> list[pathlib.Path]:
    """Every file of a checkpoint directory that shapes its conversion, sorted by name.

    The weights the conversion reads (the shards ``model.safetensors.index.json`` names, else every
    ``*.safetensors``, plus `EXTRA_ROWS_FILE`) and every configuration, tokenizer, chat-template and
    processor file (``*.json``, ``*.txt``, ``*.jinja``, ...), whatever its name, so that a tokenizer stored as
    vocab.json + merges.txt + added_tokens.json counts as much as a tokenizer.json. READMEs, licences and hidden
    files do not count. A shard the index lists but the directory lacks raises `InputError` naming it.
    """
    path = pathlib.Path(model_dir).expanduser()
    files = {p.name: p for p in weight_files(path)}
    for p in path.iterdir():
        if p.name.startswith(".") or _NOT_INPUTS.fullmatch(p.name):
            continue
        if (p.suffix.lower() in _INPUT_SUFFIXES or p.name == EXTRA_ROWS_FILE) and p.is_file():
            files[p.name] = p
    return [files[name] for name in sorted(files)]


def conversion_digest(model_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """sha256 (16 hex digits) over the names and contents of `conversion_inputs`: the conversion's key.

    Files up to the store's full-hash limit (every tokenizer and config file) are hashed on every call; a larger
    weight file's hash is kept in ``cache_dir/```FILE_HASHES` and reused while its size, mtime, ctime and
    inode are unchanged (as the store does for its own multi-GB files).
    """
    cache_file = pathlib.Path(cache_dir) / FILE_HASHES if cache_dir is not None else None
    cache: dict = {}
    if cache_file is not None and cache_file.is_file():
        try:
            cache = json.loads(cache_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cache = {}
        if not isinstance(cache, dict):
            cache = {}
    changed = False
    h = hashlib.sha256()
    for file in conversion_inputs(model_dir):
        st = file.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        where = str(file.resolve())
        entry = cache.get(where) if st.st_size > store.FULL_HASH_LIMIT else None
        if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
            digest = entry["sha256"]
        else:
            digest = store.sha256_file(file)
            if st.st_size > store.FULL_HASH_LIMIT:
                cache[where] = {"stamp": stamp, "sha256": digest}
                changed = True
        h.update(f"{file.name}\0{digest}\n".encode())
    if changed and cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        part = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        part.write_text(json.dumps(cache), encoding="utf-8")
        os.replace(part, cache_file)
    return h.hexdigest()[:16]
