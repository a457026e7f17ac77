"""Real tool definitions and answers (from the ComplexFuncBench and NESTFUL data of nestful-wrapper 0.1.7,
descriptions shortened) and a small BPE tokenizer trained here on JSON, for schema drafting's tests."""

from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specstand.workloads.importers import openai_tool

COMPLEXFUNCBENCH_SPECS = [
    {"name": "Search_Car_Location", "description": "Find car rental location by searching for their name.",
     "query_parameters": {"query": {"type": "string", "description": "Names of locations, cities, districts.",
                                    "required": True, "enum": [], "default": None}}},
    {"name": "Search_Hotels", "description": "Search Hotels.",
     "query_parameters": {
         "sort_by": {"type": "string", "description": "`sort_by` can be retrieved from Get Sort By.", "required": False,
                     "enum": ["price", "upsort_bh", "popularity", "distance", "class_descending", "class_ascending"],
                     "default": None},
         "search_type": {"type": "string", "description": "From Search Hotel Destination.", "required": True,
                         "enum": [], "default": None},
         "adults": {"type": "number", "description": "The number of adults.", "required": False, "enum": [],
                    "default": None},
         "arrival_date": {"type": "string", "description": "Check-in. DATE (YYYY-MM-DD)", "required": True,
                          "enum": [], "default": None},
         "room_qty": {"type": "number", "description": "The number of rooms.", "required": False, "enum": [],
                      "default": None},
         "dest_id": {"type": "number", "description": "From Search Hotel Destination.", "required": True,
                     "enum": [], "default": None},
         "departure_date": {"type": "string", "description": "Check-out. DATE (YYYY-MM-DD)", "required": True,
                            "enum": [], "default": None}}},
    {"name": "Get_Room_Availability", "description": "Search the room price and availability for future dates.",
     "query_parameters": {
         "min_date": {"type": "string", "description": "The starting date range.DATE (YYYY-MM-DD)", "required": True,
                      "enum": [], "default": None},
         "hotel_id": {"type": "string", "description": "From Search Hotels.", "required": True, "enum": [],
                      "default": None},
         "max_date": {"type": "string", "description": "The ending date rangeDATE (YYYY-MM-DD)", "required": True,
                      "enum": [], "default": None}}},
]
NESTFUL_SPECS = [
    {"name": "SkyScrapperSearchAirport", "description": "Search for airports using a location name.",
     "query_parameters": {"query": {"type": "string", "description": "Name of the location.", "required": True}}},
    {"name": "SkyScrapperFlightSearch", "description": "Retrieves available flights for a given route.",
     "query_parameters": {
         "originSkyId": {"type": "string", "description": "From the Search Airport API.", "required": True},
         "destinationSkyId": {"type": "string", "description": "From the Search Airport API.", "required": True},
         "originEntityId": {"type": "string", "description": "From the Search Airport API.", "required": True},
         "destinationEntityId": {"type": "string", "description": "From the Search Airport API.", "required": True},
         "date": {"type": "string", "description": "Departure date. Format: YYYY-MM-DD", "required": True},
         "returnDate": {"type": "string", "description": "Return date. Format: YYYY-MM-DD", "required": False},
         "cabinClass": {"type": "string", "description": "Cabin class.", "default": "economy",
                        "enum": ["economy", "premium_economy", "business", "first"], "required": False},
         "adults": {"type": "number", "description": "Adults: 12+ years.", "default": 1, "required": False}}},
]
CFB_TOOLS = [openai_tool(spec) for spec in COMPLEXFUNCBENCH_SPECS]
NESTFUL_TOOLS = [openai_tool(spec) for spec in NESTFUL_SPECS]

# recorded answers, as json.dumps writes them (what the Qwen preset writes too)
CFB_ANSWERS = [
    {"name": "Search_Car_Location", "arguments": {"query": "San Diego Marriott La Jolla"}},
    {"name": "Search_Hotels", "arguments": {"dest_id": 2632, "search_type": "$var2.search_type$",
                                            "arrival_date": "2024-12-01", "departure_date": "2024-12-04",
                                            "adults": 4, "room_qty": 2, "sort_by": "popularity"}},
    {"name": "Get_Room_Availability", "arguments": {"hotel_id": "$var1.dest_id$", "min_date": "2024-11-01",
                                                    "max_date": "2024-11-10"}},
]
NESTFUL_ANSWERS = [
    {"name": "SkyScrapperSearchAirport", "arguments": {"query": "New York"}},
    {"name": "SkyScrapperFlightSearch", "arguments": {
        "originSkyId": "$var1.skyId$", "destinationSkyId": "$var2.skyId$", "originEntityId": "$var1.entityId$",
        "destinationEntityId": "$var2.entityId$", "date": "2024-08-15", "returnDate": "2024-08-18"}},
]


