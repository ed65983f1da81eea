"""What a native FastVLM checkpoint holds besides its weights: the chat template, the processor and the config.

Shared by the tiny-model builder (`vlmrun.tiny`) and the conversion of Apple's checkpoints
(`vlmrun.checkpoint_convert`, `vlmrun.checkpoint_to_apple`), so that both write the same files:

* `CHAT_TEMPLATE`: the project's rendering of Apple's ``qwen_2`` conversation template, with `SYSTEM_PROMPT` as
  the default system message and `IMAGE_TOKEN` for each image item;
* `fastvlm_image_processor` / `fastvlm_processor`: ``CLIPImageProcessor`` (bicubic, x/255, mean 0, std 1) inside
  a ``LlavaProcessor`` with patch size `PATCH_SIZE`;
* `fastvlm_config`: the native ``FastVlmConfig`` as the real FastVLM sets it.

transformers is imported inside the functions only: `vlmrun.tiny` imports this module at start-up.
"""

from __future__ import annotations

__all__ = [
    "PATCH_SIZE",
    "IMAGE_TOKEN",
    "SYSTEM_PROMPT",
    "CHAT_TEMPLATE",
    "fastvlm_image_processor",
    "fastvlm_processor",
    "fastvlm_config",
]

#: FastViTHD's total stride: one image token per 64 x 64 pixels.
PATCH_SIZE = 64

#: The native image placeholder: the processor repeats it ``image_seq_length`` times.
IMAGE_TOKEN = "<image>"

SYSTEM_PROMPT = "You are a helpful assistant."

#: Renders Apple's ``qwen_2`` conversation template. Image items become ``<image>\n``; a leading system message
#: replaces the default one.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for item in content -%}"
    "{%- if item['type'] == 'image' -%}{{- '<image>\\n' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_content = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_content = '" + SYSTEM_PROMPT + "' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' -}}{{- render(system_content) -}}{{- '<|im_end|>\\n' -}}"
    "{%- for message in loop_messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}{{- render(message['content']) -}}{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def fastvlm_image_processor(image_size: int):
    """FastVLM's image processor: CLIP's, at ``image_size``, bicubic, x/255, mean 0, std 1."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        do_resize=True,
        size={"shortest_edge": image_size},
        resample=3,
        do_center_crop=True,
        crop_size={"height": image_size, "width": image_size},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.0, 0.0, 0.0],
        image_std=[1.0, 1.0, 1.0],
        do_convert_rgb=True,
    )


def fastvlm_processor(tokenizer, image_size: int):
    """The native checkpoint's ``LlavaProcessor``: the image processor, patch size 64, the chat template."""
    from transformers import LlavaProcessor

    return LlavaProcessor(
        image_processor=fastvlm_image_processor(image_size),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="full",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=0,
    )


def fastvlm_config(vision_config, text_config, image_token_id: int, image_size: int, tie: bool):
    """The native ``FastVlmConfig`` as the real FastVLM sets it (GELU projector with bias, full features,
    last layer), shared by the tiny builder and the conversion of Apple's format."""
    from transformers import FastVlmConfig

    return FastVlmConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=image_token_id,
        image_seq_length=(image_size // PATCH_SIZE) ** 2,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        multimodal_projector_bias=True,
        tie_word_embeddings=tie,
    )
