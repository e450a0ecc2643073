"""A chat example's tokens exactly as the trainer feeds them, and which of them it trains.

The trainer and the upload check share this module, so an upload is counted as it will be trained; it
imports neither torch nor Django, so the web process checks uploads without loading torch.

An example is a conversation: a list of ``{"role", "content", "weight"?}`` messages, with the tools its
line declares and the calls its assistant makes (``core.tool_calls``). It is rendered with the model
folder's chat template (the one the inference engine applies, handed the messages and tools as vLLM
hands them), tokenized, and each token is marked as trained or not: only the tokens of assistant
messages whose ``weight`` is 1 (their content or calls, and the end-of-turn token) count in the loss.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from jinja2 import TemplateError

from core.datasets import Example, ExampleError, Message
from core.tool_calls import Tool, template_message

if TYPE_CHECKING:  # importing transformers costs seconds: only the type checker reads it here
    from transformers import PreTrainedTokenizerBase

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers saves a template, and reads it from

# Saved tokenizer classes that load as they are, without AutoTokenizer: AutoTokenizer imports torch
# (through transformers' generation config), seconds and hundreds of MB the web process never needs.
_PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# ...but only for model types AutoTokenizer (what vLLM loads) leaves to the saved class. Others get a
# class of their own from config.json's model_type whatever the saved class says: qwen2 gets
# Qwen2Tokenizer, which reads "\n\n" as one token where the saved tokenizer.json reads two, so the
# trainer would feed other tokens than the server renders (tests/test_second_base_model_served.py).
_PLAIN_MODEL_TYPES = ("llama",)

# Stands in for message i's content in a rendering that shows where the contents go. A template's own
# text has no NUL, so a marker is never confused with it.
_CONTENT_MARKER = "\x00{}\x00"
_CONTENT_MARKERS = re.compile("\x00([0-9]+)\x00")


@dataclass(frozen=True)
class TokenizedExample:
    input_ids: list[int]
    trained: list[bool]  # trained[i]: token i is a target of the loss (predicted from token i - 1)

    @property
    def n_trained(self) -> int:
        return sum(self.trained)


class ReplySpan(NamedTuple):
    start: int  # character offsets in the rendered conversation
    end: int
    trained: bool


def load_tokenizer(weights: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model's weights: the trainer and the upload check load it alike."""
    weights = Path(weights)
    if _saved_tokenizer_class(weights) in _PLAIN_TOKENIZER_CLASSES and _model_type(weights) in _PLAIN_MODEL_TYPES:
        from transformers import PreTrainedTokenizerFast  # the class AutoTokenizer would pick from the config

        return PreTrainedTokenizerFast.from_pretrained(weights)
    from transformers import AutoTokenizer  # a model-specific class, which only AutoTokenizer resolves

    return AutoTokenizer.from_pretrained(weights)


def _model_type(weights: Path) -> str | None:
    config = weights / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.is_file() else None


def _saved_tokenizer_class(weights: Path) -> str | None:
    config = weights / "tokenizer_config.json"
    return json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None


