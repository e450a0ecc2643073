"""Which words of an answer differ from a reference answer: a word-level diff (``difflib``) for
pages that put two answers side by side. Spacing is kept with each word, so the answer reads as it
was written; only the words are compared."""

from __future__ import annotations

import re
from dataclasses import dataclass
from difflib import SequenceMatcher

_WORD_WITH_SPACE = re.compile(r"(\s*)(\S+)")


@dataclass(frozen=True)
class Word:
    space: str  # the whitespace before the word, as written
    text: str
    changed: bool  # not in the reference at this place: added, or replacing another word


def _words(text: str) -> list[tuple[str, str]]:
    return _WORD_WITH_SPACE.findall(text)


def words_against(answer: str, reference: str) -> list[Word]:
    """``answer``'s words, each marked ``changed`` when the reference does not have it there."""
    words, reference_words = _words(answer), [text for _space, text in _words(reference)]
    # autojunk off: an answer's common words ("the", ",") are exactly what must still line up.
    matcher = SequenceMatcher(a=reference_words, b=[text for _space, text in words], autojunk=False)
    unchanged = {index for block in matcher.get_matching_blocks() for index in range(block.b, block.b + block.size)}
    return [Word(space, text, index not in unchanged) for index, (space, text) in enumerate(words)]
