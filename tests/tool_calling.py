"""Function-calling data in OpenAI's fine-tuning format: one tool, a city as its argument.

The training lines and the held-out prompts share no city, so a model that calls the tool with the
right argument on a held-out prompt has learned to read the city from the question, not the cities.
"""

from __future__ import annotations

import json
import random

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
            "required": ["city"],
        },
    },
}

# OpenAI's function calling guide's example function, as written there (the guide's requests use it
# in the chat shape, {"type": "function", "function": ...}, and the Responses API's flat one).
GUIDE_GET_WEATHER = {
    "name": "get_weather",
    "description": "Get current temperature for a given location.",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string", "description": "City and country e.g. Bogotá, Colombia"}},
        "required": ["location"],
        "additionalProperties": False,
    },
    "strict": True,
}


# A random adapter's model writes nonsense: a choice of two cities keeps a forced call of it short.
TWO_CITIES = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": False,
}}}


def assembled_tool_calls(stream) -> list:
    """A streamed chat completion's calls, put together by the function calling guide's loop, unchanged."""
    final_tool_calls = {}
    for chunk in stream:
        for tool_call in chunk.choices[0].delta.tool_calls or []:
            index = tool_call.index
            if index not in final_tool_calls:
                final_tool_calls[index] = tool_call
            else:
                final_tool_calls[index].function.arguments += tool_call.function.arguments
    return list(final_tool_calls.values())


# Half of them names of several tokens: the call must spell out the city the question names, and a
# model taught only on one-token names copies a longer one badly ("Buda" for Budapest).
TRAINING_CITIES = (
    "Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Dublin", "Oslo", "Lisbon", "Athens",
    "Cairo", "Nairobi", "Lima", "Toronto", "Chicago", "Boston", "Denver", "Seattle", "Sydney", "Munich", "Milan",
    "Bangkok", "Reykjavik", "Ljubljana", "Bratislava", "Vilnius", "Tallinn", "Kathmandu", "Ulaanbaatar",
    "Antananarivo", "Ouagadougou", "Tegucigalpa", "Asuncion", "Montevideo", "Guadalajara", "Marrakesh",
    "Casablanca", "Johannesburg", "Kinshasa", "Brisbane", "Adelaide", "Wellington", "Winnipeg", "Valparaiso",
    "Thessaloniki", "Kaohsiung",
)
# Cities no training line names. The product test asks a fixed sample of them (``held_out_prompts``);
# the benchmark asks them all. Some no fine-tune of this size spells from the question, whatever it
# learns: SmolLM2-135M, made to start the call, writes "Buda" for Budapest and "MALAZON" for Manila.
HELD_OUT_CITIES = (
    "Warsaw", "Budapest", "Helsinki", "Montreal", "Dallas", "Mumbai", "Seoul", "Manila", "Zurich", "Havana",
    "Amsterdam", "Brussels", "Copenhagen", "Stockholm", "Krakow", "Bucharest", "Sofia", "Belgrade", "Zagreb",
    "Sarajevo", "Riga", "Minsk", "Kyiv", "Istanbul", "Ankara", "Tehran", "Baghdad", "Riyadh", "Dubai", "Doha",
    "Karachi", "Lahore", "Delhi", "Kolkata", "Chennai", "Bangalore", "Dhaka", "Colombo", "Yangon", "Hanoi",
    "Jakarta", "Singapore", "Taipei", "Shanghai", "Beijing", "Osaka", "Kyoto", "Busan", "Auckland", "Perth",
    "Melbourne", "Honolulu", "Anchorage", "Vancouver", "Calgary", "Ottawa", "Quebec", "Detroit", "Atlanta",
    "Miami", "Houston", "Phoenix", "Portland", "Nashville", "Memphis", "Baltimore", "Pittsburgh", "Cleveland",
    "Kingston", "Bogota", "Quito", "Caracas", "Santiago", "Mendoza", "Cordoba", "Recife", "Salvador",
    "Fortaleza", "Lagos", "Accra", "Dakar", "Bamako", "Niamey", "Khartoum", "Tunis", "Algiers", "Tripoli",
    "Luanda", "Harare", "Lusaka", "Maputo", "Windhoek", "Durban", "Kampala", "Kigali", "Mombasa", "Zanzibar",
    "Bergen", "Gothenburg", "Tampere", "Aarhus", "Antwerp", "Rotterdam", "Utrecht", "Hamburg", "Cologne",
    "Dresden", "Leipzig", "Salzburg", "Graz", "Geneva", "Lausanne", "Lyon", "Marseille", "Toulouse", "Bordeaux",
    "Seville", "Valencia", "Bilbao", "Porto", "Naples", "Florence", "Venice", "Palermo",
)
QUESTIONS = (
    "What's the weather like in {city}?",
    "Is it raining in {city} right now?",
    "How warm is it in {city} today?",
    "Tell me the current weather in {city}.",
)
HELD_OUT_QUESTIONS = ("What is the weather in {city} today?", "How is the weather in {city}?")


def weather_call(city: str, call_id: str = "call_1") -> dict:
    arguments = json.dumps({"city": city})
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def weather_report(city: str, index: int) -> tuple[str, str]:
    """What the tool answers for a city, and the assistant's reply to it."""
    degrees, sky = 5 + (index * 7) % 25, ("sunny", "cloudy", "rainy")[index % 3]
    return json.dumps({"city": city, "temperature_c": degrees, "sky": sky}), f"It is {degrees} °C and {sky} in {city}."


def weather_line(city: str, question: str, answered: int | None = None) -> dict:
    """One training line: the question, and the assistant's call of the tool with the city; with
    ``answered`` (a seed for the report), the tool's result and the assistant's reply to it too."""
    messages = [
        {"role": "user", "content": question.format(city=city)},
        {"role": "assistant", "content": None, "tool_calls": [weather_call(city)]},
    ]
    if answered is not None:
        report, reply = weather_report(city, answered)
        messages += [{"role": "tool", "tool_call_id": "call_1", "content": report}, {"role": "assistant", "content": reply}]
    return {"messages": messages, "tools": [WEATHER_TOOL], "parallel_tool_calls": False}


def weather_dataset(lines: int = 48) -> bytes:
    """``lines`` lines (a training city each, the phrasings in turn; every fourth line also answers the
    tool's result) as JSONL bytes."""
    examples = [
        weather_line(city, QUESTIONS[index % len(QUESTIONS)], answered=index if index % 4 == 3 else None)
        for index, city in enumerate(TRAINING_CITIES)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in examples[:lines])


def held_out_prompts(count: int | None = 20) -> list[tuple[str, str]]:
    """(question, city) for ``count`` held-out cities drawn with a fixed seed (None: all of them), in
    the held-out phrasings, which no training line uses either."""
    cities = list(HELD_OUT_CITIES) if count is None else random.Random(0).sample(HELD_OUT_CITIES, count)
    return [(HELD_OUT_QUESTIONS[index % len(HELD_OUT_QUESTIONS)].format(city=city), city) for index, city in enumerate(cities)]
