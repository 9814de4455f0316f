"""`ninfer-serve [ARTIFACT]`: serve one .ninfer artifact over OpenAI-compatible HTTP.

Without ARTIFACT the embedded default model is served (built and cached on first use). The
server listens at once; the model loads on the engine thread meanwhile (/health answers 503 until
it is ready). When both are done it logs a ready line with a curl command to try. If loading
fails the process exits with status 1.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import click
import uvicorn

from ninfer_runtime.engine.config import DEFAULT_BATCHED_TOKENS, SPEC_METHODS, EngineConfig
from ninfer_serve.app import create_app
from ninfer_serve.client import Engine
from ninfer_serve.config import MAX_BODY_BYTES, ServeConfig
from ninfer_serve.ready import Readiness

DEFAULT_MODEL_NAME = "ninfer-default"


def engine_factory(artifact: Path | None, config: EngineConfig) -> Callable[[], Engine]:
    """Builds the engine on the engine thread; the heavy imports happen there too."""

    def build() -> Engine:
        from ninfer_runtime.engine import Engine

        path = artifact
        if path is None:
            from ninfer_convert.demo import default_artifact

            path = default_artifact()
        return Engine.from_artifact(path, config)

    return build


class _Server(uvicorn.Server):
    """uvicorn's server, reporting the port once its socket listens (port 0 picks one)."""

    def __init__(self, config: uvicorn.Config, on_listening: Callable[[int], None]) -> None:
        super().__init__(config)
        self._on_listening = on_listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_listening(self.servers[0].sockets[0].getsockname()[1])


def _kv_capacity(_: click.Context, __: click.Parameter, value: str) -> int | str:
    if value == "auto":
        return value
    if not value.isdigit():
        raise click.BadParameter(f"expected 'auto' or a number of tokens, got {value!r}")
    return int(value)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@click.command(context_settings={"show_default": True})
@click.argument("artifact", required=False, type=click.Path(exists=True, dir_okay=False,
                                                             path_type=Path))
@click.option("--host", default="127.0.0.1", help="Bind address (loopback by default).")
@click.option("--port", default=8000, type=click.IntRange(0, 65535))
@click.option("--max-context", default=EngineConfig.max_context, type=click.IntRange(min=2),
              help="Prompt + completion tokens per request.")
@click.option("--prefill-chunk", default=EngineConfig.prefill_chunk, type=click.IntRange(min=1),
              help="Prompt tokens computed per request per step, at most.")
@click.option("--max-batched-tokens", "--max-num-batched-tokens", "max_batched_tokens",
              default=None, type=click.IntRange(min=1),
              help="Tokens computed per step over every request: decode tokens first, then "
              f"prompt chunks. Default: {DEFAULT_BATCHED_TOKENS} (or a decode step of every "
              "request, where that is more).")
@click.option("--kv-dtype", default=EngineConfig.kv_dtype, type=click.Choice(["int8", "bf16"]))
@click.option("--kv-capacity", default="auto", callback=_kv_capacity,
              help="KV pool size in tokens, or auto (sized from free memory).")
@click.option("--max-concurrency", default=EngineConfig.max_concurrency,
              type=click.IntRange(min=1), help="Requests running at once.")
@click.option("--max-queue", default=EngineConfig.max_queue, type=click.IntRange(min=0),
              help="Waiting requests beyond which new ones get 429.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Default: cuda when available.")
@click.option("--api-key", default=None, envvar="NINFER_API_KEY",
              help="Require 'Authorization: Bearer KEY' (except /health and /metrics).")
@click.option("--served-model-name", default=None,
              help=f"Model id in the API. Default: the artifact's file stem, or "
              f"{DEFAULT_MODEL_NAME!r}.")
@click.option("--no-cuda-graph", "no_cuda_graph", is_flag=True,
              help="Launch decode steps kernel by kernel instead of replaying CUDA graphs.")
@click.option("--prompt-graphs/--no-prompt-graphs", default=EngineConfig.prompt_graphs,
              help="With CUDA graphs, also replay a step of one prompt chunk of at most 2,048 "
              "tokens alone (a long prompt prefilling by itself) as a graph, which spares the "
              "host one launch a kernel (the 35B's 1,024-token chunks: 1.53x on an H100).")
@click.option("--no-overlap-decode", "no_overlap_decode", is_flag=True,
              help="Read each decode step's tokens before launching the next (by default the "
              "next step is launched first, so the GPU does not wait for the host).")
@click.option("--spec", default=EngineConfig.spec, type=click.Choice(SPEC_METHODS),
              help="Speculative decoding: draft with the model's MTP layer or a DFlash draft, "
              "verify every draft in one forward (outputs are unchanged).")
@click.option("--draft-tokens", default=EngineConfig.draft_tokens, type=click.IntRange(min=1),
              help="Drafts per request per step (with --spec).")
@click.option("--lm-head-draft", is_flag=True,
              help="Draft through the artifact's vocabulary-subset draft head (with --spec).")
@click.option("--max-body-bytes", default=MAX_BODY_BYTES, type=click.IntRange(min=1))
@click.option("--log-level", default="info",
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(artifact: Path | None, host: str, port: int, max_context: int, prefill_chunk: int,
         max_batched_tokens: int | None, kv_dtype: str, kv_capacity: int | str,
         max_concurrency: int, max_queue: int, device: str | None, api_key: str | None,
         served_model_name: str | None, no_cuda_graph: bool, prompt_graphs: bool,
         no_overlap_decode: bool, spec: str, draft_tokens: int, lm_head_draft: bool,
         max_body_bytes: int, log_level: str) -> None:
    """Serve ARTIFACT (a .ninfer file) over OpenAI-compatible HTTP."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        engine_config = EngineConfig(max_context=max_context, prefill_chunk=prefill_chunk,
                                     max_batched_tokens=max_batched_tokens,
                                     kv_dtype=kv_dtype, kv_capacity=kv_capacity,  # type: ignore[arg-type]
                                     max_concurrency=max_concurrency, max_queue=max_queue,
                                     device=device or _default_device(),
                                     cuda_graphs=not no_cuda_graph,
                                     prompt_graphs=prompt_graphs,
                                     overlap_decode=not no_overlap_decode,
                                     spec=spec,  # type: ignore[arg-type]
                                     draft_tokens=draft_tokens, lm_head_draft=lm_head_draft)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    name = served_model_name or (artifact.stem if artifact is not None else DEFAULT_MODEL_NAME)
    config = ServeConfig(served_model_name=name, engine=engine_config, api_key=api_key,
                         max_body_bytes=max_body_bytes)
    load_errors: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_error(error: BaseException) -> None:
        load_errors.append(error)
        if server is not None:
            server.should_exit = True

    readiness = Readiness(host, name, api_key=api_key is not None)
    app = create_app(config, engine_factory(artifact, engine_config), on_load_error=on_load_error,
                     on_ready=readiness.loaded)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level),
                     on_listening=readiness.listening)
    # uvicorn re-raises the Ctrl-C it shut down on; for a server that is the normal end
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if load_errors:
        click.echo(f"ninfer-serve: the model failed to load: {load_errors[0]}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
