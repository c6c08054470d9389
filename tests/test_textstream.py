"""Incremental detokenization gives the same text as decoding everything at once."""

from __future__ import annotations

from leapdecode.textstream import TextStream


def test_deltas_add_up_to_the_full_decode(real_lm) -> None:
    tok = real_lm.tokenizer
    text = "Héllo wörld — naïve café 🙂 done.\n    def f(x):\n        return x  # ünïcode"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for chunk in (1, 2, 3, 7):
        stream = TextStream(tok)
        out = "".join(stream.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)) + stream.flush()
        assert out == tok.decode(ids, skip_special_tokens=True)
