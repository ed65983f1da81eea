"""The names of probe points in the exported graphs: each stage's final layer, the graph output of a probe and the
input an ``inject`` form adds to it (what `.probes` exports and the exporters name)."""

from __future__ import annotations

#: the probe name of each stage's last layer, whose output is the stage's own output
FINAL = {"vision": ("vision.final_conv", "image_features"), "projector": ("projector.linear_2", "image_embeds"),
         "decoder": ("decoder.lm_head", "logits")}
STAGES = tuple(FINAL)


def graph_output(name: str) -> str:
    """The graph output name of probe ``name`` (``vision.stage0`` -> ``probe_vision_stage0``)."""
    return "probe_" + "".join(c if c.isalnum() else "_" for c in name)


def inject_input(name: str) -> str:
    """The graph input that is added to probe ``name``'s tensor in an ``inject`` form."""
    return "inject_" + graph_output(name)[len("probe_"):]


def decoder_probe_outputs(num_layers: int) -> list[tuple[str, str]]:
    """The decoder's extra outputs (after every layer, the final norm) as (probe name, graph output) pairs."""
    names = [f"decoder.layer{i}" for i in range(num_layers)] + ["decoder.norm"]
    return [(n, graph_output(n)) for n in names]