def answer_corpus() -> list[str]:
    """Text to train the test tokenizer on: the answers in their three wrappers, and the tools."""
    texts = []
    for answer in CFB_ANSWERS + NESTFUL_ANSWERS:
        call = json.dumps(answer)
        texts += [call, f"```json\n{call}\n```", f"<tool_call>\n{call}\n</tool_call>", json.dumps(answer, indent=2)]
    texts += [json.dumps(tool) for tool in CFB_TOOLS + NESTFUL_TOOLS]
    return texts * 3


def json_bpe_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's pre-tokenisation, as SmolLM2's and Qwen's) over the characters of the
    corpus, trained here: its merges span JSON punctuation (`": "`, `"}}`) as real tokenizers' do."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(answer_corpus(), trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


UNKNOWN = "<unk>"  # what PieceCodec encodes a character outside its pieces as


class PieceCodec:
    """A `TextCodec` over a fixed list of pieces (an id is its index), encoding by longest match: the
    pieces span JSON punctuation as BPE tokens do, and a random target's answers over them are full of
    braces, quotes, keys and names, so schema drafting engages (and its guesses break) all the time."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.ids = {piece: i for i, piece in enumerate(pieces)}
        self.longest = max(len(p) for p in pieces)

    def encode(self, text: str) -> list[int]:
        ids, at = [], 0
        while at < len(text):
            sizes = range(min(self.longest, len(text) - at), 0, -1)
            size = next((n for n in sizes if text[at : at + n] in self.ids), 1)
            ids.append(self.ids.get(text[at : at + size], self.ids[UNKNOWN]))
            at += size
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in token_ids)


# the tools list as the importers used to write it into the system prompt
OLD_STYLE_TOOLS = "Tools: " + json.dumps([{"name": "Search_Car_Location", "description": "",
                                            "parameters": {"query": {"type": "string", "required": True}}}])


def json_piece_codec(vocab_size: int) -> PieceCodec:
    """`vocab_size` pieces: three placeholders (the tiny targets' BOS and EOS ids, unknown), the characters of the
    recorded answers (and of OLD_STYLE_TOOLS and the wrappers), then JSON pieces."""
    answers = "".join(json.dumps(answer) for answer in CFB_ANSWERS + NESTFUL_ANSWERS)
    chars = sorted(set(answers + OLD_STYLE_TOOLS + "\n<>/`json"))
    pieces = ['{"', '": "', '", "', '"}', '"}}', '": {"', "name", "arguments", "query", "Search", "_Car", "_Location",
              "_Hotels", "Sky", "Scrapper", "sort_by", "popularity", "true", "false", "null", "```json\n", "\n```",
              "<tool_call>\n", "\n</tool_call>", ", ", ": ", "$var", "2024-"]
    vocabulary = ["<s>", "</s>", UNKNOWN, *chars, *pieces]
    assert len(vocabulary) <= vocab_size, len(vocabulary)
    return PieceCodec(vocabulary + [f"<unused{i}>" for i in range(vocab_size - len(vocabulary))])


def tool_call_conversations(codec: PieceCodec) -> list[tuple[list[int], list[int], list[dict] | None]]:
    """(prompt, answer, tools) of the recorded calls over `codec`: the user's values in the prompt, the call
    answered bare, in a fence after a sentence, or in tags; the last one's tools written in its prompt."""
    conversations = []
    calls = [(CFB_TOOLS, answer) for answer in CFB_ANSWERS] + [(NESTFUL_TOOLS, answer) for answer in NESTFUL_ANSWERS]
    for i, (tools, answer) in enumerate(calls):
        call = json.dumps(answer)
        written = (call, f"Calling it.\n```json\n{call}\n```", f"<tool_call>\n{call}\n</tool_call>")[i % 3]
        conversations.append((codec.encode(json.dumps(answer["arguments"]) + "\n"), codec.encode(written), tools))
    old_style = json.dumps({"name": "Search_Car_Location", "arguments": {"query": "New York"}})
    conversations.append((codec.encode(OLD_STYLE_TOOLS + "\nNew York\n"), codec.encode(old_style), None))
    return conversations


def teach_tool_calls(model: torch.nn.Module, codec: PieceCodec, steps: int, eos: int = 1) -> torch.nn.Module:
    """Train a tiny random target a little on `tool_call_conversations` (whole sequences, then EOS): its
    greedy answers then open calls and write keys and names, and still leave the schema often."""
    sequences = [prompt + answer + [eos] for prompt, answer, _ in tool_call_conversations(codec)]
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [eos] * (width - len(s)) for s in sequences])
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()
