"""The semantic planning detector: a clause is planning when a sentence encoder places it near a strategic gram.

The regex detector finds the grams' own words; this one also finds what says the same in other words
("I should verify this result" for "let me verify"). Each completion is cut into clauses at sentence
punctuation, commas and line breaks; every clause and every gram is embedded by a sentence-transformers
model (`algorithm.planning.model`, a Hub id or a local directory), and a clause whose cosine similarity
to its nearest gram reaches `algorithm.planning.threshold` is a planning span: all its tokens are marked.
The encoder loads at the first step that detects planning (a config check or `retrain explain` loads
nothing), and the grams are embedded once.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import numpy as np

from retrain.errors import ConfigError

CLAUSE = re.compile(r"[^.!?;:,\n]+")  # the text between sentence punctuation, commas and line breaks
ENCODE_BATCH = 256  # clauses per forward of the encoder


class SemanticSpans:
    """Character spans of the clauses of a text that mean one of the grams."""

    def __init__(self, grams: tuple[str, ...], model: str, threshold: float) -> None:
        if importlib.util.find_spec("sentence_transformers") is None:
            raise ConfigError(
                "algorithm.planning.detector=semantic needs sentence-transformers, which is not installed: "
                "pip install 'retrain[semantic]'"
            )
        if not -1 < threshold <= 1:
            raise ConfigError(f"algorithm.planning.threshold must be a cosine similarity in (-1, 1], got {threshold}")
        if not model:
            raise ConfigError("algorithm.planning.model is empty: give a sentence-transformers model (Hub id or dir)")
        self.grams, self.model, self.threshold = grams, model, threshold
        self._encoder: Any = None
        self._gram_vectors: np.ndarray | None = None

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        """[M, 2] spans (start, end) per text: its clauses within `threshold` of a gram."""
        clauses = [clause_spans(text) for text in texts]
        flat = [text[start:end] for text, spans in zip(texts, clauses) for start, end in spans]
        if not flat:
            return [spans.reshape(-1, 2) for spans in clauses]
        nearest = (self._embed(flat) @ self._grams().T).max(axis=1)
        found, offset = [], 0
        for spans in clauses:
            near = nearest[offset : offset + len(spans)] >= self.threshold
            found.append(spans[near].reshape(-1, 2))
            offset += len(spans)
        return found

    def _grams(self) -> np.ndarray:
        if self._gram_vectors is None:
            self._gram_vectors = self._embed(list(self.grams))
        return self._gram_vectors

    def _embed(self, sentences: list[str]) -> np.ndarray:
        """Unit-length embeddings, [len(sentences), D]."""
        vectors = self._load().encode(
            sentences,
            batch_size=ENCODE_BATCH,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)

    def _load(self) -> Any:
        if self._encoder is None:
            from sentence_transformers import SentenceTransformer

            from retrain.hub import hub_fetch, local_path

            if local_path(self.model, "algorithm.planning.model") is not None:
                self._encoder = SentenceTransformer(self.model)
            else:
                with hub_fetch(self.model, "model", "algorithm.planning.model"):
                    self._encoder = SentenceTransformer(self.model)
        return self._encoder

    def __deepcopy__(self, memo: dict[int, Any]) -> SemanticSpans:
        """A copy (the preflight's probe algorithm) shares the encoder: it is read only."""
        return self


def clause_spans(text: str) -> np.ndarray:
    """[C, 2] character spans of the clauses of `text`, each trimmed of surrounding blanks, word-bearing only."""
    spans = []
    for match in CLAUSE.finditer(text):
        clause = match.group()
        if re.search(r"\w", clause):
            start = match.start() + len(clause) - len(clause.lstrip())
            spans.append((start, match.start() + len(clause.rstrip())))
    return np.array(spans, dtype=np.int64).reshape(-1, 2)
