"""vlmrun: run FastVLM stage by stage on pluggable backends.

The public API (see :mod:`vlmrun.pipeline` for examples)::

    Pipeline.build(model=None, layout="reference", overrides={"vision": "qnn_htp"}) -> Pipeline
    Pipeline.generate(image, prompt, GenerationSettings(...)) -> Generation (iterate for streamed text)
    Pipeline.run_stage(stage, inputs) / Pipeline.capture(image, prompt)
    hookimpl: the decorator plugins use (the hooks are documented in vlmrun.hookspecs)
"""

from .hookspecs import hookimpl
from .pipeline import GenerationSettings, Generation, Pipeline
from .sampling import SamplingSettings
from .errors import VlmrunError

__version__ = "0.1.0"
__all__ = ["Pipeline", "Generation", "GenerationSettings", "SamplingSettings", "VlmrunError", "hookimpl"]
