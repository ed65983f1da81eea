"""The precisions Qualcomm's toolchains build at (QNN HTP, AI Hub), with the default thresholds ``vlmrun diff`` and
``vlmrun eval`` judge a device at each by; qnn_htp and qaihub both declare them (``register_precisions``).

* ``fp16`` / ``int8``: typical whole-network accuracy of NPU builds; free-running tokens may legitimately diverge
  there, so generation is reported but not checked. ``a16w8`` (and ``a8w8``) is judged like ``int8``: the fixed
  form's a16w8 has measured int8 figures.
* ``w8a16`` / ``w4a16``: the decoder's parts form at 16-bit activations with int8 / int4 weights, measured with

      vlmrun eval -L 'w4a16=all-npu,decoder.decoder_form=parts,decoder.precision=w4a16' \\
                  -L 'w8a16=all-npu,decoder.decoder_form=parts,decoder.precision=w8a16' --limit 20

  on the default model (vision, projector, embed at fp16; 20 held-out items, every answer as the reference's).
  decoder/logits over the items, min / median / max:

      w8a16: SQNR 16.0 / 23.9 / 39.0 dB, cosine 0.9931 / 0.9989, top-1 1.0, top-5 0.92 / 0.966, KL max 9e-5
      w4a16: SQNR 16.2 / 21.8 / 25.5 dB, cosine 0.9925 / 0.9972, top-1 1.0, top-5 0.76 / 0.92, KL max 3.9e-4

  (short answers make the per-item SQNR spread: "One." items are the 16 dB ones in both). Each threshold sits
  below the worst passing item, and 10x the noise power (10 dB less) fails the median item: w8a16 23.9 -> 13.9 < 15,
  w4a16 21.8 -> 11.8 < 14; with only the decoder on the device (vision in fp32) a w4a16 describe item gives
  23.75 dB, 13.75 with 10x its noise power: fails (tests/test_quantized_thresholds.py, on real captures). The
  per-item floor of an all-npu layout is set upstream (fp16 vision: the w8a16 decoder alone is 36 dB). The default
  model retrained for conversations (November 26) is cleaner, the same eval: w8a16 30.4 dB median, 26.1 worst;
  w4a16 26.1 / 20.0: the floors are kept (a w4a16 decoder behind int8 vision is judged by them too).
"""

from __future__ import annotations

from vlmrun.plugins import Precision

PRECISIONS = (
    Precision("fp16", sqnr_db=30.0, cosine=0.999, top1=0.9, top5=0.8, kl=0.05,
              summary="float16 on the NPU"),
    Precision("int8", sqnr_db=15.0, cosine=0.97, top1=0.6, top5=0.6, kl=0.5,
              summary="8-bit activations and weights"),
    Precision("a16w8", like="int8", summary="16-bit activations, 8-bit weights"),
    Precision("a8w8", like="int8", summary="8-bit activations and weights, spelt as AI Hub does"),
    Precision("w8a16", sqnr_db=15.0, cosine=0.98, top1=0.6, top5=0.8, kl=0.005,
              summary="the decoder's parts: 8-bit weights, 16-bit activations"),
    Precision("w4a16", sqnr_db=14.0, cosine=0.97, top1=0.6, top5=0.6, kl=0.01,
              summary="the decoder's parts: 4-bit weights, 16-bit activations"),
)


def register(register_one) -> None:
    """Declare every precision above (a plugin's ``register_precisions``)."""
    for p in PRECISIONS:
        register_one(p)
