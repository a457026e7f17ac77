"""Schema drafting: the forced text of each state of an answer, and its tokens as a BPE tokenizer writes them."""

from __future__ import annotations

import json

import pytest

from specstand.drafters import SequenceView, make_drafter, method_names
from specstand.drafters.json_parts import (
    BREAKS,
    FITS,
    QUOTED,
    answer_structure,
    copied_value,
    layout_rest,
    mentions,
    ranked_choice,
    tools_in_text,
    value_layout,
    words,
)
from specstand.drafters.json_reader import AnswerReader, Forced, forced_text
from specstand.drafters.schema import HFTextCodec, SchemaDrafter, continuation_tokens
from specstand.engine import Engine, EngineConfig, Request
from specstand.models.presets import is_fetched, preset_dir
from specstand.runner.hybrid import HybridModel
from tests.conftest import VOCAB, tiny_hybrid_hf_model
from tests.drafters.schema_fixtures import (
    CFB_ANSWERS,
    CFB_TOOLS,
    COMPLEXFUNCBENCH_SPECS,
    NESTFUL_ANSWERS,
    NESTFUL_TOOLS,
    json_bpe_tokenizer,
    json_piece_codec,
    teach_tool_calls,
    tool_call_conversations,
)


def forced_after(text: str, tools: list | None = CFB_TOOLS, response_format: dict | None = None) -> str:
    reader = AnswerReader(answer_structure(tools, response_format))
    reader.feed(text)
    return forced_text(reader, 400).text


def test_the_call_object_forces_its_keys_and_a_function_name_once_its_prefix_is_unique():
    assert forced_after("{") == '"name": "'
    assert forced_after('{"name": "Search_') == ""  # Search_Car_Location or Search_Hotels
    assert forced_after('{"name": "Search_C') == 'ar_Location", "arguments": {"query": "'
    # Search_Hotels' first required parameter in schema order, then its value's opening quote
    assert forced_after('{"name": "Search_H') == 'otels", "arguments": {"search_type": "'
    assert forced_after('{"name": "G') == 'et_Room_Availability", "arguments": {"min_date": "'


def test_keys_values_and_closings_inside_the_arguments():
    start = '{"name": "Search_Hotels", "arguments": {"dest_id": 2632, '
    assert forced_after(start) == '"search_type": "'  # the next required key
    assert forced_after(start + '"arr') == 'ival_date": "'  # a key's unique prefix
    assert forced_after(start + '"search_type": "x"') == ', "arrival_date": "'
    full = start + '"search_type": "x", "arrival_date": "a", "departure_date": "b"'
    assert forced_after(full) == ""  # optional keys left: ',' or '}'
    assert forced_after(full + ', "sort_by": "pop') == 'ularity"'  # a unique enum value
    assert forced_after(full + ', "sort_by": "class_') == ""  # class_descending or class_ascending
    assert forced_after(full + ', "sort_by": "c') == 'lass_'  # their common part
    assert forced_after(full + ', "adults": 2') == ""  # a number goes on or ends: free
    everything = full + ', "adults": 2, "room_qty": 1, "sort_by": "price"'
    assert forced_after(everything) == "}}"  # every parameter written


def test_wrappers_prose_before_the_json_and_the_closing():
    answer = json.dumps(CFB_ANSWERS[0])
    assert forced_after("I will look it up.\n```js") == 'on\n{"name": "'
    assert forced_after("```json\n" + answer) == "\n```"
    assert forced_after("<tool_call>", NESTFUL_TOOLS) == '\n{"name": "SkyScrapper'
    assert forced_after("<tool_call>\n" + answer) == "\n</tool_call>"
    assert forced_after("<tool_call>\n" + answer + "\n</tool") == "_call>"
    assert forced_after("Sure: <tool_") == 'call>\n{"name": "'
    assert forced_after(answer) == ""  # a bare object closes the answer's JSON
    assert forced_after("Let me think") == ""


