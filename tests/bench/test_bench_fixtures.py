"""The fixed workload: the corpus, its selection, every mechanical check (on an answer that
meets the request and on one that does not), the NIAH builder and the corpus send order."""

from __future__ import annotations

import json

import pytest

from ninfer_bench.fixtures import (
    CROSS_CATEGORIES,
    SEEDS,
    FixtureError,
    corpus,
    data_text,
    niah,
    seeds,
    select,
)
from ninfer_bench.fixtures.checks import boxed, check
from ninfer_bench.suites.common import Job
from ninfer_bench.suites.makespan import shuffled


def spec(fixture_id: str) -> dict:
    return dict(next(f.check for f in corpus() if f.id == fixture_id))


def test_the_corpus_is_the_seeds_shape() -> None:
    fixtures = corpus()
    reasoning = [f for f in fixtures if f.category == "reasoning"]
    assert len(fixtures) == 15 and len(reasoning) == 3
    assert all(f.thinking and f.max_tokens == 65536 for f in reasoning)
    assert all(f.check["kind"] == "boxed_answer" for f in reasoning)
    for category in CROSS_CATEGORIES:
        mine = [f for f in fixtures if f.category == category]
        assert len(mine) == 3
        assert all(not f.thinking and f.max_tokens == 4096 for f in mine)
    assert len({f.id for f in fixtures}) == 15
    assert all("{{source:" not in f.prompt for f in fixtures)
    assert data_text("translation_markdown.md").strip() in spec_prompt("translation_markdown_fr")
    assert len(set(SEEDS)) == 5 and seeds(2) == SEEDS[:2]
    with pytest.raises(FixtureError):
        seeds(6)


def spec_prompt(fixture_id: str) -> str:
    return next(f.prompt for f in corpus() if f.id == fixture_id)


def test_selection_by_id_and_category_keeps_corpus_order() -> None:
    picked = select(corpus(), ["story", "long_decode_math_02"])
    assert [f.id for f in picked] == ["long_decode_math_02", "story_zh_lighthouse",
                                      "story_zh_play", "story_en_mystery"]
    assert select(corpus(), None) == list(corpus())
    with pytest.raises(FixtureError, match="nonsense"):
        select(corpus(), ["nonsense"])


