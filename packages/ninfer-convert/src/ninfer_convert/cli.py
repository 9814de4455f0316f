"""`ninfer-convert`: build a `.ninfer` artifact from a checkpoint, or inspect one.

    ninfer-convert build SOURCE --weights {bf16,groupwise-int,nvfp4} [-o out/NAME.ninfer]
                         [--dflash DRAFT] [--lm-head-draft [--draft-vocab N]
                         [--draft-vocab-text FILE]]
    ninfer-convert inspect FILE

SOURCE is a registered profile (fetched from its hub repo, or `--random-init`), a hub repo id
`org/name`, or a checkpoint directory. DRAFT is a DFlash draft checkpoint (directory or hub
repo id, z-lab format) or `random`. Every refused input ends in one line on stderr and exit
status 1, with nothing left at the output path.
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import torch

from ninfer_convert.build import BuildOptions, build, check_output_path, plan_outputs
from ninfer_convert.checkpoint import ConvertError
from ninfer_convert.dflash import with_dflash
from ninfer_convert.draft_vocab import DEFAULT_SIZE, with_draft_vocab
from ninfer_convert.progress import byte_progress
from ninfer_convert.sources import open_source
from ninfer_runtime.artifact import ArtifactError
from ninfer_runtime.quant import WEIGHTS_IDS

CHOICES = click.Choice(["body", "bf16"])


def default_output(source: str, weights: str) -> Path:
    """out/<profile, repo or directory name>_<weights>.ninfer"""
    path = Path(source)
    name = path.resolve().name if path.is_dir() else path.name
    return Path("out") / f"{name}_{weights}.ninfer"


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConvertError("--device cuda: no CUDA device is available")
    return device


@click.group()
def main() -> None:
    """NInfer converter: Hugging Face checkpoints to .ninfer artifacts."""


@main.command("build")
@click.argument("source")
@click.option("--weights", type=click.Choice(WEIGHTS_IDS), required=True,
              help="Storage of the linear weights.")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Artifact path (default: out/<name>_<weights>.ninfer).")
@click.option("--random-init", is_flag=True,
              help="Profile only: the profile's exact shapes with random weights, no download.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --random-init.")
@click.option("--revision", help="Hub branch, tag or commit (hub sources only).")
@click.option("--lm-head", type=CHOICES, default="body", show_default=True,
              help="body: quantized like the body; bf16: kept in bf16.")
@click.option("--mtp", type=CHOICES, default="body", show_default=True,
              help="Storage of the MTP layer's linears, as for --lm-head.")
@click.option("--no-mtp", is_flag=True, help="Leave out the MTP layer.")
@click.option("--no-vision", is_flag=True, help="Leave out the vision tower.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True, help="Where to quantize.")
@click.option("--dflash", "dflash", metavar="DRAFT",
              help="Pack a DFlash draft: a z-lab checkpoint directory, a hub repo id, or "
                   "'random' (random weights shaped for the target, seeded by --seed).")
@click.option("--dflash-revision", help="Hub branch, tag or commit of the --dflash draft.")
@click.option("--lm-head-draft", is_flag=True,
              help="Add a compact draft head: the lm_head rows of a vocabulary subset.")
@click.option("--draft-vocab", type=int, metavar="N",
              help=f"Tokens in the draft head, special tokens and eos ids included "
                   f"(default {DEFAULT_SIZE}).")
@click.option("--draft-vocab-text", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Choose the draft head's tokens by frequency in this text (default: by BPE "
                   "rank).")
def build_command(source: str, weights: str, output: Path | None, random_init: bool, seed: int,
                  revision: str | None, lm_head: str, mtp: str, no_mtp: bool, no_vision: bool,
                  device: str, dflash: str | None, dflash_revision: str | None,
                  lm_head_draft: bool, draft_vocab: int | None,
                  draft_vocab_text: Path | None) -> None:
    """Convert SOURCE (profile, org/name repo id, or directory) into a .ninfer artifact."""
    path = output or default_output(source, weights)
    try:
        options = BuildOptions(weights=weights, lm_head=lm_head, mtp=mtp,
                               include_mtp=not no_mtp, include_vision=not no_vision,
                               device=resolve_device(device))
        if not lm_head_draft and (draft_vocab is not None or draft_vocab_text is not None):
            raise ConvertError("--draft-vocab and --draft-vocab-text need --lm-head-draft")
        if dflash is None and dflash_revision is not None:
            raise ConvertError("--dflash-revision needs --dflash")
        check_output_path(path)
        model = open_source(source, random_init=random_init, seed=seed, revision=revision,
                            device=options.device)
        if dflash is not None:
            model = with_dflash(model, dflash, seed=seed, revision=dflash_revision,
                                device=options.device)
        if lm_head_draft:
            model = with_draft_vocab(model, draft_vocab or DEFAULT_SIZE, draft_vocab_text)
        if model.tokenizer_json is None:
            click.echo(f"warning: {model.where} has no tokenizer.json; the artifact will carry "
                       "no tokenizer", err=True)
        outputs = plan_outputs(model, options)
        start = time.perf_counter()
        with byte_progress(sum(o.nbytes_in for o in outputs), f"{path.name}") as advance:
            build(model, path, options, on_progress=advance, outputs=outputs)
    except (ConvertError, ArtifactError) as e:
        raise click.ClickException(str(e)) from None
    size = path.stat().st_size
    click.echo(f"wrote {path} ({size / 1e9:.3f} GB, {len(outputs)} weights, {weights}) "
               f"from {model.where} in {time.perf_counter() - start:.1f} s")


@main.command("inspect")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--verify", is_flag=True, help="Also check every tensor's checksum.")
def inspect_command(file: Path, verify: bool) -> None:
    """Describe what a .ninfer FILE holds."""
    from ninfer_convert.inspect import describe

    try:
        click.echo(describe(file, verify=verify))
    except ArtifactError as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    main()
