"""Build the stand-in tokenizers that ship with ninfer-runtime.

No machine here reaches the Hugging Face hub, yet the tiny profiles and `--random-init` artifacts
of the real profiles need a tokenizer. This script trains a small byte-level BPE with the same
pipeline as the Qwen3.5 tokenizer (NFC normaliser, Qwen pre-tokenise regex, ByteLevel bytes and
decoder) on text it carries itself, to exactly 1000 regular ids, then appends the Qwen special
tokens in Qwen's order, twice:

- tiny: specials at 1000.. (id = real Qwen id - 247044), the ids the tiny profiles use;
- qwen: specials at the real Qwen ids 248044.., for random-init artifacts of the real profiles.

The output is deterministic: running it again writes the same bytes (tests/test_tokenizer.py
checks this against the packaged files).

Usage: python scripts/make_standin_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

PROFILES_DIR = (Path(__file__).resolve().parents[1]
                / "packages/ninfer-runtime/src/ninfer_runtime/profiles")

REGULAR_VOCAB_SIZE = 1000  # ids 0..999: the 256 byte symbols plus 744 merges
QWEN_SPECIAL_BASE = 248044  # id of <|endoftext|> in the real Qwen3.5 vocabulary
SPECIAL_BASE = {"tiny": REGULAR_VOCAB_SIZE, "qwen": QWEN_SPECIAL_BASE}

# The Qwen3.5 pre-tokenise regex (qwen_arch.md §5): letters with marks, single digits.
PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                     r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# (content, special) in Qwen's id order. As in Qwen's tokenizer.json, the tool, FIM, repo and
# think markers are added tokens but not "special": decode(skip_special_tokens=True) keeps them,
# which the tool-call and reasoning parsers rely on.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

PROSE = """\
The quick brown fox jumps over the lazy dog. A language model reads text as a sequence of
tokens, and a tokenizer decides where one token ends and the next one begins. Byte-level
tokenizers never fail: every string, in every language, is a sequence of bytes, and every byte
has a token of its own. Frequent pairs are merged into longer tokens, so common words such as
"the", "and", "model" or "question" become a single token, while rare words are spelled out.

Hello! How are you today? I am fine, thank you. What would you like to talk about? Let me think
about that for a moment. First, we should understand the problem. Then we can write a plan,
check each step, and give a short answer. If the answer is not clear, we say so and explain why.

The weather in the mountains changes quickly: a sunny morning can turn into a cold, windy
afternoon with rain or snow. Hikers carry water, a warm jacket, a map and a small first-aid kit.
They start early, walk at a steady pace, and turn back when the clouds get dark.

Science begins with a question and a careful measurement. An experiment compares what we expect
with what we observe; when the two disagree, we learn something new. Good researchers write
down every detail, share their data, and let other people repeat the work.

The assistant answers the user's question, calls a tool when it needs fresh information, and
reads the tool's response before it replies. It doesn't guess; it's honest when it can't help,
and it'll ask a follow-up question if the request isn't clear. We're happy you've asked.

Über den Wolken scheint die Sonne. Le café est très bon, merci beaucoup ! ¿Dónde está la
estación? Naïve façade, résumé, coöperate, jalapeño. 你好，世界。こんにちは。Привет, мир!
"""

CODE = '''\
def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, word: str) -> None:
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, k: int = 10) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda item: -item[1])[:k]


if __name__ == "__main__":
    for index, value in enumerate(fibonacci(10)):
        print(f"{index}: {value}")

{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}
for (int i = 0; i < size; ++i) { total += data[i] * weight[i]; }
SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY name;
$ git commit -m "Fix the tokenizer test" && make test
<div class="note">Read the <a href="/docs">documentation</a> first.</div>
'''

_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_THINGS = ("apples", "books", "cups", "days", "eggs", "files", "games", "hours", "ideas", "jobs")


def _generated_lines() -> list[str]:
    """Arithmetic and counting sentences: digits, symbols and short words, same every run."""
    lines = []
    for a in range(1, 10):
        for b in range(1, 10, 2):
            lines.append(f"{a} + {b} = {a + b}; {a} * {b} = {a * b}. "
                         f"We have {_NUMBER_WORDS[a]} {_THINGS[b]} and {_NUMBER_WORDS[b]} more.")
    return lines


def _corpus() -> list[str]:
    return [*PROSE.split("\n\n"), CODE, *_generated_lines()]


def _train_regular() -> Tokenizer:
    """Train the 1000-id byte-level BPE that both variants share."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(vocab_size=REGULAR_VOCAB_SIZE, min_frequency=1, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != REGULAR_VOCAB_SIZE:
        raise RuntimeError(f"training gave {tokenizer.get_vocab_size()} regular ids, expected "
                           f"{REGULAR_VOCAB_SIZE}: add text to the corpus")
    return tokenizer


def build(kind: Literal["tiny", "qwen"]) -> str:
    """The tokenizer.json text of one variant."""
    base = SPECIAL_BASE[kind]
    spec = json.loads(_train_regular().to_str())
    for offset, (content, special) in enumerate(SPECIAL_TOKENS):
        token_id = base + offset
        # NOTE: `tokenizers` renumbers added tokens that are missing from the model vocabulary
        # to follow it contiguously, so the qwen variant's ids (far above the 1000 regular ids)
        # only survive loading when the model vocabulary holds them too. No merge produces them,
        # so BPE never emits them from ordinary text.
        spec["model"]["vocab"][content] = token_id
        spec["added_tokens"].append({"id": token_id, "content": content, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": special})
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    for offset, (content, _) in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(content) != base + offset:
            raise RuntimeError(f"{content} did not keep id {base + offset} in the {kind} variant")
    return tokenizer.to_str(pretty=True) + "\n"


def main() -> None:
    for kind in SPECIAL_BASE:
        path = PROFILES_DIR / f"standin_tokenizer_{kind}.json"
        path.write_text(build(kind), encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
