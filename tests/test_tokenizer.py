"""Tokenizer, chat template and the packaged stand-in tokenizers."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ninfer_runtime.profiles import get_profile
from ninfer_runtime.tokenizer import ChatTemplateError, Tokenizer, TokenizerError, load_standin

# The Qwen3.5 special tokens and their real ids (qwen_arch.md §5).
QWEN_SPECIAL_IDS = {
    "<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
    "<|object_ref_start|>": 248047, "<|object_ref_end|>": 248048, "<|box_start|>": 248049,
    "<|box_end|>": 248050, "<|quad_start|>": 248051, "<|quad_end|>": 248052,
    "<|vision_start|>": 248053, "<|vision_end|>": 248054, "<|vision_pad|>": 248055,
    "<|image_pad|>": 248056, "<|video_pad|>": 248057, "<tool_call>": 248058,
    "</tool_call>": 248059, "<|fim_prefix|>": 248060, "<|fim_middle|>": 248061,
    "<|fim_suffix|>": 248062, "<|fim_pad|>": 248063, "<|repo_name|>": 248064,
    "<|file_sep|>": 248065, "<tool_response>": 248066, "</tool_response>": 248067,
    "<think>": 248068, "</think>": 248069,
}
TINY_OFFSET = 247044  # tiny id = real id - 247044
ID_SHIFT = {"tiny": TINY_OFFSET, "qwen": 0}

UNICODE_TEXT = ("Grüße aus Köln! naïve café, 東京で寿司を食べた 🍣🚀 — “quotes” ½ √2 ≈ 1.414\n"
                "def f(x):\n\treturn x ** 2  # Привет, мир\n")


@pytest.fixture(scope="module", params=["tiny", "qwen"])
def standin(request: pytest.FixtureRequest) -> tuple[str, Tokenizer]:
    tokenizer_json, template = load_standin(request.param)
    return request.param, Tokenizer.from_json(tokenizer_json, template)


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_json(*load_standin("tiny"))


# ----- encode / decode ---------------------------------------------------------------------------

def test_unicode_round_trip(standin: tuple[str, Tokenizer]) -> None:
    _, tok = standin
    ids = tok.encode(UNICODE_TEXT)
    assert len(ids) > 40  # a 1000-id BPE spells most of this out in pieces
    assert tok.decode(ids) == UNICODE_TEXT


def test_normalizes_to_nfc(tiny: Tokenizer) -> None:
    assert tiny.encode("cafe\u0301") == tiny.encode("caf\u00e9")


def test_special_tokens_encode_to_their_ids(standin: tuple[str, Tokenizer]) -> None:
    kind, tok = standin
    for text, real_id in QWEN_SPECIAL_IDS.items():
        expected = real_id - ID_SHIFT[kind]
        assert tok.token_id(text) == expected, text
        assert tok.encode(text) == [expected], text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == tok.token_id("<|im_start|>")
    assert tok.token_id("<|im_end|>") in ids


def test_tiny_special_ids_match_the_tiny_profiles(tiny: Tokenizer) -> None:
    expected = {"<|endoftext|>": 1000, "<|im_start|>": 1001, "<|im_end|>": 1002,
                "<|vision_start|>": 1009, "<|vision_end|>": 1010, "<|image_pad|>": 1012,
                "<|video_pad|>": 1013, "<think>": 1024, "</think>": 1025}
    assert {text: tiny.token_id(text) for text in expected} == expected


def test_variants_share_the_regular_vocabulary() -> None:
    tiny, qwen = (Tokenizer.from_json(load_standin(kind)[0]) for kind in ("tiny", "qwen"))
    ids = tiny.encode(UNICODE_TEXT)
    assert qwen.encode(UNICODE_TEXT) == ids
    assert max(ids) < 1000
    assert (tiny.vocab_size, qwen.vocab_size) == (1026, 248070)


def test_tiny_profiles_use_the_tiny_tokenizer_ids(tiny: Tokenizer) -> None:
    for name in ("tiny_dense", "tiny_moe"):
        profile = get_profile(name)
        hf = profile.hf_config
        assert hf["image_token_id"] == tiny.token_id("<|image_pad|>")
        assert hf["video_token_id"] == tiny.token_id("<|video_pad|>")
        assert hf["vision_start_token_id"] == tiny.token_id("<|vision_start|>")
        assert hf["vision_end_token_id"] == tiny.token_id("<|vision_end|>")
        assert hf["text_config"]["eos_token_id"] == tiny.token_id("<|endoftext|>")
        assert tiny.vocab_size <= hf["text_config"]["vocab_size"]
        with_generation = Tokenizer.from_json(load_standin("tiny")[0], None,
                                              profile.generation_config)
        assert with_generation.eos_token_ids == (tiny.token_id("<|im_end|>"),
                                                 tiny.token_id("<|endoftext|>"))


def test_skip_special_tokens_keeps_think_and_tool_markers(tiny: Tokenizer) -> None:
    ids = tiny.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>x<|im_end|>")
    assert tiny.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>\nhm\n</think>\n\n<tool_call>x")


def test_eos_token_ids() -> None:
    tokenizer_json = load_standin("qwen")[0]
    assert Tokenizer.from_json(tokenizer_json).eos_token_ids == (248046, 248044)
    assert Tokenizer.from_json(tokenizer_json, None, {"eos_token_id": 7}).eos_token_ids == (7,)
    assert Tokenizer.from_json(tokenizer_json, None,
                               {"eos_token_id": [248046]}).eos_token_ids == (248046,)
    with pytest.raises(TokenizerError, match="eos_token_id"):
        Tokenizer.from_json(tokenizer_json, None, {"eos_token_id": ["<|im_end|>"]})


def test_bad_inputs_raise_typed_errors(tiny: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="not a token"):
        tiny.token_id("<|no_such_token|>")
    with pytest.raises(TokenizerError, match="not a valid tokenizer"):
        Tokenizer.from_json('{"model": 3}')
    with pytest.raises(ChatTemplateError, match="line 1"):
        Tokenizer.from_json(load_standin("tiny")[0], "{% if %}")
    with pytest.raises(ValueError, match="unknown stand-in"):
        load_standin("huge")  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Artifact:
    tokenizer_json: str | None
    chat_template: str | None
    generation_config: dict[str, Any] | None


def test_from_artifact() -> None:
    tokenizer_json, template = load_standin("qwen")
    tok = Tokenizer.from_artifact(_Artifact(tokenizer_json, template, {"eos_token_id": [248046]}))
    assert tok.eos_token_ids == (248046,)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<think>\n")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_artifact(_Artifact(None, template, None))


# ----- streaming detokenizer ---------------------------------------------------------------------

@pytest.mark.parametrize("step", [1, 3])
def test_incremental_detokenizer_never_splits_a_character(standin: tuple[str, Tokenizer],
                                                          step: int) -> None:
    _, tok = standin
    text = "<|im_start|>" + UNICODE_TEXT + "<|im_end|>"
    ids = tok.encode(text)
    # The test only means something if some tokens end inside a character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = tok.detokenizer()
    pieces = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + detok.flush() == text
    assert "".join(pieces) == text  # the text ends on a whole character: nothing held back


def test_incremental_detokenizer_skips_specials_and_flushes_a_cut_character(
        tiny: Tokenizer) -> None:
    ids = tiny.encode("<|im_start|>ok 🚀")
    detok = tiny.detokenizer(skip_special_tokens=True)
    assert detok.add(ids[:-1]) == "ok "  # the rocket's last byte is still missing
    assert detok.flush().startswith("\ufffd")


def test_incremental_detokenizer_passes_a_real_replacement_character(tiny: Tokenizer) -> None:
    text = "a\ufffdb\ufffd"
    detok = tiny.detokenizer()
    pieces = [detok.add([i]) for i in tiny.encode(text)]
    assert "".join(pieces) + detok.flush() == text


# ----- chat template -----------------------------------------------------------------------------

TOOLS_PREAMBLE = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & '
    'in °C", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n'
    "</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is no "
    "function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n</IMPORTANT>"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_plain_chat_thinking_on_and_off(tiny: Tokenizer) -> None:
    messages = [{"role": "user", "content": "  Hello!\n"}]
    assert tiny.apply_chat_template(messages) == (
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert tiny.apply_chat_template(messages, enable_thinking=False) == (
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tiny.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nHello!<|im_end|>\n")


def test_system_prompt(tiny: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tiny.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")


def test_tools_tool_call_and_tool_response(tiny: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Köln?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two cities.",
         "tool_calls": [
             {"id": "1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
             {"id": "2", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Köln", "ok": True}}}]},
        {"role": "tool", "tool_call_id": "1", "content": '{"temp": 18}'},
        {"role": "tool", "tool_call_id": "2", "content": "sunny"},
    ]
    assert tiny.apply_chat_template(messages, tools=TOOLS) == (
        TOOLS_PREAMBLE + "\n\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Köln?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nKöln\n</parameter>\n"
        "<parameter=ok>\ntrue\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 18}\n</tool_response>\n"
        "<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    assert messages[2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # not mutated


def test_tools_without_system_message_and_call_after_text(tiny: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]},
    ]
    assert tiny.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False) == (
        TOOLS_PREAMBLE + "<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nLet me check.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n")


def test_reasoning_kept_only_after_the_last_user_query(tiny: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"},
    ]
    assert tiny.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6<|im_end|>\n")
    preserved = tiny.apply_chat_template(messages[:2], add_generation_prompt=False,
                                         preserve_thinking=True)
    assert preserved.endswith("<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4"
                              "<|im_end|>\n")


def test_images_and_videos(tiny: Tokenizer) -> None:
    messages = [{"role": "user", "content": [
        {"type": "image", "image": "a.png"}, {"type": "text", "text": "and"},
        {"type": "video", "video": "b.mp4"}]}]
    assert tiny.apply_chat_template(messages, add_generation_prompt=False,
                                    add_vision_id=True) == (
        "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>and"
        "Video 1: <|vision_start|><|video_pad|><|vision_end|><|im_end|>\n")


@pytest.mark.parametrize("messages, match", [
    ([], "No messages"),
    ([{"role": "system", "content": "x"}], "No user query"),
    ([{"role": "robot", "content": "x"}, {"role": "user", "content": "x"}], "role: robot"),
    ([{"role": "system", "content": [{"type": "image", "image": "a"}]},
      {"role": "user", "content": "x"}], "cannot contain images"),
    ([{"role": "user", "content": "x"},
      {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{oops"}]}], "not JSON"),
])
def test_template_rejections(tiny: Tokenizer, messages: list[dict[str, Any]],
                             match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        tiny.apply_chat_template(messages)


def test_no_template_raises() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_json(load_standin("tiny")[0]).apply_chat_template(
            [{"role": "user", "content": "hi"}])


def test_renders_like_transformers(tiny: Tokenizer) -> None:
    """Real checkpoints' templates must render as in transformers: same Jinja settings."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ("{% for m in messages %}\n  {{ m.role }}: {{ m.content | tojson }}\n{% endfor %}"
                "{{ tools | tojson(indent=2) }}")
    messages = [{"role": "user", "content": "<b> & 'é'"}]
    custom = Tokenizer.from_json(load_standin("tiny")[0], template)
    for tok in (custom, tiny):
        expected = render_jinja_template([messages], tools=TOOLS, chat_template=tok.chat_template,
                                         add_generation_prompt=True, enable_thinking=True)[0][0]
        assert tok.apply_chat_template(messages, tools=TOOLS) == expected


# ----- the packaged assets are what the script builds ---------------------------------------------

def test_standin_assets_are_reproducible() -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_standin_tokenizer.py"
    spec = importlib.util.spec_from_file_location("make_standin_tokenizer", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for kind in ("tiny", "qwen"):
        built = hashlib.sha256(module.build(kind).encode()).hexdigest()
        packaged = hashlib.sha256(load_standin(kind)[0].encode()).hexdigest()
        assert built == packaged, f"run scripts/make_standin_tokenizer.py ({kind} is stale)"
