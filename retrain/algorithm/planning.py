"""Planning-token detection: which sampled tokens belong to a strategic phrase ("let me check").

Matching runs on the decoded completion text (case-insensitive, whitespace runs and a hyphen
between words count as one space, typographic apostrophes as ASCII, whole words only), so a
phrase split into odd sub-word pieces ("dou" + "ble check") is still found. Each match's character
span is mapped back to exactly the tokens whose bytes overlap it, through a per-tokenizer table of
the bytes every token id contributes; a multi-byte character split across tokens marks all of them.

`detector="semantic"` (`algorithm.planning.detector`) finds the spans by meaning instead: a clause a
sentence encoder places near a gram (retrain/algorithm/semantic_planning.py); the same table maps them
to tokens.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from retrain.algorithm.grams import (
    APOSTROPHES,
    DEFAULT_SEMANTIC_MODEL,
    DEFAULT_SEMANTIC_THRESHOLD,
    DETECTORS,
    parse_grams,
)
from retrain.errors import ConfigError

WORD_SEPARATOR = r"(?:\s+|-)"  # a run of whitespace, or a hyphen joining two words


def gram_regex(gram: str) -> str:
    """One gram as a regex body: words joined by WORD_SEPARATOR, any apostrophe matching any."""
    apostrophe = f"[{APOSTROPHES}]"

    def word(text: str) -> str:
        return apostrophe.join(re.escape(part) for part in re.split(apostrophe, text))

    return WORD_SEPARATOR.join(word(w) for w in re.split(r"[\s\-]+", gram) if w)


@dataclass(frozen=True)
class TokenBytes:
    """What each token id contributes to the decoded text, as bytes (b"" for special tokens)."""

    pieces: list[bytes]  # indexed by id; one extra b"" at the end for ids beyond the tokenizer
    lengths: np.ndarray  # int64 byte length of every piece

    def lookup(self, ids: np.ndarray) -> tuple[bytes, np.ndarray]:
        ids = np.minimum(ids, len(self.pieces) - 1)
        return b"".join(map(self.pieces.__getitem__, ids.tolist())), self.lengths[ids]


_TABLES: weakref.WeakKeyDictionary[Any, TokenBytes] = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: Any) -> TokenBytes:
    """The id -> bytes table of a Hugging Face tokenizer, built once per tokenizer object."""
    table = _TABLES.get(tokenizer)
    if table is None:
        pieces = _byte_level_pieces(tokenizer) if _is_byte_level(tokenizer) else _decoded_pieces(tokenizer)
        pieces.append(b"")
        table = TokenBytes(pieces, np.array([len(p) for p in pieces], dtype=np.int64))
        _TABLES[tokenizer] = table
    return table


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the fast tokenizer's decoder is byte-level BPE (GPT-2, Qwen, Llama 3 ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    state = json.loads(decoder.__getstate__())
    parts = state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]
    return any(part.get("type") == "ByteLevel" for part in parts)


def _special_ids(tokenizer: Any) -> set[int]:
    special = set(tokenizer.all_special_ids)
    special.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return special


def _byte_level_pieces(tokenizer: Any) -> list[bytes]:
    """Byte-level vocab entries are byte strings spelled in a printable alphabet: undo the spelling."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # heavy: only when a table is built

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    special = _special_ids(tokenizer)
    added = {i: token.content for i, token in tokenizer.added_tokens_decoder.items()}
    pieces: list[bytes] = []
    for i, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in special or token is None:
            pieces.append(b"")
        elif i in added:
            pieces.append(added[i].encode("utf-8"))
        else:
            try:
                pieces.append(bytes(byte_of[char] for char in token))
            except KeyError:  # not spelled in the byte alphabet: take it literally
                pieces.append(token.encode("utf-8"))
    return pieces


def _decoded_pieces(tokenizer: Any) -> list[bytes]:
    """Other tokenizers: what each id adds when decoded after an anchor token (mid-text form)."""
    anchor = tokenizer.encode("a", add_special_tokens=False)[:1]
    prefix = tokenizer.decode(anchor, clean_up_tokenization_spaces=False)
    special = _special_ids(tokenizer)
    texts = tokenizer.batch_decode([[*anchor, i] for i in range(len(tokenizer))], clean_up_tokenization_spaces=False)
    pieces = []
    for i, text in enumerate(texts):
        if i in special:
            pieces.append(b"")
        elif text.startswith(prefix):
            pieces.append(text[len(prefix) :].encode("utf-8"))
        else:
            pieces.append(tokenizer.decode([i], clean_up_tokenization_spaces=False).encode("utf-8"))
    return pieces


