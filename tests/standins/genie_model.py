"""What the Genie stand-ins (genie-t2t-run, genie-app's dialogs) generate when $STANDIN_GENIE_TEXT is "@model" (tests
only): greedy tokens that follow from every row the dialog holds, like a real decoder. The rows (float32, rounded to
1e-3) are hashed; the hash picks 2 to 4 words of the tokenizer's vocabulary (" word" tokens), each one token. So a
dialog continued from a saved state answers as the same sequence fed from scratch, and a state that lost or gained a
row answers otherwise. Generated tokens are fed back through the token table (their rows join what the dialog
holds), but the last one at the budget; the end token after the words is sampled, not fed, and not printed."""
import hashlib
import json
import re
import struct

MODEL = "@model"


def vocabulary(tokenizer_path):
    """(id, text) of the tokenizer's one-token words with a leading space, by id."""
    vocab = json.load(open(tokenizer_path))["model"]["vocab"]
    return sorted((i, " " + t[1:]) for t, i in vocab.items() if re.fullmatch(r"\u0120[a-z]{3,}", t))


def rows_of(raw):
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def answer(values, vocab, max_tokens):
    """(the tokens generated after ``values``, whether an end token stopped them before ``max_tokens``)."""
    h = hashlib.sha256(",".join(str(round(v * 1000)) for v in values).encode()).digest()
    n = 2 + h[0] % 3
    tokens = [vocab[int.from_bytes(h[1 + 2 * k: 3 + 2 * k], "big") % len(vocab)] for k in range(n)]
    return (tokens, True) if n < max_tokens else (tokens[:max_tokens], False)


def lut_row(lut_path, token, hidden):
    with open(lut_path, "rb") as f:
        f.seek(token * hidden * 4)
        raw = f.read(hidden * 4)
    return rows_of(raw) if len(raw) == hidden * 4 else None
