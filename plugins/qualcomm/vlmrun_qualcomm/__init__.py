"""What vlmrun's Qualcomm plugins (`qnn_htp`, `genie_cpu`, `qaihub`) share. A library, not a plugin: it has
no `vlmrun` entry point and the core never imports it.

- `socs`: the one SoC table (QNN soc_model, HTP arch, AI Hub device)
- `sdk`: QAIRT SDK discovery (root, tools, libraries) with one-line errors
- `adb`: the adb transport (argument lists, shlex-quoted remote lines, timeouts)
- `genie`: what every way of running Genie shares (embeddings/LUT files, profile, context limit, errors)
- `genie_config`: Genie dialog configs from the model's own config and vlmrun's sampling settings
- `genie_binding`: the ctypes binding of `libGenie.so` (dialogs, profiles, status codes)
- `genie_t2t`: the SDK's `genie-t2t-run` (command line, output, errors)
- `genie_worker`: libGenie in a worker process (`python -m vlmrun_qualcomm.genie_worker`), tokens on a pipe
- `genie_session`, `genie_pipeline`, `genie_sampler`, `genie_accuracy`: a dialog kept between turns, Genie's
  pipeline API, its custom sampler (per-step logits), perplexity through genie-app
- `parts`: the decoder's parts form (how a decoder is split into part binaries)
- `manifest`: the QNN context-binary artifact: EP-context wrapper and `ContextManifest`
"""

__version__ = "0.1.0"