def test_boxed_answers() -> None:
    assert boxed(r"first \boxed{1}, then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert boxed("no box") is None and boxed(r"\boxed{12") is None
    answer = {"kind": "boxed_answer", "answer": "131"}
    assert check(answer, r"so the answer is $\boxed{131}$").passed
    assert check(answer, r"\boxed{0131}").passed
    wrong = check(answer, r"\boxed{132}")
    assert (wrong.passed, wrong.answer) == (False, "132") and "wrong" in wrong.detail
    assert check(answer, "I give up").detail == "no answer"
    assert check({"kind": "needle", "needle": "amber-falcon-00042"},
                 "It is Amber-Falcon-00042.").passed


def _files(files: dict[str, str]) -> str:
    return "\n\n".join(f"File: `{path}`\n```\n{body}\n```" for path, body in files.items())


RINGBUF = {
    "ringbuf.h": "#ifndef RINGBUF_H\n#define RINGBUF_H\ntypedef struct ringbuf ringbuf;\n"
                 "ringbuf *ringbuf_new(size_t c);\nvoid ringbuf_free(ringbuf *rb);\n"
                 "size_t ringbuf_write(ringbuf *rb, const uint8_t *d, size_t n);\n"
                 "size_t ringbuf_read(ringbuf *rb, uint8_t *o, size_t n);\n"
                 "size_t ringbuf_size(const ringbuf *rb);\n#endif",
    "ringbuf.c": '#include "ringbuf.h"\nstruct ringbuf { size_t n; };\n'
                 "ringbuf *ringbuf_new(size_t c) { return malloc(c); }\n"
                 "size_t ringbuf_write(ringbuf *rb, const uint8_t *d, size_t n) { return n; }\n"
                 "size_t ringbuf_read(ringbuf *rb, uint8_t *o, size_t n) { return 0; }",
    "test_ringbuf.c": "int main(void) { assert(1); return 0; }",
    "Makefile": "test:\n\tcc -Wall -Wextra -std=c11 -o t test_ringbuf.c ringbuf.c\nclean:\n\trm t",
}


def test_code_files() -> None:
    ringbuf = spec("code_c_ringbuf")
    assert check(ringbuf, "Here you go.\n\n" + _files(RINGBUF)).passed
    missing = check(ringbuf, _files({k: v for k, v in RINGBUF.items() if k != "ringbuf.c"}))
    assert not missing.passed and "ringbuf.c: missing file" in missing.detail
    unbalanced = check(ringbuf, _files({**RINGBUF, "ringbuf.c": RINGBUF["ringbuf.c"] + " {"}))
    assert "ringbuf.c: unbalanced braces" in unbalanced.detail
    todo = spec("code_python_todo")
    broken = _files({"todo/store.py": "class TodoStore:\n    def add(:\n        pass"})
    assert "todo/store.py: syntax error line 2" in check(todo, broken).detail


def test_stories() -> None:
    numerals = "一二三四五"
    chapters = "\n\n".join(f"第{n}章 潮汐\n" + "海" * 600 for n in numerals)
    lighthouse = spec("story_zh_lighthouse")
    assert check(lighthouse, chapters).passed
    short = check(lighthouse, chapters.split("第五章")[0])
    assert not short.passed and "4 sections, asked 5" in short.detail
    mystery = "\n".join(f"Part {i}: Snow\n" + "word " * 460 for i in range(1, 5)) + "\nTHE END"
    assert check(spec("story_en_mystery"), mystery).passed
    assert "last line" in check(spec("story_en_mystery"), mystery + "\nEpilogue").detail


def test_translations() -> None:
    plain = spec("translation_plain_zh")
    sections = "\n".join(f"{n}. 第{n}节\n内容" for n in range(1, 7))
    glossary = "Glossary\n" + "\n".join(f"term {i} = 术语{i}" for i in range(20))
    assert check(plain, sections + "\n\n" + glossary).passed
    assert "19 glossary entries" in check(plain, sections + "\n" + glossary[:-10]).detail
    markdown = spec("translation_markdown_fr")
    source = data_text("translation_markdown.md")
    assert check(markdown, source).passed  # the identity keeps every structure
    no_row = check(markdown, source.replace("| `done` |", "`done` |"))
    assert "5 table lines, source 6" in no_row.detail
    assert "fenced JSON" in check(markdown, source.replace('"retries": 2', '"retries": 3')).detail
    assert "inline code" in check(markdown, source.replace("`tidepool submit job.json`",
                                                           "tidepool submit")).detail


def test_structured_outputs() -> None:
    jsonl = spec("structured_jsonl_weather")
    keys = jsonl["keys"]
    lines = [json.dumps({k: (i if k == "id" else "x") for k in keys}) for i in range(1, 161)]
    assert check(jsonl, "\n".join(lines)).passed
    assert check(jsonl, "\n".join(lines[:-1])).detail == "159 valid records of 160"
    csv = spec("structured_csv_orders")
    rows = [f"{1000 + i},Ann Lee,North,Lamp,2,9.99,2026-01-02" for i in range(1, 221)]
    text = "\n".join(["```csv", csv["header"], *rows, "```"])
    assert check(csv, text).passed
    rows[99] = "1100,Ann Lee,North,Lamp,2,9.99"
    assert check(csv, "\n".join([csv["header"], *rows])).detail == "99 complete rows of 220"
    sql = spec("structured_sql_library")
    script = "\n".join(
        [f"CREATE TABLE t{i} (id int primary key);" for i in range(4)]
        + ["CREATE VIEW active_loans AS SELECT 1;", "CREATE OR REPLACE VIEW v2 AS SELECT 2;"]
        + ["INSERT INTO t0 VALUES " + ", ".join(f"({i})" for i in range(50)) + ";",
           "INSERT INTO t1 VALUES " + ", ".join(f"({i})" for i in range(30)) + ";"]
        + [f"-- question {i}\nSELECT count(*) FROM t0;" for i in range(6)])
    assert check(sql, script).passed
    fewer = check(sql, script.rsplit("-- question 5", 1)[0])
    assert not fewer.passed and "5 queries < 6" in fewer.detail


def test_unknown_check_kind() -> None:
    with pytest.raises(FixtureError, match="unknown check kind"):
        check({"kind": "vibes"}, "")


def words_counter(text: str) -> int:
    """A stand-in tokenizer: one token per word, plus a 7-token chat template."""
    return len(text.split()) + 7


def test_niah_prompts_fit_their_target_with_the_needle_in_the_middle() -> None:
    prompt, fixture = niah.build(4096, words_counter)
    assert prompt.target_tokens == 3840 == prompt.prompt_tokens  # one token per word: exact
    assert words_counter(fixture.prompt) == prompt.prompt_tokens
    needle = f"The secret passphrase is {prompt.needle}."
    assert fixture.prompt.count(needle) == 1
    position = fixture.prompt.index(needle) / len(fixture.prompt)
    assert 0.45 < position < 0.6
    assert (fixture.id, fixture.thinking, fixture.max_tokens) == ("niah_4096", False, 128)
    assert check(fixture.check, prompt.needle).passed
    again, _ = niah.build(4096, words_counter)
    assert again == prompt  # deterministic
    assert niah.target_tokens(262144) == 260096 and niah.target_tokens(8192) == 7680
    assert niah.needle_for(8192) != niah.needle_for(65536)
    with pytest.raises(FixtureError, match="without haystack"):
        niah.build(40, words_counter)


def test_the_corpus_send_order_is_fixed() -> None:
    jobs = [Job(i, corpus()[0], seed=i) for i in range(8)]
    order = shuffled(jobs)
    assert [j.seed for j in order] == [3, 2, 5, 4, 1, 6, 7, 0]
    assert [j.index for j in order] == list(range(8))  # renumbered in send order
