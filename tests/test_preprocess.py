"""Host-side preprocessing equals transformers' own processor (pad to square first, as Apple does)."""

from __future__ import annotations

import numpy as np
from PIL import Image

from vlmrun.preprocess import pad_to_square, preprocess_image, render_prompt, tokenize_prompt


def test_pixels_match_transformers_clip_processor(tiny_model, image_path):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    cfg = tiny_model.image_processor_config
    hf = CLIPImageProcessorPil(**{k: v for k, v in cfg.items() if not k.startswith("_") and k != "image_processor_type"})
    image = Image.open(image_path).convert("RGB")
    assert image.size[0] != image.size[1]
    ours = preprocess_image(image, cfg)
    theirs = hf(images=pad_to_square(image, (0, 0, 0)), return_tensors="np")["pixel_values"]
    assert ours.shape == theirs.shape == (1, 3, 256, 256)
    assert np.abs(ours - theirs).max() < 1e-6
    # black bars above and below the 4:3 picture after padding
    assert np.abs(ours[0, :, :10, :]).max() == 0 and np.abs(ours[0, :, 128, :]).max() > 0


def test_prompt_ids_match_transformers_processor(tiny_model):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model.path)
    text = render_prompt(tiny_model.chat_template, "Describe the image.")
    expected = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}],
        add_generation_prompt=True, tokenize=False,
    )
    assert text == expected
    ids, start = tokenize_prompt(tiny_model.tokenizer, text, tiny_model.image_token_id, tiny_model.image_tokens)
    hf_ids = proc(text=text, images=Image.new("RGB", (256, 256)), return_tensors="np")["input_ids"]
    assert ids.tolist() == hf_ids.tolist()
    assert int((ids == tiny_model.image_token_id).sum()) == 16 and ids[0, start] == tiny_model.image_token_id
