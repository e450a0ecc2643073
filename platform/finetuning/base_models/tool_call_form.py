"""Which of vLLM's tool-call parsers reads the calls a chat template writes (``manage.py add_base_model``).

A probe conversation (one tool, one call of it) is rendered with the template, and the text of the
assistant's turn is handed to each candidate parser: the one that reads back exactly the probe's call
fits. A template that renders no tools gets no parser (its model serves no tools); one that renders
them in a form no candidate reads is refused, as is a parser asked for that does not read them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from core.chat_tokens import render

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The forms tried, most common first: vLLM's parser names. Each reads its calls from the text alone.
CANDIDATE_PARSERS = ("hermes", "llama3_json", "pythonic", "qwen3_xml")

_PROBE_NAME = "probe_lookup_weather"
_PROBE_ARGUMENTS = {"city": "Paris"}
PROBE_TOOLS = [{
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "Look up the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
_QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_probe", "type": "function",
         "function": {"name": _PROBE_NAME, "arguments": json.dumps(_PROBE_ARGUMENTS)}},
    ],
}


class ToolFormRefused(ValueError):
    """The template renders tools in a form no parser here reads, or not the asked parser's."""


def renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the template puts the tools it is given into the prompt."""
    return _PROBE_NAME in render(tokenizer, [_QUESTION], PROBE_TOOLS, add_generation_prompt=True)


def tool_call_parser(tokenizer: PreTrainedTokenizerBase, asked: str | None = None) -> str | None:
    """The parser of the form the template writes calls in; None when it renders no tools."""
    if not renders_tools(tokenizer):
        if asked is not None:
            raise ToolFormRefused(
                f"--tool-call-parser {asked}: the chat template renders no tools, so there are no calls to parse "
                "(give a template that renders `tools` with --chat-template)"
            )
        return None
    reply = _assistant_turn(tokenizer)
    fitting = [name for name in ((asked,) if asked else CANDIDATE_PARSERS) if _reads_probe(name, tokenizer, reply)]
    if fitting:
        return fitting[0]
    if asked is not None:
        raise ToolFormRefused(
            f"--tool-call-parser {asked} does not read the calls this chat template writes ({reply!r}): "
            f"leave the option out to detect the parser, or give a template in {asked}'s form"
        )
    raise ToolFormRefused(
        f"the chat template renders tools, but writes a call as {reply!r}, which none of vLLM's parsers "
        f"{', '.join(CANDIDATE_PARSERS)} reads: use a template in one of their forms (the hermes form: "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>)'
    )


def _assistant_turn(tokenizer: PreTrainedTokenizerBase) -> str:
    """What the template writes for the probe's call: the conversation through it, after its prompt."""
    prompt = render(tokenizer, [_QUESTION], PROBE_TOOLS, add_generation_prompt=True)
    through = render(tokenizer, [_QUESTION, _CALL], PROBE_TOOLS)
    if not through.startswith(prompt):
        raise ToolFormRefused("the chat template does not render a conversation's prompt as a prefix of the whole")
    return through[len(prompt) :]


def _reads_probe(parser_name: str, tokenizer: PreTrainedTokenizerBase, reply: str) -> bool:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    try:
        parser = ToolParserManager.get_tool_parser(parser_name)(tokenizer)
    except KeyError:
        raise ToolFormRefused(f"vLLM has no tool-call parser named {parser_name!r}") from None
    except Exception:  # a parser that needs special tokens this tokenizer lacks cannot be this model's
        return False
    request = ChatCompletionRequest(model="probe", messages=[_QUESTION], tools=PROBE_TOOLS)
    try:
        found = parser.extract_tool_calls(_without_end_of_turn(tokenizer, reply), request)
    except Exception:  # a parser of another form may choke on this one's text
        return False
    calls = [(call.function.name, _parsed(call.function.arguments)) for call in found.tool_calls]
    return found.tools_called and calls == [(_PROBE_NAME, _PROBE_ARGUMENTS)]


def _without_end_of_turn(tokenizer: PreTrainedTokenizerBase, reply: str) -> str:
    """The reply as the engine hands it to the parser: generation stops at the end-of-turn token."""
    end = tokenizer.eos_token or ""
    return reply.rstrip().removesuffix(end).rstrip() if end else reply


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return None
