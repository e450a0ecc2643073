"""text_similarity's metrics: known values on small texts, worked out by hand, and bounded time."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from core.graders.similarity import MAX_TEXT_CHARS, METRICS, similarity

REFERENCE = "the cat sat on the mat"
ANSWER = "the cat sat on a mat"


@pytest.mark.parametrize("metric", METRICS)
def test_identical_texts_score_one(metric: str):
    assert similarity(metric, REFERENCE, REFERENCE) == 1.0
    assert similarity(metric, "cat", "cat") == 1.0  # shorter than rouge_5's n-grams, one word for METEOR


@pytest.mark.parametrize("metric", METRICS)
def test_texts_with_nothing_in_common_score_zero(metric: str):
    assert similarity(metric, "dog", "cat") == 0.0  # no character in common, for fuzzy_match
    if metric != "fuzzy_match":
        assert similarity(metric, "dog barks loudly", "cat sat down") == 0.0


@pytest.mark.parametrize("metric", METRICS)
def test_an_empty_answer_scores_zero_and_two_empty_texts_one(metric: str):
    assert similarity(metric, "", REFERENCE) == 0.0
    assert similarity(metric, "", "") == 1.0


# The answer shares, of the reference's 6 words: 5 unigrams (the, cat, sat, on, mat), 3 of 5 bigrams,
# 2 of 4 trigrams, 1 of 3 four-grams; the longest common subsequence is 5 words.
HAND_CHECKED = {
    "rouge_1": 5 / 6,  # precision = recall = 5/6
    "rouge_2": 3 / 5,
    "rouge_3": 2 / 4,
    "rouge_4": 1 / 3,
    "rouge_5": 0.0,  # the one 5-gram of each differs
    "rouge_l": 5 / 6,
    "gleu": 11 / 18,  # min(precision, recall) over all 1- to 4-grams: (5 + 3 + 2 + 1) / (6 + 5 + 4 + 3)
    "bleu": (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25,  # geometric mean of the four precisions; same length, no penalty
    # Indel: the longest common subsequence of characters is 19 of 22 and 20: 2 * 19 / 42.
    "fuzzy_match": 38 / 42,
    # F-mean 5/6; nltk aligns the answer's "the" to the reference's second one, making 3 chunks of 5
    # matches: 5/6 * (1 - 0.5 * (3/5)**3).
    "meteor": 5 / 6 * (1 - 0.5 * (3 / 5) ** 3),
}


@pytest.mark.parametrize("metric", METRICS)
def test_a_partial_overlap_scores_its_hand_checked_value(metric: str):
    assert similarity(metric, ANSWER, REFERENCE) == pytest.approx(HAND_CHECKED[metric])


def test_fuzzy_match_counts_case_while_the_word_metrics_do_not():
    assert similarity("fuzzy_match", "Paris", "paris") == pytest.approx(0.8)
    assert similarity("rouge_1", "Paris", "paris") == 1.0
    assert similarity("bleu", "PARIS", "paris") == 1.0


def test_fuzzy_match_does_not_reward_padding_around_the_reference():
    assert similarity("fuzzy_match", "Paris " + "filler " * 20, "Paris") < 0.2


def test_meteor_matches_porter_stems_without_wordnet():
    # "running"/"run" share a stem; no WordNet corpus is needed (it is not on these machines).
    stemmed = similarity("meteor", "dogs running", "dog run")
    assert 0.5 < stemmed < 1.0
    assert similarity("meteor", "big house", "large home") == 0.0  # synonyms need WordNet: not matched


def test_rouge_scores_words_of_any_script():
    assert similarity("rouge_1", "γεια σου κόσμε", "γεια σου φίλε") == pytest.approx(2 / 3)


def test_a_short_answer_gets_a_bleu_score_not_zero():
    assert 0.0 < similarity("bleu", "the cat", "the cat sat") < 1.0


def test_unknown_metric_is_refused():
    with pytest.raises(ValueError):
        similarity("cosine", "a", "a")


@pytest.mark.parametrize("metric", METRICS)
def test_huge_texts_are_cut_and_scored_in_bounded_time(metric: str):
    words = [f"w{i % 300}" for i in range(60_000)]
    started = time.monotonic()
    score = similarity(metric, " ".join(words), " ".join(reversed(words)))
    assert 0.0 <= score <= 1.0
    assert time.monotonic() - started < 5.0
    assert len(" ".join(words)) > MAX_TEXT_CHARS


def test_importing_the_module_does_not_import_the_libraries():
    # The web process imports core.graders to check graders; the metric libraries load on first use.
    code = "import sys, core.graders.similarity; print(any(m in sys.modules for m in ('nltk', 'rouge_score', 'rapidfuzz')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
