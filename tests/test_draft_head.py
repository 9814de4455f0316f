"""--lm-head-draft: the vocabulary subset chosen at conversion and the runtime DraftHead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ninfer_convert.build import BuildOptions, build
from ninfer_convert.cli import main
from ninfer_convert.draft_vocab import DraftVocabError, choose_draft_vocab, with_draft_vocab
from ninfer_convert.sources import open_source
from ninfer_runtime.artifact import Artifact
from ninfer_runtime.models.draft_head import DraftHead
from ninfer_runtime.quant import PackedWeight
from ninfer_runtime.tokenizer import Tokenizer, load_standin

TARGET = "tiny_dense"  # vocab 1152; stand-in tokenizer: 1000 BPE tokens, added tokens 1000..1025
ADDED = list(range(1000, 1026))
EOS = [1000, 1002]


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def convert(out: Path, weights: str = "bf16", size: int = 64,
            text: Path | None = None) -> Artifact:
    source = with_draft_vocab(open_source(TARGET, random_init=True), size, text)
    build(source, out, BuildOptions(weights=weights, include_vision=False, include_mtp=False))
    return Artifact.open(out)


def dense(w: torch.Tensor | PackedWeight) -> torch.Tensor:
    return w.dequantize() if isinstance(w, PackedWeight) else w.float()


@pytest.mark.parametrize("weights", ["bf16", "groupwise-int"])
def test_draft_head_is_the_lm_head_rows_of_its_ids(tmp_path: Path, weights: str) -> None:
    """By BPE rank: every added token and eos id, then the lowest ids; the rows are lm_head's
    (groupwise-int quantizes rows independently, so even the quantized rows agree)."""
    a = convert(tmp_path / "a.ninfer", weights)
    ids = a.weight("draft_head.token_ids")
    assert ids.dtype == torch.int64 and ids.tolist() == list(range(38)) + ADDED
    assert a.manifest["weights"]["draft_head.weight"]["scheme"] == weights
    assert a.manifest["draft_head"] == {"size": 64, "method": "bpe-rank", "always_included": 26}
    head = dense(a.weight("draft_head.weight"))
    assert torch.equal(head, dense(a.weight("lm_head.weight"))[ids])


def test_calibration_text_changes_the_choice(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_json(load_standin("tiny")[0])
    text = "Zebras quizzically juxtapose xylophones. " * 5 + "Quartz vexes." * 2
    counts = torch.bincount(torch.tensor(tokenizer.encode(text)), minlength=1152)
    (tmp_path / "calib.txt").write_text(text)
    a = convert(tmp_path / "a.ninfer", size=40, text=tmp_path / "calib.txt")
    ids = a.weight("draft_head.token_ids").tolist()
    regular = [i for i in ids if i not in ADDED]
    assert len(ids) == 40 and set(ADDED) <= set(ids) and len(regular) == 14
    # the 14 most frequent tokens of the text (ties by rank), not the 14 lowest ids
    by_count = sorted(range(1000), key=lambda i: (-int(counts[i]), i))[:14]
    assert sorted(regular) == sorted(by_count) and regular != list(range(14))
    record = a.manifest["draft_head"]
    assert record["method"] == "calibration-text" and record["calibration"]["file"] == "calib.txt"
    assert record["calibration"]["tokens"] == int(counts.sum())


def test_draft_head_argmax_is_the_restricted_full_argmax(tmp_path: Path) -> None:
    a = convert(tmp_path / "a.ninfer")
    head = DraftHead.load(a.weights(), torch.float32, "cpu")
    assert head is not None and head.size == 64
    lm_head = a.weight("lm_head.weight").float()
    hidden = torch.randn(9, 128, generator=torch.Generator().manual_seed(0))
    full = hidden @ lm_head.T
    ids = head.token_ids
    expected = ids[full[:, ids].argmax(-1)]
    assert torch.equal(head.argmax(hidden), expected)
    torch.testing.assert_close(head.logits(hidden), full[:, ids])
    # the full argmax differs on some rows: the subset is what the head sees
    assert not torch.equal(expected, full.argmax(-1))


def test_no_draft_head_loads_none(tmp_path: Path) -> None:
    build(open_source(TARGET, random_init=True), tmp_path / "a.ninfer",
          BuildOptions(include_vision=False, include_mtp=False))
    a = Artifact.open(tmp_path / "a.ninfer")
    assert a.manifest["draft_head"] is None
    assert DraftHead.load(a.weights(), torch.float32, "cpu") is None


def test_choice_without_tokenizer_and_beyond_the_vocab() -> None:
    vocab = choose_draft_vocab(5, 100, None, [99])
    assert vocab.token_ids == (0, 1, 2, 3, 99)
    assert choose_draft_vocab(500, 100, None, [99]).token_ids == tuple(range(100))
    tokenizer_json = load_standin("tiny")[0]
    everything = choose_draft_vocab(32768, 1152, tokenizer_json, EOS)
    assert everything.token_ids == tuple(range(1152)) and everything.record["size"] == 1152
    # ids the tokenizer never produces (the embedding's padding rows) come last
    assert choose_draft_vocab(1030, 1152, tokenizer_json, EOS).token_ids == \
        tuple(range(1026)) + (1026, 1027, 1028, 1029)
    with pytest.raises(DraftVocabError, match="needs a tokenizer"):
        choose_draft_vocab(5, 100, None, [99], text="hello")


@pytest.mark.parametrize("args,message", [
    (["--lm-head-draft", "--draft-vocab", "10"], "cannot hold the 26 added tokens"),
    (["--draft-vocab", "100"], "need --lm-head-draft"),
    (["--dflash-revision", "main"], "--dflash-revision needs --dflash"),
    (["--dflash", "random", "--dflash-revision", "main"], "applies only to a draft fetched"),
    (["--dflash", "not a draft"], "is not 'random', a draft checkpoint directory"),
])
def test_bad_draft_arguments_fail_cleanly(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "out"
    result = cli("build", TARGET, "--random-init", "--weights", "bf16", *args,
                 "-o", str(out / "m.ninfer"))
    assert result.exit_code == 1, result.output
    assert message in result.output and result.output.count("\n") == 1, result.output
    assert not out.exists()


def test_cli_lm_head_draft_with_calibration_file(tmp_path: Path) -> None:
    (tmp_path / "calib.txt").write_text("hello hello world")
    out = tmp_path / "a.ninfer"
    result = cli("build", TARGET, "--random-init", "--weights", "bf16", "--no-vision",
                 "--lm-head-draft", "--draft-vocab", "30", "--draft-vocab-text",
                 str(tmp_path / "calib.txt"), "-o", str(out))
    assert result.exit_code == 0, result.output
    a = Artifact.open(out)
    assert a.weight("draft_head.token_ids").shape == (30,)
    assert json.loads(json.dumps(a.manifest["draft_head"]))["method"] == "calibration-text"
    result = cli("inspect", str(out))
    assert "30 tokens by calibration-text (calib.txt" in result.output, result.output
