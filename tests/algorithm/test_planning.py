"""Planning tokens: grams found on decoded text, mapped back to exactly the tokens that spell them.

The tokenizers are real: a byte-level BPE trained here on a small corpus (so words split into odd
sub-word pieces and multi-byte characters into single bytes), and the bundled tiny model's one.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from retrain.algorithm.grams import DEFAULT_GRAMS, parse_grams
from retrain.algorithm.planning import PlanningDetector
from retrain.assets import TINY_MODEL_DIR
from retrain.errors import ConfigError

CORPUS = [
    "Let me think about the sum of the first n integers. The answer is n(n+1)/2.",
    "We compute 3 + 4 = 7, then multiply by two to get 14. So the result is 14.",
    "Consider the triangle with sides 3, 4 and 5; its area is six square units.",
    "The café sells crêpes for 5 € each — a fair price, naïve customers say.",
    "Integrate x squared from zero to one: the integral equals one third.",
] * 4
TEXT = (
    "So, wait let me think… Double-check: that’s not right! "
    "Notice that  the\nKEY insight is x² ≥ 0; what if we start over? outlet me think 🙂 done"
)
EXPECTED_GRAMS = [
    "wait let me",
    "let me think",
    "Double-check",
    "that’s not right",
    "Notice that",
    "the\nKEY insight",
    "what if we",
    "start over",
]


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def expected_spans(text: str, phrases: list[str]) -> list[tuple[int, int]]:
    spans = []
    for phrase in phrases:
        start = text.index(phrase)
        spans.append((start, start + len(phrase)))
    return sorted(spans)


def oracle_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Token ids of `text`, and which tokens' own character offsets overlap a span (the tokenizer's view)."""
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    marks = [any(s < end and e > start for start, end in spans) and e > s for s, e in encoded["offset_mapping"]]
    return encoded["input_ids"], marks


def test_grams_are_found_on_normalised_text_with_whole_words():
    found = [TEXT[s:e] for s, e in PlanningDetector().spans(TEXT)]
    assert sorted(found) == sorted(EXPECTED_GRAMS)  # not "outlet me think"
    assert PlanningDetector().spans("letme think, let-me-think, LET  ME\tTHINK").tolist() == [[13, 25], [27, 40]]


def test_overlapping_grams_are_both_found():
    text = "wait let me think"
    assert PlanningDetector().spans(text).tolist() == [[0, 11], [5, 17]]


