"""The stage boundaries of the torch model (transformers ``FastVlmForConditionalGeneration``), defined once.

``fvlm`` below is that model (`vlmrun.model.FastVLMModel.load_torch`). The functions compute one stage
eagerly (``vlmrun diff``'s torch side, calibration, tests); the modules wrap the same computation for the ONNX
exporter, one stage per graph::

    vision     pixel_values [1,3,S,S] -> image_features [1,N,F]   vision_features / VisionStage
    projector  image_features [1,N,F] -> image_embeds [1,N,H]     project / ProjectorStage
    embed      input_ids int64 [1,T]  -> inputs_embeds [1,T,H]    embed_tokens / EmbedStage

This module imports torch: only export, the torch diff side and calibration import it, never the core's
start-up path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _tower_features(tower, pixel_values):
    """The vision tower's last hidden state [1,F,h,w] as a token sequence [1,N=h*w,F]."""
    return tower(pixel_values, return_dict=True).last_hidden_state.flatten(2).transpose(1, 2)


def vision_features(fvlm, pixel_values: torch.Tensor) -> torch.Tensor:
    """vision: pixel_values [1,3,S,S] -> image_features [1,N,F]."""
    return _tower_features(fvlm.model.vision_tower, pixel_values)


def project(fvlm, features: torch.Tensor) -> torch.Tensor:
    """projector: image_features [1,N,F] -> image_embeds [1,N,H]."""
    return fvlm.model.multi_modal_projector(features)


def embed_tokens(fvlm, input_ids: torch.Tensor) -> torch.Tensor:
    """embed: token ids int64 [1,T] -> their embeddings [1,T,H]."""
    return F.embedding(input_ids, fvlm.get_input_embeddings().weight)


class VisionStage(nn.Module):
    """`vision_features` as a module over the tower alone."""

    def __init__(self, fvlm):
        super().__init__()
        self.tower = fvlm.model.vision_tower

    def forward(self, pixel_values):
        return _tower_features(self.tower, pixel_values)


class ProjectorStage(nn.Module):
    """`project` as a module."""

    def __init__(self, fvlm):
        super().__init__()
        self.proj = fvlm.model.multi_modal_projector

    def forward(self, image_features):
        return self.proj(image_features)


class EmbedStage(nn.Module):
    """`embed_tokens` as a module holding only the embedding table."""

    def __init__(self, fvlm):
        super().__init__()
        self.weight = fvlm.get_input_embeddings().weight

    def forward(self, input_ids):
        return F.embedding(input_ids, self.weight)
