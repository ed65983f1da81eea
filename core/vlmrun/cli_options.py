"""Command-line options shared by the ``vlmrun`` subcommands."""

from __future__ import annotations

from pathlib import Path

import click


def model_options(f):
    """``--model``, ``--image-size`` and ``--cache-dir``: which checkpoint, and where artifacts live."""
    f = click.option("--cache-dir", type=click.Path(path_type=Path), envvar="VLMRUN_CACHE_DIR",
                     help="Artifact store location. [env: VLMRUN_CACHE_DIR; default ~/.cache/vlmrun]")(f)
    f = click.option("--image-size", type=int, default=1024, show_default=True,
                     help="Image size of the tiny default model (ignored with --model).")(f)
    f = click.option("--model", "model_dir", type=click.Path(path_type=Path),
                     help="FastVLM checkpoint directory (transformers-native or Apple llava_qwen2 layout)."
                          " Default: the tiny model vlmrun builds itself.")(f)
    return f