def test_the_byte_level_tokenizer_splits_words_and_characters(byte_bpe):
    offsets = byte_bpe(TEXT, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    start = TEXT.index("Double")
    assert sum(start <= s < start + len("Double") for s, _ in offsets) >= 2  # a word in several pieces
    assert len(byte_bpe("’", add_special_tokens=False)["input_ids"]) == 3  # a character in three byte tokens


def test_planning_tokens_are_exactly_the_tokens_overlapping_a_match(byte_bpe):
    spans = expected_spans(TEXT, EXPECTED_GRAMS)
    ids, expected = oracle_mask(byte_bpe, TEXT, spans)
    mask = PlanningDetector().mask(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool), byte_bpe)
    assert mask[0].tolist() == expected
    apostrophe = [
        i
        for i, (s, e) in enumerate(
            byte_bpe(TEXT, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
        )
        if s <= TEXT.index("’") < e
    ]
    assert len(apostrophe) == 3 and all(mask[0, apostrophe])  # every byte of the split character


def test_rows_with_padding_special_tokens_and_a_cut_character(byte_bpe):
    first = byte_bpe("Let me check: 2 + 2 = 4.", add_special_tokens=False)["input_ids"] + [byte_bpe.eos_token_id]
    second = byte_bpe("no plan here 🙂 and double check", add_special_tokens=False)["input_ids"]
    cut = byte_bpe("the key is 🙂", add_special_tokens=False)["input_ids"][:-2]  # emoji cut mid-character
    rows = [first, second, cut]
    width = max(map(len, rows)) + 3
    ids = torch.full((3, width), byte_bpe.eos_token_id)
    mask = torch.zeros(3, width, dtype=torch.bool)
    for n, row in enumerate(rows):
        ids[n, : len(row)] = torch.tensor(row)
        mask[n, : len(row)] = True
    planning = PlanningDetector().mask(ids, mask, byte_bpe)
    assert not planning[~mask].any()
    texts = ["Let me check: 2 + 2 = 4.", "no plan here 🙂 and double check", None]
    for n, phrase in ((0, "Let me check"), (1, "double check")):
        _, expected = oracle_mask(byte_bpe, texts[n], expected_spans(texts[n], [phrase]))
        assert planning[n, : len(expected)].tolist() == expected
    assert planning[0, len(first) - 1].item() is False  # the EOS token
    key_is = len(byte_bpe("the key is", add_special_tokens=False)["input_ids"])
    assert planning[2, :key_is].all() and not planning[2, key_is:].any()


def test_user_grams_replace_the_defaults(byte_bpe):
    detector = PlanningDetector("consider the triangle, area")
    text = "Consider the triangle; the area is 6. Let me think."
    assert [text[s:e] for s, e in detector.spans(text)] == ["Consider the triangle", "area"]


@pytest.mark.parametrize(
    "grams, expected",
    [
        (None, DEFAULT_GRAMS),
        ("", DEFAULT_GRAMS),
        ("a b, c", ("a b", "c")),
        ('["x  y", "z"]', ("x y", "z")),
        (["wait", "hmm ok"], ("wait", "hmm ok")),
    ],
)
def test_grams_parse_from_lists_csv_and_json(grams, expected):
    assert parse_grams(grams) == expected


@pytest.mark.parametrize("grams", [[], ["ok", ""], ["ok", 3], "[1, 2", 7])
def test_bad_grams_name_the_key(grams):
    with pytest.raises(ConfigError, match="algorithm.planning.grams"):
        parse_grams(grams)


@pytest.fixture(scope="module")
def metaspace_bpe() -> PreTrainedTokenizerFast:
    """A sentencepiece-style tokenizer ("▁" marks a word start): not byte-level, decoded piece by piece."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"])
    tokenizer.train_from_iterator([*CORPUS, TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>")


def test_a_non_byte_level_tokenizer_maps_grams_to_tokens_too(metaspace_bpe):
    text = "So wait let me think about it. Double-check the key insight here."
    spans = expected_spans(text, ["wait let me", "let me think", "Double-check", "the key insight"])
    ids, expected = oracle_mask(metaspace_bpe, text, spans)
    ids = [*ids, metaspace_bpe.eos_token_id]
    mask = PlanningDetector().mask(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool), metaspace_bpe)
    assert mask[0].tolist() == [*expected, False] and any(expected)


def test_the_tiny_models_tokenizer_marks_exactly_the_gram_tokens():
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    text = "Hmm, wait let me think. 12 × 3 = 36, double-check: that’s not right, the key insight is 36 ✓."
    spans = expected_spans(text, ["wait let me", "let me think", "double-check", "that’s not right", "the key insight"])
    ids, expected = oracle_mask(tokenizer, text, spans)
    mask = PlanningDetector().mask(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool), tokenizer)
    assert mask[0].tolist() == expected and any(expected)


def test_long_completions_are_marked_as_their_parts_are(byte_bpe):
    """10k-token rows: the same gram tokens as in the short text, once per repetition."""
    ids = byte_bpe(TEXT + " ", add_special_tokens=False)["input_ids"]
    single = PlanningDetector().mask(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool), byte_bpe)[0]
    repeats = 10_240 // len(ids)
    long_ids = torch.tensor([ids * repeats] * 2)
    marks = PlanningDetector().mask(long_ids, torch.ones_like(long_ids, dtype=torch.bool), byte_bpe)
    assert long_ids.shape[1] > 10_000
    assert torch.equal(marks, single.repeat(repeats).expand(2, -1))