def _char_byte_lengths(text: str) -> np.ndarray:
    """UTF-8 length of every character; a surrogate-escaped invalid byte counts as one byte."""
    codepoints = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    lengths = 1 + (codepoints >= 0x80).astype(np.int64) + (codepoints >= 0x800) + (codepoints >= 0x10000)
    escaped = (codepoints >= 0xDC80) & (codepoints <= 0xDCFF)
    return np.where(escaped, 1, lengths)


class PlanningDetector:
    """Finds strategic grams in completions and marks the tokens that spell them (or, with
    `detector="semantic"`, the tokens of every clause that means one; `model` and `threshold` are its)."""

    def __init__(
        self,
        grams: Any = None,
        detector: str = "regex",
        model: str = DEFAULT_SEMANTIC_MODEL,
        threshold: float = DEFAULT_SEMANTIC_THRESHOLD,
    ) -> None:
        self.grams = parse_grams(grams)
        alternatives = "|".join(gram_regex(g) for g in sorted(self.grams, key=len, reverse=True))
        # a lookahead finds overlapping matches ("wait let me think" holds two grams)
        self._pattern = re.compile(rf"(?<!\w)(?=((?:{alternatives}))(?!\w))", re.IGNORECASE)
        if detector not in DETECTORS:
            raise ConfigError(f"algorithm.planning.detector={detector!r} is not one of {', '.join(DETECTORS)}")
        self.detector = detector
        self._semantic = None
        if detector == "semantic":
            from retrain.algorithm.semantic_planning import SemanticSpans

            self._semantic = SemanticSpans(self.grams, model, threshold)

    def spans(self, text: str) -> np.ndarray:
        """[M, 2] character spans (start, end) of every gram occurrence in `text` (semantic: of every clause
        that means one)."""
        return self.spans_of([text])[0]

    def spans_of(self, texts: list[str]) -> list[np.ndarray]:
        """`spans` of each text; the semantic detector encodes all their clauses at once."""
        if self._semantic is not None:
            return self._semantic(texts)
        return [
            np.array([match.span(1) for match in self._pattern.finditer(text)], dtype=np.int64).reshape(-1, 2)
            for text in texts
        ]

    def mask(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, tokenizer: Any) -> torch.Tensor:
        """[N, T] bool planning mask of a step's completions (False on padding)."""
        table = token_bytes(tokenizer)
        ids = completion_ids.detach().cpu().numpy()
        real = completion_mask.detach().cpu().numpy().astype(bool)
        positions = [np.flatnonzero(real[row]) for row in range(ids.shape[0])]
        decoded = [table.lookup(ids[row, kept]) for row, kept in enumerate(positions)]
        texts = [data.decode("utf-8", "surrogateescape") for data, _ in decoded]
        planning = np.zeros(ids.shape, dtype=bool)
        for row, (text, (_, lengths), spans) in enumerate(zip(texts, decoded, self.spans_of(texts))):
            if positions[row].size:
                planning[row, positions[row]] = _tokens_in_spans(text, lengths, spans)
        return torch.from_numpy(planning)


def _tokens_in_spans(text: str, lengths: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Which tokens (their byte `lengths` spell `text`) overlap any of the character `spans`."""
    hits = np.zeros(lengths.shape[0], dtype=bool)
    if spans.shape[0] == 0:
        return hits
    char_of_byte = np.repeat(np.arange(len(text)), _char_byte_lengths(text))
    nonempty = np.flatnonzero(lengths > 0)
    first_byte = (np.cumsum(lengths) - lengths)[nonempty]
    starts = char_of_byte[first_byte]
    ends = char_of_byte[first_byte + lengths[nonempty] - 1] + 1
    # tokens overlapping [s, e): ends > s (a suffix) and starts < e (a prefix) of the sorted tokens
    low = np.searchsorted(ends, spans[:, 0], side="right")
    high = np.searchsorted(starts, spans[:, 1], side="left")
    keep = high > low
    marks = np.zeros(nonempty.size + 1, dtype=np.int64)
    np.add.at(marks, low[keep], 1)
    np.add.at(marks, high[keep], -1)
    hits[nonempty] = np.cumsum(marks)[:-1] > 0
    return hits
