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


def test_a_whole_conversation_renders_as_transformers_renders_it(tiny_model):
    """Every turn, the assistant's included, and the picture in the turn where it appears (here the second user
    turn): the chat template as transformers' processor applies it; one picture per conversation."""
    import pytest
    from transformers import AutoProcessor

    from vlmrun.errors import InputError
    from vlmrun.preprocess import render_messages

    proc = AutoProcessor.from_pretrained(tiny_model.path)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]},
        {"role": "assistant", "content": "A red circle on a blue background."},
        {"role": "user", "content": [{"type": "text", "text": "What color is the shape?"}]},
    ]
    text = render_messages(tiny_model.chat_template, messages)
    assert text == proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant\nA red circle on a blue background.<|im_end|>" in text
    assert text.index("<image>") > text.index("<|im_start|>user\nHello.")
    ids, start = tokenize_prompt(tiny_model.tokenizer, text, tiny_model.image_token_id, tiny_model.image_tokens)
    hf_ids = proc(text=text, images=Image.new("RGB", (256, 256)), return_tensors="np")["input_ids"]
    assert ids.tolist() == hf_ids.tolist()
    for bad, why in ((messages[:3], "hold 0"), (messages + [messages[3]], "hold 2"),
                     ([{"role": "tool", "content": "x"}], "role 'tool'")):
        with pytest.raises(InputError, match=why):
            render_messages(tiny_model.chat_template, bad)


def test_a_16_bit_or_float_picture_is_rescaled_not_clipped_to_white(tmp_path):
    """Pillow's convert("RGB") clips I;16, I and F pictures to 0..255: a mid-grey 16-bit PNG turned white and got a
    confident answer about a white picture."""
    import pytest

    from vlmrun.errors import InputError
    from vlmrun.preprocess import load_image

    grey16 = tmp_path / "grey16.png"
    Image.fromarray(np.full((4, 4), 32768, np.uint16)).save(grey16)
    assert Image.open(grey16).mode == "I;16"
    assert np.asarray(load_image(grey16)).tolist() == [[[128] * 3] * 4] * 4
    half = tmp_path / "half.tiff"
    Image.fromarray(np.full((4, 4), 0.25, np.float32)).save(half)
    assert np.asarray(load_image(half))[0, 0].tolist() == [64, 64, 64]
    wild = tmp_path / "wild.tiff"
    Image.fromarray(np.full((4, 4), 1e6, np.float32)).save(wild)
    with pytest.raises(InputError, match=r"is a F picture with values outside 0\.\.255"):
        load_image(wild)
    rgb = tmp_path / "rgb.png"  # an 8-bit picture is as it was
    Image.fromarray(np.full((4, 4, 3), 200, np.uint8)).save(rgb)
    assert np.asarray(load_image(rgb))[0, 0].tolist() == [200, 200, 200]
