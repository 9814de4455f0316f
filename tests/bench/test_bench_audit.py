"""The output audit: repetition loops, termination counts, answers and checks per fixture."""

from __future__ import annotations

from ninfer_bench.audit import audit, markdown, repetition_loop


def test_a_dominant_exact_line_is_a_loop() -> None:
    line = "Wait, $x_7 x_1 x_3$ is $x_7 x_1 x_3$."
    text = "\n".join(["Let us think."] * 3 + [line] * 30 + ["Hmm, another idea here."] * 5)
    loop = repetition_loop(text)
    assert loop is not None and (loop.line, loop.count, loop.lines) == (line, 30, 38)


def test_healthy_text_has_no_loop() -> None:
    code = "\n".join(f"int f{i}(void) {{\n    return {i};\n}}\n" for i in range(40))
    assert repetition_loop(code) is None  # "}" repeats, but it is too short to count
    prose = "\n".join(f"Line number {i} of the story." for i in range(100))
    assert repetition_loop(prose) is None
    few = "\n".join(["The same sentence again."] * 5)
    assert repetition_loop(few) is None  # too few repeats to call it a loop


def rec(fixture: str, category: str, seed: int, reason: str, passed: bool,
        answer: str | None = None, text: str = "", error: str | None = None) -> dict:
    return {"suite": "corpus", "target": "m", "concurrency": 1, "fixture": fixture,
            "category": category, "seed": seed, "finish_reason": reason, "content": text,
            "reasoning": "", "error": error,
            "check": None if error else {"passed": passed, "detail": "correct" if passed
                                         else "wrong (expected 131)" if answer else "no answer",
                                         "answer": answer}}


def test_audit_counts_per_fixture() -> None:
    loop_text = "\n".join(["Wait, this is the same line again."] * 20)
    records = [rec("long_decode_math_01", "reasoning", 1, "stop", True, "131"),
               rec("long_decode_math_01", "reasoning", 2, "stop", False, "7"),
               rec("long_decode_math_01", "reasoning", 3, "length", False, text=loop_text),
               rec("long_decode_math_01", "reasoning", 4, None, False, error="HTTP 500: x"),
               rec("code_c_ringbuf", "code", 1, "length", False),
               rec("code_c_ringbuf", "code", 2, "stop", True)]
    [math, code] = audit(records)
    assert (math["samples"], math["natural_stops"], math["output_limit_hits"]) == (4, 2, 1)
    assert (math["passed"], math["answers"]) == (1, 2)
    assert [loop["seed"] for loop in math["loops"]] == [3]
    assert math["errors"] == ["HTTP 500: x"]
    assert (code["natural_stops"], code["passed"], code["failures"]) == (1, 1, {"no answer": 1})
    text = markdown([math, code])
    assert ("1/4 correct, 1 wrong, 1 no answer, 1 reach the output limit, 1 repetition loops; "
            "1 failed requests (HTTP 500: x)") in text
    assert "| corpus | m | 1 | Code | 1/2 natural stops; 1/2 pass the checks |" in text
    assert "`Wait, this is the same line again.` 20/20" in text