def render(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[Tool] | None, add_generation_prompt: bool = False
) -> str:
    """The conversation as the chat template renders it, given what vLLM's server gives it for the same
    request (``core.tool_calls.template_message``; the tools, when there are any)."""
    handed = [template_message(message) for message in messages]
    try:
        return tokenizer.apply_chat_template(
            handed, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as exc:  # the template's raise_exception(): it refuses this conversation
        raise ExampleError(f"the chat template refuses this conversation: {exc.message}") from exc


def tokenize_example(tokenizer: PreTrainedTokenizerBase, example: list[Message]) -> TokenizedExample:
    """The tokens of one conversation, rendered by the chat template, and which of them are trained.

    The text is tokenized piece by piece, cut where replies start and end, so a reply's tokens follow
    exactly the tokens its prompt gets at inference (the rendering up to the assistant header,
    tokenized alone). Tokenizing the whole text at once would let BPE merge the header's newline with a
    reply that starts with whitespace (" Paris", common in prompt/completion data) into a token the
    model never sees after a prompt. Every reply is cut out, weighted or not, so weights never change
    the tokens.
    """
    text = render(tokenizer, example, _tools(example))
    pieces: list[tuple[str, bool]] = []
    cursor = 0
    for start, end, is_trained in _reply_spans(tokenizer, example, text):
        pieces += [(text[cursor:start], False), (text[start:end], is_trained)]
        cursor = end
    pieces.append((text[cursor:], False))
    # One call for all pieces (a batch still tokenizes each piece alone). The template writes its own
    # special tokens: the tokenizer must not add a BOS of its own.
    encoded = tokenizer([piece for piece, _ in pieces], add_special_tokens=False)["input_ids"]
    input_ids: list[int] = []
    trained: list[bool] = []
    for ids, (_, is_trained) in zip(encoded, pieces):
        input_ids += ids
        trained += [is_trained] * len(ids)
    if trained:
        trained[0] = False  # nothing predicts the first token, so it can never be a target
    return TokenizedExample(input_ids=input_ids, trained=trained)


def example_token_count(tokenizer: PreTrainedTokenizerBase, example: list[Message]) -> int:
    """Tokens of the example as the trainer feeds it to the model (before any max_seq_len cut)."""
    return len(tokenize_example(tokenizer, example).input_ids)


def _reply_spans(tokenizer: PreTrainedTokenizerBase, example: list[Message], text: str) -> list[ReplySpan]:
    """The character spans of ``text``, the rendered conversation, that hold the assistant replies.

    A reply starts where its prompt ends: the conversation before it, rendered with the template's
    assistant header (the generation prompt), as inference renders it. It stops where the conversation
    through it ends. That needs a template whose renderings of prefixes are prefixes of the whole
    rendering; one that is not (one that rewrites earlier turns, say) is refused loudly rather than
    trained with a silently wrong mask.

    Rendering the prefix of every reply would cost the square of the turns (2,000 turns took 42 s), so
    only the first and the last reply are found that way; the ones between are found in the whole
    rendering by the framing the first one gets: a constant number of renderings, whatever the turns.
    """
    replies = [index for index, message in enumerate(example) if message["role"] == "assistant"]
    if not replies:
        return []
    # A conversation with tools is located reply by reply: a call's rendering is not its content verbatim,
    # so the framing of the first reply says nothing of the others (its replies are capped: MAX_REPLIES_WITH_TOOLS).
    by_prefixes = replies if _calls_tools(example) else {replies[0], replies[-1]}
    located = {index: _span_by_prefixes(tokenizer, example, text, index) for index in by_prefixes}
    if len(replies) > 2 and not _calls_tools(example):
        located |= _spans_by_framing(tokenizer, example, text, replies[0], located[replies[0]], replies[1:-1])
    return [ReplySpan(*located[index], example[index].get("weight", 1) != 0) for index in replies]


def _span_by_prefixes(tokenizer: PreTrainedTokenizerBase, example: list[Message], text: str, index: int) -> tuple[int, int]:
    """Reply ``index``'s span, found by rendering its prompt and the conversation through it."""
    tools = _tools(example)
    prompt = render(tokenizer, example[:index], tools, add_generation_prompt=True)
    through = render(tokenizer, example[: index + 1], tools)
    if not (text.startswith(through) and through.startswith(prompt)):
        raise _unlocatable(index)
    return len(prompt), _end_before_whitespace(text, len(through), floor=len(prompt))


def _spans_by_framing(
    tokenizer: PreTrainedTokenizerBase,
    example: list[Message],
    text: str,
    first: int,
    first_span: tuple[int, int],
    indices: list[int],
) -> dict[int, tuple[int, int]]:
    """The spans of replies ``indices``, found in ``text`` where their contents are, framed as the first.

    The first reply shows the framing: its prompt ends with the generation prompt (and perhaps text the
    template puts before every reply's content), and its content is followed by an end-of-turn. Each
    other reply must be framed alike, or the conversation is refused.
    """
    content_starts = _content_starts(tokenizer, example, text)
    first_start, first_end = first_span
    history = render(tokenizer, example[:first], None)
    prompt = render(tokenizer, example[:first], None, add_generation_prompt=True)
    if not (prompt.startswith(history) and first_start <= content_starts[first]):
        raise _unlocatable(first)
    opening = prompt[len(history) :] + text[first_start : content_starts[first]]
    lead = content_starts[first] - first_start  # characters of the opening after the prompt's end
    first_content_end = content_starts[first] + len(example[first]["content"])
    # The end-of-turn after the content, without the trailing whitespace (none of it, if it is all whitespace).
    closing = text[first_content_end : max(first_end, first_content_end)]
    spans = {}
    for index in indices:
        content_start = content_starts[index]
        content_end = content_start + len(example[index]["content"])
        if not (text.endswith(opening, 0, content_start) and text.startswith(closing, content_end)):
            raise _framed_unlike_the_first(index)
        start = content_start - lead
        spans[index] = (start, _end_before_whitespace(text, content_end + len(closing), floor=start))
    return spans


def _content_starts(tokenizer: PreTrainedTokenizerBase, example: list[Message], text: str) -> list[int]:
    """Where each message's content starts in ``text``.

    The conversation is rendered once more with a numbered marker for each content: the text around the
    markers is the template's own, so a content that looks like template text cannot mislead the search.
    The real rendering must be that text with the contents in place of the markers.
    """
    markers = [{**message, "content": _CONTENT_MARKER.format(index)} for index, message in enumerate(example)]
    pieces = _CONTENT_MARKERS.split(render(tokenizer, markers, None))  # template text, marker number, template text...
    frames, order = pieces[0::2], [int(number) for number in pieces[1::2]]
    if order != list(range(len(example))):
        raise _contents_not_verbatim()
    starts, position = [], 0
    for frame, message in zip(frames, example):
        position += len(frame)
        starts.append(position)
        position += len(message["content"])
    rebuilt = "".join(frame + message["content"] for frame, message in zip(frames, example)) + frames[-1]
    if rebuilt != text:
        raise _contents_not_verbatim()
    return starts


def _tools(example: list[Message]) -> list[Tool] | None:
    """The tools a conversation declares (a plain list of messages, as tests and callers build, declares none)."""
    return example.tools if isinstance(example, Example) else None


def _calls_tools(example: list[Message]) -> bool:
    return example.calls_tools if isinstance(example, Example) else Example(example).calls_tools


def _end_before_whitespace(text: str, end: int, floor: int) -> int:
    """``end`` moved back over whitespace, not below ``floor``: the template's whitespace after the
    end-of-turn token is never generated, so it is not trained."""
    while end > floor and text[end - 1].isspace():
        end -= 1
    return end


def _unlocatable(index: int) -> ExampleError:
    return ExampleError(
        f"the chat template does not render message {index} of this conversation as a prefix of the whole "
        "conversation, so its assistant tokens cannot be located"
    )


def _framed_unlike_the_first(index: int) -> ExampleError:
    return ExampleError(
        f"the chat template frames message {index} of this conversation unlike its first reply, "
        "so its assistant tokens cannot be located"
    )


def _contents_not_verbatim() -> ExampleError:
    return ExampleError(
        "the chat template does not render each message's content as it is, once and in order, "
        "so the assistant tokens of this conversation cannot be located"
    )
