"""text_similarity's metrics, each a score in [0, 1] of an answer (``output``) against a reference,
computed by the maintained libraries (imported on first use, so importing this module is cheap):

- ``fuzzy_match``: rapidfuzz's ``fuzz.ratio`` / 100, the normalised Indel similarity of the two
  whole strings (what "fuzzy string ratio" means in OpenAI's description). Not ``partial_ratio`` or
  the token-set scorers: those give 1.0 to an answer that merely contains the reference among
  padding, and a reward that pays for padding gets padding. Case and spaces count.
- ``bleu``: nltk's ``sentence_bleu`` (up to 4-grams) with Chen and Cherry's smoothing method 1 (a
  small count for an n-gram order with no match), and its weights re-spread over the orders a short
  text has (``auto_reweigh``), so a short answer is scored, not 0 with a warning.
- ``gleu``: nltk's ``sentence_gleu`` (Google's sentence-level BLEU, 1- to 4-grams).
- ``meteor``: nltk's ``meteor_score``, with one deviation: METEOR's third matching stage uses
  WordNet synonyms, and the WordNet corpus cannot be downloaded on these machines (no network but
  the package index), so a stand-in with no synonyms is passed: words match exactly or by their
  Porter stems only. An answer using a synonym of the reference's word scores lower than it would
  with WordNet.
- ``rouge_1`` … ``rouge_5``, ``rouge_l``: Google's rouge-score (``rouge1`` … ``rouge5``,
  ``rougeL``), the F-measure, with Porter stemming as its own tokenizer does.

Texts identical once tokenised score 1.0 by every metric. The libraries alone do not always say so:
METEOR's fragmentation penalty never reaches 0 (one identical word scores 0.5, six 0.998), and
rouge-score gives 0 to two identical texts shorter than its n-grams ("cat" and "cat" by rouge_2). A
reward that does not pay for the exact answer would teach the wrong thing, so this one rule departs
from them.

Tokens, with no nltk data (no punkt): lower-cased runs of letters and digits of any script, for
every metric but fuzzy_match (which compares the characters as they are); bleu, gleu and meteor
keep each punctuation mark as a token of its own, as their usual tokenizers do; rouge drops it, as
rouge-score's tokenizer does (its own keeps only a-z and 0-9, which would score a Greek or Chinese
answer 0, so ours keeps every script's letters). Each text is cut to ``MAX_TEXT_CHARS`` first and
to ``MAX_TOKENS`` tokens, which bounds the time (rouge_l and meteor are quadratic in pure Python).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

METRICS = ("fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l")
MAX_TEXT_CHARS = 20_000
MAX_TOKENS = 2_000  # rouge_l's table is MAX_TOKENS² cells in pure Python: about a second at this size

_WORDS_AND_MARKS = re.compile(r"[^\W_]+|[^\w\s]|_", re.UNICODE)
_WORDS = re.compile(r"[^\W_]+", re.UNICODE)
_ROUGE_TYPES = {f"rouge_{n}": f"rouge{n}" for n in range(1, 6)} | {"rouge_l": "rougeL"}


def similarity(metric: str, output: str, reference: str) -> float:
    """``output``'s score against ``reference`` by ``metric`` (one of ``METRICS``), in [0, 1].
    Two texts with no tokens at all are identical (1.0); one without tokens matches nothing (0.0)."""
    output, reference = output[:MAX_TEXT_CHARS], reference[:MAX_TEXT_CHARS]
    if metric == "fuzzy_match":
        return _fuzzy_match(output, reference)
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}")
    pattern = _WORDS if metric in _ROUGE_TYPES else _WORDS_AND_MARKS
    hypothesis, target = _tokens(output, pattern), _tokens(reference, pattern)
    if hypothesis == target:
        return 1.0
    if not hypothesis or not target:
        return 0.0
    if metric in _ROUGE_TYPES:
        return _rouge(_ROUGE_TYPES[metric], output, reference)
    scorer = {"bleu": _bleu, "gleu": _gleu, "meteor": _meteor}[metric]
    return _clamped(scorer(hypothesis, target))


def _tokens(text: str, pattern: re.Pattern[str]) -> list[str]:
    return pattern.findall(text.lower())[:MAX_TOKENS]


def _clamped(score: float) -> float:
    return min(1.0, max(0.0, float(score)))


def _fuzzy_match(output: str, reference: str) -> float:
    from rapidfuzz import fuzz

    return _clamped(fuzz.ratio(output, reference) / 100)


def _bleu(hypothesis: list[str], target: list[str]) -> float:
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    return sentence_bleu([target], hypothesis, smoothing_function=SmoothingFunction().method1, auto_reweigh=True)


def _gleu(hypothesis: list[str], target: list[str]) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    return sentence_gleu([target], hypothesis)


class _NoSynonyms:
    """Stands in for nltk's WordNet reader in METEOR: no word has a synonym (see the module's docstring)."""

    def synsets(self, word: str, *args: object, **kwargs: object) -> list:
        return []


def _meteor(hypothesis: list[str], target: list[str]) -> float:
    from nltk.translate.meteor_score import meteor_score

    return meteor_score([target], hypothesis, wordnet=_NoSynonyms())


class _RougeTokenizer:
    """rouge-score's tokenizer (lower case, letters and digits, Porter stems of words longer than
    three characters), with every script's letters kept."""

    def __init__(self) -> None:
        from nltk.stem.porter import PorterStemmer

        self._stemmer = PorterStemmer()

    def tokenize(self, text: str) -> list[str]:
        return [self._stemmer.stem(token) if len(token) > 3 else token for token in _tokens(text, _WORDS)]


@cache
def _rouge_scorer(rouge_type: str) -> Any:
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer([rouge_type], tokenizer=_RougeTokenizer())


def _rouge(rouge_type: str, output: str, reference: str) -> float:
    score = _rouge_scorer(rouge_type).score(reference, output)[rouge_type]
    return _clamped(score.fmeasure)