def test_whitespace_follows_what_the_answer_wrote():
    compact = '{"name":"Search_Car_Location",'
    assert forced_after(compact) == '"arguments":{"query":"'
    indented = '{\n  "name": "Search_Car_Location",\n'
    # json.dumps(indent=2): the rest of the line's indentation, the next key, and one level deeper inside
    assert forced_after(indented) == '  "arguments": {\n    "query": "'
    assert forced_after(indented + '  "arguments": {\n    "query": "Paris"') == "\n  }\n}"
    assert forced_after('{\n\t"name": "Search_Car_Location",\n') == '\t"arguments": {\n\t\t"query": "'
    assert forced_after('{\n\n  "name": "Search_Car_Location",\n') == '  "arguments": {\n    "query": "'
    # a line break whose indentation does not divide into levels leaves it unknown
    assert forced_after('{"name": "Search_Car_Location", "arguments": {\n   "query": "Paris",\n') == ""
    # a first call whose braces open on the same line but whose commas break it: the commas' own gap
    odd = '{"name": "Search_Car_Location",\n  "arguments": {"query": "Paris"'
    assert forced_after(odd) == "}}"


def test_literals_nested_objects_and_arrays():
    schema = {"type": "object", "required": ["flags", "where"], "properties": {
        "flags": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "boolean"}},
        "where": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
        "note": {"type": "null"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert forced_after("{", None, fmt) == '"flags": ['
    assert forced_after('{"flags": [t', None, fmt) == "rue"
    assert forced_after('{"flags": [true, f', None, fmt) == 'alse], "where": {"city": "'  # maxItems reached
    assert forced_after('{"flags": [true]', None, fmt) == ', "where": {"city": "'
    assert forced_after('{"flags": [true], "where": {"city": "Paris"', None, fmt) == "}"
    assert forced_after('{"flags": [true], "where": {"city": "Paris"}, "n', None, fmt) == 'ote": null}'
    assert forced_after("{", None, {"type": "json_object"}) == ""  # any object: no key is known


def test_an_answer_that_leaves_the_schema_is_read_as_prose_until_the_next_json():
    assert forced_after('{"name": 5') == ""
    assert forced_after('{"name": 5 then {') == '"name": "'
    assert forced_after('{"name": "Search_Car_Location" "') == ""


def test_tools_written_in_a_prompt():
    old_system = ('You are a function-calling agent. Available tools (JSON):\n[{"name": "Weather", "description": "", '
                  '"parameters": {"city": {"type": "string", "required": true}, "days": {"type": "number", '
                  '"required": false}}}]\nGiven the user\'s request ...')
    structure = answer_structure(None, None, old_system)
    assert structure.functions["Weather"]["required"] == ["city"]
    assert forced_after("{", tools_in_text(old_system)) == '"name": "Weather", "arguments": {"city": "'
    template = "<tools>\n" + "\n".join(json.dumps(t) for t in CFB_TOOLS) + "\n</tools>"
    assert [t["function"]["name"] for t in tools_in_text(template)] == [s["name"] for s in COMPLEXFUNCBENCH_SPECS]
    assert answer_structure(None, None, "no tools here [1, 2]") is None


def _tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize(("parameters", "answer"), [
    # draft 3's `"required": true` on a property, and other values that are no list of names
    ({"type": "object", "properties": {"o": {"type": "object", "required": True, "properties": {"a": {}}}}},
     '{"name": "f", "arguments": {"o": {"a": "x"}}}'),
    ({"type": "object", "required": 5, "properties": {"a": {"type": "string"}}},
     '{"name": "f", "arguments": {"a": "x"}}'),
    ({"type": "object", "properties": {"xs": {"type": "array", "maxItems": "2", "minItems": "1", "items": {}}}},
     '{"name": "f", "arguments": {"xs": ["a", "b"]}}'),
    ({"type": "object", "properties": {"v": {"type": [{"type": "string"}]}}}, '{"name": "f", "arguments": {"v": "x"}}'),
])
def test_odd_tool_schemas_from_a_client_draft_without_raising(parameters, answer):
    """The server passes a client's tools on as they come: a schema drafter must draft what it can of them,
    never fail the request (each of these raised TypeError)."""
    codec = CharCodec()
    drafter = SchemaDrafter(codec)
    seq = SequenceView(1, codec.encode("call it"), 7, 0.0, _tool(parameters))
    drafter.begin(seq)
    for char in answer:
        drafter.propose(seq, 5)
        seq.token_ids.append(ord(char))
        drafter.extend(seq, [ord(char)])
    assert forced_after("{", _tool(parameters)) == '"name": "f", "arguments": {'


def test_array_bounds_that_are_no_counts_force_nothing():
    def array(**bounds):
        return _tool({"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "string"}, **bounds}}})

    assert forced_after('{"name": "f", "arguments": {"xs": [', array(minItems=1)) == '"'  # an item must come
    assert forced_after('{"name": "f", "arguments": {"xs": [', array(minItems=-1)) == ""  # -1 forced one too


@pytest.mark.parametrize("prompt", [
    '[{"a": ' + "[" * 5000 + "]" * 5000 + "}]",  # nested past Python's recursion limit
    "<tools>\n" + "[" * 5000 + "]" * 5000 + "\n</tools>",
    'data: [{"id": ' + "7" * 5000 + "}]",  # an integer past Python's 4300-digit limit for int()
    "<tools>\n" + "7" * 5000 + "\n</tools>",
])
def test_prompt_json_python_cannot_read_is_no_tools(prompt):
    assert tools_in_text(prompt) is None


@pytest.mark.parametrize(("tools", "answers"), [(CFB_TOOLS, CFB_ANSWERS), (NESTFUL_TOOLS, NESTFUL_ANSWERS)])
def test_forced_text_is_what_real_answers_write(tools, answers):
    """Along every prefix of recorded answers, forced text parts from what the answer writes only where it
    guessed a required key's name (models may order them otherwise); most of the answer is forced."""
    forced_chars = 0
    for answer in answers:
        text = "```json\n" + json.dumps(answer) + "\n```"
        for cut in range(len(text)):
            forced = forced_after(text[:cut], tools)
            agreed = next((i for i, (a, b) in enumerate(zip(forced, text[cut:], strict=False)) if a != b), len(forced))
            assert agreed == len(forced) or (text[:cut] + forced[:agreed]).endswith(('{"', ', "')), (text[:cut], forced)
            forced_chars += agreed > 0
    assert forced_chars > sum(len(json.dumps(a)) for a in answers) // 2


def _canonical_drafts(codec: HFTextCodec, tools: list, text: str) -> tuple[int, int]:
    """For every token boundary of `text` encoded, the forced tokens the drafter proposes there, checked to
    be the next tokens of that encoding where the forced text is what follows; (tokens drafted, boundaries)."""
    ids = codec.encode(text)
    drafter = SchemaDrafter(codec)
    seq = SequenceView(0, [0], 1, tools=tools)
    drafter.begin(seq)
    drafted = 0
    for cut in range(len(ids)):
        seq.token_ids = [0, *ids[:cut]]
        forced = drafter._forced_tokens(seq)
        written = codec.decode(ids[:cut])
        if text[len(written) :].startswith(codec.decode(forced)):
            assert forced == ids[cut : cut + len(forced)], (written, codec.decode(forced))
        drafted += len(forced)
    return drafted, len(ids)


@pytest.mark.parametrize("vocab_size", [96, 400])
def test_forced_tokens_are_the_tokenizers_own_at_every_boundary(vocab_size):
    codec = HFTextCodec(json_bpe_tokenizer(vocab_size))
    drafted = boundaries = 0
    for tools, answers in ((CFB_TOOLS, CFB_ANSWERS), (NESTFUL_TOOLS, NESTFUL_ANSWERS)):
        for answer in answers:
            for text in (json.dumps(answer), "<tool_call>\n" + json.dumps(answer) + "\n</tool_call>"):
                d, b = _canonical_drafts(codec, tools, text)
                drafted, boundaries = drafted + d, boundaries + b
    assert drafted > boundaries  # several forced tokens per boundary on average


def test_tokens_that_what_follows_could_change_are_not_drafted():
    codec = HFTextCodec(json_bpe_tokenizer(400))
    head = codec.encode('{"name": "Search_Car_Location", "arguments":')
    # ' {"' is one token in this vocabulary: the ' ' after a colon would be a wrong draft
    assert len(codec.encode(' {"')) == 1
    assert continuation_tokens(codec, head, Forced(" ", None), 8) == []
    # where anything may follow, the last token is never drafted
    assert codec.decode(continuation_tokens(codec, head, Forced(' {"query": "', None), 8)) == ' {"query":'
    # where every follower is known (names left by a prefix), tokens stable across all of them are drafted
    name = codec.encode('{"name": "')
    names = Forced("Search_", ('Car_Location"', 'Hotels"'))
    assert codec.decode(continuation_tokens(codec, name, names, 8)) == "Search_"
    # an answer split unlike the tokenizer would split it: where its next token starts is unknown
    split = [t for ch in '{"na' for t in codec.encode(ch)]
    assert continuation_tokens(codec, split, Forced('me": "', None), 8) == []


def test_drafts_go_on_by_suffix_decoding_and_carry_confidence():
    codec = HFTextCodec(json_bpe_tokenizer(400))
    earlier = json.dumps(CFB_ANSWERS[0])
    prompt = codec.encode("Book near San Diego Marriott La Jolla. Earlier: " + earlier + "\n")
    drafter = SchemaDrafter(codec)
    answer = codec.encode('{"name": "Search_Car_')
    seq = SequenceView(3, prompt + answer, len(prompt), tools=CFB_TOOLS)
    drafter.begin(seq)
    draft = drafter.propose(seq, 12)
    text = codec.decode(draft.tokens)
    forced = codec.encode('Location", "arguments": {"query":')
    assert draft.tokens[: len(forced)] == forced and draft.confidence[: len(forced)] == [1.0] * len(forced)
    assert text.startswith('Location", "arguments": {"query": "San Diego')  # copied from the earlier answer
    assert len(draft.confidence) == len(draft.tokens) and all(0 < c <= 1 for c in draft.confidence)
    # inside a free value: suffix decoding alone
    seq.token_ids = prompt + codec.encode('{"name": "Search_Car_Location", "arguments": {"query": "San')
    assert codec.decode(drafter.propose(seq, 4).tokens).startswith(" Diego")
    drafter.end(seq)
    assert drafter._answers == {} and drafter.suffix._local == {}


def schema_draft(codec, prompt: str, answer: str, tokens: int):
    """The schema drafter's draft after `answer`, for a request with CFB_TOOLS and `prompt`."""
    prompt_ids = codec.encode(prompt)
    seq = SequenceView(0, prompt_ids + codec.encode(answer), len(prompt_ids), tools=CFB_TOOLS)
    drafter = SchemaDrafter(codec)
    drafter.begin(seq)
    return drafter.propose(seq, tokens)


def test_where_a_copied_value_ends_the_schemas_next_key_takes_over():
    codec = json_piece_codec(200)
    draft = schema_draft(codec, '{"search_type": "LAND", "zone": 1}\n',
                         '{"name": "Search_Hotels", "arguments": {"search_type": "', 20)
    # suffix decoding copies the value and would go on with "zone"; the next required key follows instead
    assert codec.decode(draft.tokens).startswith('LAND", "arrival_date')
    assert len(draft.confidence) == len(draft.tokens) and draft.confidence == sorted(draft.confidence, reverse=True)


def fit_after(text: str, then: str) -> int:
    reader = AnswerReader(answer_structure(CFB_TOOLS, None))
    reader.feed(text)
    return reader.fit(then)


def test_how_guessed_text_fits_the_schema():
    start = '{"name": "Search_Hotels", "arguments": {"dest_id": 2632, '
    assert fit_after(start, '"search_type": "CITY", "adu') == FITS
    assert fit_after(start, '"dest_id": 1') == BREAKS  # a key already written
    assert fit_after(start, '"query": "') == BREAKS  # a key of another function
    assert fit_after(start, '"adults": {"type"') == BREAKS  # a number opened as an object: the schema copied
    assert fit_after(start, '"adults": "$var1.adults$"') == QUOTED  # a string where the schema says number
    assert fit_after(start, '"search_type": "string"') == BREAKS  # a type name as the value: the schema copied
    assert fit_after(start, '"sort_by": "pop') == FITS
    assert fit_after(start, '"sort_by": "cheap') == BREAKS  # no enum value starts so
    assert fit_after(start, '"adults": 2}}') == FITS
    assert fit_after(start, '"adults": 2]') == BREAKS  # JSON syntax
    assert fit_after("Let me search.", " Then {") == FITS  # prose, then the call opens
    reader = AnswerReader(answer_structure(CFB_TOOLS, None))
    reader.feed(start)
    reader.fit('"query": "')
    assert forced_text(reader, 100).text == '"search_type": "'  # fit() leaves the reader where it was
    assert not reader.strayed
    reader.feed('"adults": "$var1.adults$", ')
    assert not reader.strayed  # a string stands for any type
    reader.feed('"type": "object"')
    assert reader.strayed  # a key Search_Hotels does not have: the answer follows something else


class CharCodec:
    """One token per character: suffix matches see the text as it is written."""

    def encode(self, text: str) -> list[int]:
        return [ord(char) for char in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(map(chr, token_ids))


def test_suffix_guesses_give_way_to_text_that_fits_the_schema():
    """The prompt's tool definitions say `"adults": {"type": "number"` twice; an earlier answer wrote a number
    there once. Suffix decoding alone copies the definitions (the likelier continuation); within the schema it
    takes the answer's."""
    codec = CharCodec()
    prompt = '"adults": {"type": "number"}, "adults": {"type": "number"}\nearlier: {"room_qty": 1, "adults": 2}\n'
    answer = '{"name": "Search_Hotels", "arguments": {"adults":'
    seq = SequenceView(0, codec.encode(prompt + answer), len(prompt), tools=CFB_TOOLS)
    suffix = make_drafter("suffix")
    suffix.begin(seq)
    assert codec.decode(suffix.propose(seq, 4).tokens) == ' {"t'
    assert codec.decode(schema_draft(codec, prompt, answer, 4).tokens).startswith(" 2")


def test_values_copied_from_the_prompts_text():
    words = "Find news about politics in India, about Politics too."
    assert copied_value(words, "string", "pol") == ('itics"', 1.0)  # to the end of the word, then the quote
    assert copied_value(words, "string", "olit") is None  # only where a word starts
    assert copied_value('{"product_id": "WH-1000XM4 Pro", "page": 1}', "string", "WH") == ('-1000XM4 Pro"', 1.0)
    assert copied_value("near 34.0522, -118.2437 at 2024-11-25", "scalar", "34") == (".0522", 1.0)
    assert copied_value("near 34.0522, -118.2437", "scalar", "4") is None  # inside another number
    assert copied_value("on 2024-11-25 or 2024-11-27, else 2024-11-25 then", "string", "2024") == ('-11-25"', 2 / 3)
    assert copied_value("politics", "string", "politics") is None  # nothing left to write


def test_a_value_the_prompt_splits_into_other_tokens_is_copied_by_its_text():
    codec = json_piece_codec(300)
    draft = schema_draft(codec, "Find news about politics in India.\n",
                         '{"name": "Search_Car_Location", "arguments": {"query": "pol', 8)
    assert codec.decode(draft.tokens).startswith("itics")


def test_names_are_read_as_words():
    assert words("Vehicle_Supplier_Ratings") == ["vehicle", "supplier", "rating"]
    assert words("RedditTopPostsBySubreddit") == ["reddit", "top", "post", "by", "subreddit"]
    assert words("Alpha_Vantage_CURRENCY_EXCHANGE_RATE") == ["alpha", "vantage", "currency", "exchange", "rate"]
    assert words("Real-Time product offers, 2 of them") == ["real", "time", "product", "offer", "of", "them"]


def test_the_prompts_words_outside_the_definitions_rank_the_function_names():
    names = [tool["function"]["name"] for tool in CFB_TOOLS]
    prompt = json.dumps(CFB_TOOLS) + "\nI want to rent a car at the airport: find its location."
    spoken, called = mentions(prompt, CFB_TOOLS, names)
    assert spoken["location"] == 1 and spoken["hotel"] == 0  # the definitions' own words are not counted
    assert ranked_choice(spoken, called, "", names) == ('Search_Car_Location"', 1.0)
    assert ranked_choice(spoken, called, "Search_", names) == ('Car_Location"', 1.0)
    assert ranked_choice(spoken, called, "Search_C", names) is None  # one name left: forced, not chosen
    # nothing said of any of them: no choice
    silent, none_called = mentions(json.dumps(CFB_TOOLS) + "\nHello.", CFB_TOOLS, names)
    assert ranked_choice(silent, none_called, "", names) is None
    # the name of a call written earlier is not the user's words, and a function called is likelier done with
    later = (json.dumps(CFB_TOOLS) + '\nI want to rent a car.\n{"name": "Search_Car_Location", "arguments": '
             '{"query": "JFK"}}\nNow the rooms of a hotel.')
    spoken, called = mentions(later, CFB_TOOLS, names)
    assert called["Search_Car_Location"] == 1 and spoken["search"] == 0 and spoken["car"] == 1
    assert ranked_choice(spoken, called, "", names) is None  # rooms and hotel: two names alike, no start shared
    assert ranked_choice(spoken, called, "Search_", names) == ('Hotels"', 0.5)  # car: but called already


def test_candidates_spoken_of_alike_draft_the_start_they_share():
    offered = ["Shop_Search", "Shop_Product_Offers", "Shop_Product_Reviews"]
    spoken, called = mentions("Find the best offers and reviews for these headphones.", None, offered)
    assert ranked_choice(spoken, called, "Shop_", offered) == ("Product_", 1.0)
    assert ranked_choice(spoken, called, "Shop_Product_", offered) is None


def test_optional_arguments_are_guessed_in_schema_order():
    reader = AnswerReader(answer_structure(CFB_TOOLS, None))
    reader.feed('{"name": "Search_Hotels", "arguments": {"sort_by": "price", "search_type": "CITY", "')
    assert reader.key_in_order() is None  # a required key is next: forced
    reader.feed('arrival_date": "a", "dest_id": 1, "departure_date": "b", "')
    assert reader.key_in_order() is None  # nothing after the last key written in the schema's order
    reader = AnswerReader(answer_structure(CFB_TOOLS, None))
    reader.feed('{"name": "Search_Hotels", "arguments": {"search_type": "CITY", "arrival_date": "a", '
                '"dest_id": 1, "departure_date": "b", "sort_by": "price", "')
    assert reader.key_in_order() is None  # departure_date is last in the schema
    reader = AnswerReader(answer_structure(NESTFUL_TOOLS, None))
    reader.feed('{"name": "SkyScrapperFlightSearch", "arguments": {"originSkyId": "a", "destinationSkyId": "b", '
                '"originEntityId": "c", "destinationEntityId": "d", "date": "e", "')
    assert reader.key_in_order() == ("", "returnDate")
    reader.feed("cab")
    assert reader.key_in_order() == ("cab", "cabinClass")


def test_a_date_or_time_layout_the_description_spells():
    assert value_layout({"type": "string", "description": "Drop off date\nFormat: **YYYY-MM-DD**DATE (YYYY-MM-DD)"}) \
        == "YYYY-MM-DD"
    assert value_layout({"type": "string", "description": "Format: **HH:MM**. TIME (24-hour HH:MM)"}) == "HH:MM"
    assert value_layout({"type": "string", "format": "date"}) == "YYYY-MM-DD"
    assert value_layout({"type": "string", "description": "YYYY-MM-DD or MM/DD/YYYY"}) is None  # which one: not said
    assert value_layout({"type": "string", "description": "HHMM, a YEAR-MODE or MMM"}) is None  # no layout
    assert layout_rest("YYYY-MM-DD", "2024") == "-"
    assert layout_rest("YYYY-MM-DD", "2024-1") is None  # a digit comes next
    assert layout_rest("YYYY-MM-DD", "2024-11-25") == '"'
    assert layout_rest("HH:MM", "9:") is None  # the answer wrote another layout
    assert layout_rest("YYYY-MM-DD", "") is None
    # a copy from the prompt keeps to the layout: its start that does, where the prompt's word goes on otherwise
    text = "A 24-hour rental from November 5, 2024, with 24-hour support."
    assert copied_value(text, "string", "2") == ('4-hour"', 2 / 3)
    assert copied_value(text, "string", "2", layout="YYYY-MM-DD") == ("4", 2 / 3)  # "24" may start a year
    assert copied_value(text, "string", "20") == ('24"', 1.0)
    assert copied_value(text, "string", "20", layout="YYYY-MM-DD") == ("24", 1.0)  # the month is to come
    assert copied_value("on 2024-11-25, fine", "string", "2024-11", layout="YYYY-MM-DD") == ('-25"', 1.0)


def test_a_laid_out_values_separators_and_its_end_are_drafted():
    codec = CharCodec()
    answer = '{"name": "Get_Room_Availability", "arguments": {"hotel_id": 7, "min_date": "2024'
    draft = schema_draft(codec, "Which rooms are free?\n", answer, 12)
    assert codec.decode(draft.tokens) == "-"  # the month's digits are the model's
    assert draft.confidence == [SchemaDrafter(codec).config.layout_confidence]
    draft = schema_draft(codec, "Which rooms are free?\n", answer + "-11-01", 20)
    assert codec.decode(draft.tokens).startswith('", "max_date": "')  # its end, then the structure's next key
    # suffix guesses keep to the layout: the prompt's "2024 11" would put a space where a separator goes
    assert fit_after('{"name": "Search_Hotels", "arguments": {"arrival_date": "2024', " 11") == BREAKS
    assert fit_after('{"name": "Search_Hotels", "arguments": {"arrival_date": "2024', "-11-01") == FITS
    assert fit_after('{"name": "Search_Hotels", "arguments": {"arrival_date": "Dec', "ember 1") == FITS  # not laid out


def test_the_name_and_arguments_the_request_implies_are_drafted():
    codec = CharCodec()
    prompt = json.dumps(CFB_TOOLS) + "\nWhich rooms are free next week?\n"
    draft = schema_draft(codec, prompt, '{"name": "', 60)
    assert codec.decode(draft.tokens).startswith('Get_Room_Availability", "arguments": {"min_date": "')
    assert draft.confidence[0] == 1.0  # the only name the prompt speaks of
    prompt_ids = codec.encode("Fly from A to B on e.\n")
    answer = ('{"name": "SkyScrapperFlightSearch", "arguments": {"originSkyId": "a", "destinationSkyId": "b", '
              '"originEntityId": "c", "destinationEntityId": "d", "date": "e", "')
    seq = SequenceView(0, prompt_ids + codec.encode(answer), len(prompt_ids), tools=NESTFUL_TOOLS)
    drafter = SchemaDrafter(codec)
    drafter.begin(seq)
    optional = drafter.propose(seq, 12)
    assert codec.decode(optional.tokens).startswith('returnDate"')  # the next optional argument in schema order
    assert optional.confidence[0] == drafter.config.key_order_confidence


def test_schema_is_a_method_and_needs_the_tokenizer():
    assert "schema" in method_names()
    with pytest.raises(ValueError, match="tokenizer"):
        make_drafter("schema")
    assert isinstance(make_drafter("schema", tokenizer=json_bpe_tokenizer(96)), SchemaDrafter)


@pytest.mark.parametrize("preset", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_forced_tokens_on_a_presets_tokenizer(preset):
    if not is_fetched(preset):
        pytest.skip(f"the {preset} preset is not fetched")
    from transformers import AutoTokenizer

    codec = HFTextCodec(AutoTokenizer.from_pretrained(preset_dir(preset)))
    drafted = boundaries = 0
    for answer in CFB_ANSWERS:
        call = json.dumps(answer)
        for text in (f"I will search.\n```json\n{call}\n```", f"<tool_call>\n{call}\n</tool_call>"):
            d, b = _canonical_drafts(codec, CFB_TOOLS, text)
            drafted, boundaries = drafted + d, boundaries + b
    assert drafted > boundaries


def test_forced_drafts_are_accepted_where_the_target_writes_calls():
    """A tiny target taught the recorded calls writes them (and leaves the schema at times): schema drafting
    answers as plain decoding does, in far fewer passes than suffix decoding alone."""
    codec = json_piece_codec(VOCAB)
    model = HybridModel(teach_tool_calls(tiny_hybrid_hf_model("lfm2"), codec, steps=40), 512)
    requests = [Request(prompt, 60, tools=tools) for prompt, _, tools in tool_call_conversations(codec)]
    drafters = {"none": None, "suffix": make_drafter("suffix"), "schema": SchemaDrafter(codec)}
    runs = {method: Engine(model, drafter, EngineConfig(5, 512, 3, adaptive=False)).generate(requests)
            for method, drafter in drafters.items()}
    assert [r.output_ids for r in runs["schema"]] == [r.output_ids for r in runs["none"]]
    passes = {method: sum(r.stats.target_passes for r in results) for method, results in runs.items()}
    assert passes["schema"] < 0.8 * passes["suffix"], passes
