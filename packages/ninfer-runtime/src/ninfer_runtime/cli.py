"""`ninfer-runtime generate`: one generation from an artifact, without a server."""

from __future__ import annotations

import click


@click.group()
def main() -> None:
    """Run a .ninfer artifact offline."""


@main.command()
@click.argument("artifact", type=click.Path(exists=True, dir_okay=False))
@click.argument("prompt")
@click.option("--chat/--raw", default=True, help="Render PROMPT as a user turn (chat template).")
@click.option("--thinking/--no-thinking", default=False, help="Open a think block (chat only).")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when present).")
def generate(artifact: str, prompt: str, chat: bool, thinking: bool, max_tokens: int,
             temperature: float, top_p: float, top_k: int, seed: int | None,
             device: str | None) -> None:
    """Generate a completion of PROMPT with the model in ARTIFACT."""
    from ninfer_runtime.llm import LLM

    llm = LLM(artifact, device=device)
    if chat:
        if llm.tokenizer is None:
            raise click.ClickException(f"{artifact} has no tokenizer; use --raw with token ids")
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], enable_thinking=thinking)
    result = llm.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=seed)
    click.echo(result.text)
    click.echo(f"[{len(result.token_ids)} tokens, finish_reason={result.finish_reason}]", err=True)
