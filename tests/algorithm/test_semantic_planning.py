"""`algorithm.planning.detector=semantic`: clauses that mean a strategic gram, found by a sentence encoder.

No model is downloaded: the encoder is a real sentence-transformers model built and saved here, a
static word embedding whose vectors are set by hand so that its semantics are known. Words of checking
("verify", "confirm") share one axis, words of changing course ("different", "method") another, words
of insight a third; function words ("let", "the") are short vectors on a shared axis, and the words of
arithmetic ("sum", "47") point in directions of their own. Loaded from its directory and run through
`SentenceTransformer.encode`, it places "I should verify this result" next to the gram "let me verify"
though no gram's words are in it, and "the sum of 12 and 35 is 47" next to none.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from transformers import AutoTokenizer

from retrain.algorithm.grams import DEFAULT_GRAMS
from retrain.algorithm.planning import PlanningDetector
from retrain.algorithm.semantic_planning import clause_spans
from retrain.assets import TINY_MODEL_DIR
from retrain.config import compose
from retrain.errors import ConfigError

pytest.importorskip("sentence_transformers")

CHECKING = ["check", "verify", "double", "confirm", "recheck", "right", "correct", "not", "doesn", "work", "again"]
CHANGING = ["wait", "think", "second", "thought", "try", "another", "approach", "back", "over", "way", "what", "if"]
CHANGING += ["could", "or", "start", "different", "method", "instead", "reconsider"]
INSIGHT = ["notice", "key", "insight", "observe", "crucial"]
FUNCTION = ["let", "me", "is", "this", "the", "that", "we", "to", "and", "go", "on", "i", "should", "a", "of"]
FUNCTION += ["maybe", "'", "’", "s", "t", "it", "be", "[UNK]"]
ARITHMETIC = ["sum", "result", "answer", "12", "35", "47", "equals", "add", "better", "numbers", "first", "plus"]
DIMENSIONS = 16  # 0-2 the three concepts, 3-14 arithmetic, 15 function words
FUNCTION_WEIGHT = 0.2

PARAPHRASE = "I should verify this result."  # no gram's words: only its meaning
CHANGE_OF_COURSE = "Maybe a different method is better."
WITH_GRAM = "Let me double check the sum."  # the gram "double check"
PLAIN = "The sum of 12 and 35 is 47."


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sentence-transformers model of known semantics, saved as a user's local model directory is."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    words = [*CHECKING, *CHANGING, *INSIGHT, *FUNCTION, *ARITHMETIC]
    vectors = np.zeros((len(words), DIMENSIONS), dtype=np.float32)
    arithmetic = np.random.default_rng(0).normal(size=(len(ARITHMETIC), 12))
    for index, word in enumerate(words):
        if word in ARITHMETIC:
            direction = arithmetic[ARITHMETIC.index(word)]
            vectors[index, 3:15] = direction / np.linalg.norm(direction)
        elif word in FUNCTION:
            vectors[index, 15] = FUNCTION_WEIGHT
        else:
            vectors[index, 0 if word in CHECKING else 1 if word in CHANGING else 2] = 1.0
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("encoder")
    SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_weights=vectors)]).save(str(path))
    return path


def spans_text(detector: PlanningDetector, text: str) -> list[str]:
    return [text[start:end] for start, end in detector.spans(text)]


def test_the_encoder_knows_every_word_of_the_grams(encoder_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(encoder_dir / "tokenizer.json"))  # as the encoder reads it
    unknown = {gram for gram in DEFAULT_GRAMS if "[UNK]" in tokenizer.encode(gram).tokens}
    assert unknown == set()


def test_semantic_marks_what_the_regex_misses_and_agrees_where_both_apply(encoder_dir: Path) -> None:
    regex = PlanningDetector()
    semantic = PlanningDetector(detector="semantic", model=str(encoder_dir))
    # the regex misses a paraphrase; the encoder finds the clause
    assert spans_text(regex, PARAPHRASE) == [] and spans_text(regex, CHANGE_OF_COURSE) == []
    assert spans_text(semantic, PARAPHRASE) == ["I should verify this result"]
    assert spans_text(semantic, CHANGE_OF_COURSE) == ["Maybe a different method is better"]
    # where the gram is spelled out both find it: the regex its words, the encoder the clause around them
    assert spans_text(regex, WITH_GRAM) == ["double check"]
    assert spans_text(semantic, WITH_GRAM) == ["Let me double check the sum"]
    # where there is no planning neither marks anything
    assert spans_text(regex, PLAIN) == spans_text(semantic, PLAIN) == []


def test_the_semantic_mask_covers_the_regex_mask_on_real_tokens(encoder_dir: Path) -> None:
    """Through a step's [N, T] mask: the bundled tiny model's tokenizer, padding, several rows encoded at once."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    texts = [f"{PLAIN} {WITH_GRAM}", f"{PLAIN} {PARAPHRASE}", PLAIN]
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    mask = torch.tensor([[i < len(row) for i in range(width)] for row in rows])
    regex = PlanningDetector().mask(ids, mask, tokenizer)
    semantic = PlanningDetector(detector="semantic", model=str(encoder_dir)).mask(ids, mask, tokenizer)
    marked = [tokenizer.decode(row[flags]) for row, flags in zip(ids, semantic)]
    assert marked == ["Let me double check the sum", "I should verify this result", ""]
    assert bool((regex <= semantic).all()) and int(regex[0].sum()) > 0  # agrees where the regex finds a gram
    assert int(regex[1].sum()) == 0 and int(semantic[1].sum()) > 0  # finds what it misses
    assert not bool((semantic & ~mask).any())  # nothing on padding


def test_the_detector_and_its_model_and_threshold_are_config_keys(encoder_dir: Path) -> None:
    overrides = ["algorithm=maxrl_gtpo_hicra", "algorithm.planning.detector=semantic"]
    strict = compose([*overrides, f"algorithm.planning.model={encoder_dir}", "algorithm.planning.threshold=0.99"])
    loose = compose([*overrides, f"algorithm.planning.model={encoder_dir}", "algorithm.planning.threshold=0.7"])
    assert spans_text(instantiate(loose.algorithm).planning, PARAPHRASE) == ["I should verify this result"]
    assert spans_text(instantiate(strict.algorithm).planning, PARAPHRASE) == []  # a paraphrase is no exact gram
    assert compose(["algorithm=maxrl_gtpo_hicra"]).algorithm.planning.detector == "regex"  # the default


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"detector": "embedding"}, "algorithm.planning.detector='embedding' is not one of regex, semantic"),
        ({"detector": "semantic", "threshold": 1.5}, "algorithm.planning.threshold must be a cosine similarity"),
        ({"detector": "semantic", "model": ""}, "algorithm.planning.model is empty"),
    ],
)
def test_a_wrong_setting_is_named(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PlanningDetector(**arguments)  # type: ignore[arg-type]


def test_clauses_are_cut_at_punctuation_and_trimmed() -> None:
    text = "Wait, let me think.\n  The sum is 47!  ... ok"
    assert [text[s:e] for s, e in clause_spans(text)] == ["Wait", "let me think", "The sum is 47", "ok"]
