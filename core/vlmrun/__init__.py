"""vlmrun: run FastVLM stage by stage on pluggable backends.

The public API (see `vlmrun.pipeline` for examples)::

    Pipeline.build(model=None, layout="reference", overrides={"vision": "acme_npu"}) -> Pipeline
    Pipeline.generate(image, prompt, GenerationSettings(...)) -> Generation (iterate for streamed text)
    Pipeline.run_stage(stage, inputs) / Pipeline.capture(image, prompt)
    hookimpl: the decorator plugins use (the hooks are documented in vlmrun.hookspecs); BackendInfo, Option,
    StageHandle / DecoderHandle, ExportForm, mine: what a backend plugin needs (see the README's plugin guide)
"""

from .errors import BackendError, UsageError, VlmrunError
from .handles import DecoderHandle, StageHandle
from .hookspecs import hookimpl
from .options import Option
from .pipeline import Generation, GenerationSettings, Pipeline
from .plugins import BackendInfo, Check, mine
from .sampling import SamplingSettings
from .stages import ExportForm

__version__ = "0.1.0"
__all__ = [
    # running FastVLM
    "Pipeline", "Generation", "GenerationSettings", "SamplingSettings",
    # writing a backend plugin
    "hookimpl", "BackendInfo", "Check", "mine", "Option", "StageHandle", "DecoderHandle", "ExportForm",
    # errors
    "VlmrunError", "UsageError", "BackendError",
]
