"""The tiny FastVLM's tokenizer: a byte-level BPE trained here on a small embedded corpus with exactly
Qwen2Tokenizer's pipeline, then Qwen2's special tokens and the ``<image>`` placeholder appended (`vlmrun.tiny`
builds the model around it).

Deterministic: the same vocabulary and merges on every run. ``tokenizers`` and ``transformers`` are imported inside
the functions only: `vlmrun.tiny` imports this module, and the CLI imports that one at start-up.
"""

from __future__ import annotations

import json

from vlmrun.fastvlm_files import CHAT_TEMPLATE, IMAGE_TOKEN

#: Qwen2 special tokens in Qwen's order (appended after the BPE vocabulary, like ids 151643.. of the real model),
#: plus the ``<image>`` placeholder the native conversion adds.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_TOKEN)

# Qwen2's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX). The tokenizer is
# trained with exactly Qwen2Tokenizer's pipeline because Qwen2Tokenizer rebuilds that pipeline on load and only
# takes the vocabulary and merges from tokenizer.json.
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: BPE vocabulary size before the special tokens are appended (256 byte symbols + merges).
_BPE_VOCAB_SIZE = 400

_CORPUS = """\
A photo of a cat sitting on a red chair next to the window.
The image shows a small dog running across a green field on a sunny day.
There are two people walking along the beach while the sun sets behind the clouds.
Describe the image in one sentence. What is the man holding in his left hand?
The picture shows a busy street in a city, with cars, buses, bicycles and tall buildings.
A bowl of fresh fruit stands on the kitchen table: apples, oranges, bananas and grapes.
How many birds are sitting on the wire? There are three birds sitting on the wire.
The woman in the blue dress is reading a book under a large tree in the park.
Is there a stop sign in this picture? Yes, there is a stop sign at the corner of the road.
The train is waiting at the station and a few passengers are getting on board.
What color is the car? The car is white, and it is parked in front of a brown house.
A group of children are playing football in the school yard after the rain.
This is a chart that shows the number of visitors for each month of the year.
The text on the sign says that the shop opens at nine in the morning and closes at six.
A mountain lake reflects the snow on the peaks and the dark green forest around it.
The plate holds a sandwich, some chips and a glass of orange juice.
You are a helpful assistant. Answer the question about the image briefly and clearly.
Please read the text in the image and tell me what it says.
The kitchen is clean and bright, with white walls and a wooden floor.
An old man is sitting on a bench and feeding the pigeons in the square.
The boat is sailing on the calm water near the harbour, and the sky is blue.
Two cats are sleeping on the sofa, and a lamp is standing on the table beside them.
What is written on the board? The board shows the menu of the day and the prices.
The phone on the desk shows the time, the date and the weather for today.
The horse is standing in the field next to a wooden fence and a small barn.
In the background there is a bridge over the river and a castle on the hill.
The screen shows a document with a title, three paragraphs and a table of numbers.
She is wearing a yellow jacket and holding an umbrella because it is raining.
The room has a bed, a desk with a computer, a chair and a shelf full of books.
The answer is yes. The answer is no. There is one. There are many of them.
"""


def _train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train the byte-level BPE on the embedded corpus with exactly Qwen2Tokenizer's pipeline. Deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def make_tokenizer():
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_bpe()
    n = len(vocab)
    if sorted(vocab.values()) != list(range(n)):
        raise AssertionError("BPE vocabulary ids are not contiguous")
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = n + i
    endoftext, im_start, im_end, image = SPECIAL_TOKENS
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=endoftext,
        eos_token=im_end,
        pad_token=endoftext,
        model_max_length=32768,
        errors="replace",
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in (im_start, image)]}
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if ids != [n + i for i in range(len(SPECIAL_TOKENS))] or len(tokenizer) != n + len(SPECIAL_TOKENS):
        raise AssertionError(f"unexpected special token ids {ids} (vocabulary {n}, tokenizer {len(tokenizer)})")
    return tokenizer
