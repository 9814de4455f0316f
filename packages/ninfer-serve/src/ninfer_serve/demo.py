"""`make demo`: start ninfer-serve on the embedded default model, talk to it once, keep serving.

It runs `ninfer-serve` without ARTIFACT (the tiny_dense profile with random weights, converted to
NVFP4 and cached on first use) as a child process, exactly as a user would; waits for /health;
sends one chat request and prints the answer, which is noise (the weights are random) made by
the real path (converter, .ninfer artifact, engine, HTTP); prints a curl line to try; and serves
until Ctrl-C. Only the standard library talks HTTP here, so the demo needs nothing the server
does not.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import click

from ninfer_serve.ready import TRY_MESSAGE, base_url, curl_command, try_request

HEALTH_POLL_S = (0.05, 1.0)  # first and longest wait between /health polls (each is logged)
STARTUP_TIMEOUT_S = 600.0  # the first run builds the default artifact
ANSWER_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 15.0


class DemoError(RuntimeError):
    """The server did not come up, or did not answer."""


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:  # URLError included: not listening yet, or 503 while the model loads
        return False


def _wait_healthy(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pause, longest = HEALTH_POLL_S
    while not _healthy(url):
        if server.poll() is not None:
            raise DemoError(f"ninfer-serve exited with status {server.returncode}")
        if time.monotonic() > deadline:
            raise DemoError(f"ninfer-serve was not healthy within {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(pause)
        pause = min(2 * pause, longest)


def _call(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """GET (no body) or POST JSON; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=ANSWER_TIMEOUT_S) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise DemoError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e


def _show_answer(url: str, model: str) -> None:
    reply = _call(f"{url}/v1/chat/completions", {**try_request(model), "seed": 0})
    content = reply["choices"][0]["message"]["content"] or ""
    record = reply["ninfer"]
    timings = record["timings"]
    click.echo(f"""
  ninfer-serve is up at {url}/v1, serving {model!r}.

  asked:   {TRY_MESSAGE}
  answer:  {json.dumps(content, ensure_ascii=False)}
           ^ RANDOM WEIGHTS: this text is noise; the path that made it is real
             (converter -> .ninfer artifact -> engine -> OpenAI HTTP)
           {record['completion_tokens']} tokens, finish_reason {record['finish_reason']}, \
prefill {timings['prefill_seconds'] * 1e3:.1f} ms, decode {timings['decode_seconds'] * 1e3:.1f} ms

  try it yourself:
    {curl_command(url, model)}

  serving until Ctrl-C
""")


def _stop(server: subprocess.Popen) -> None:
    """Graceful stop (uvicorn finishes on SIGTERM as on Ctrl-C), forced if it hangs."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@click.command(context_settings={"ignore_unknown_options": True, "show_default": True})
@click.option("--host", default="127.0.0.1", help="Bind address.")
@click.option("--port", default=8000, type=click.IntRange(1, 65535))
@click.argument("serve_args", nargs=-1, type=click.UNPROCESSED)
def main(host: str, port: int, serve_args: tuple[str, ...]) -> None:
    """Start ninfer-serve on the embedded default model, ask it one question, keep serving.

    SERVE_ARGS go to ninfer-serve as they are (e.g. --device cpu --max-concurrency 4).
    """
    # Ctrl-C stops the demo even where it was started with SIGINT ignored (a background job
    # of a non-interactive shell: CI's runner started so, the demo ignored the test's Ctrl-C)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    url = base_url(host, port)
    click.echo("starting ninfer-serve on the embedded default model (tiny, random weights; "
               "built on first use) ...")
    server = subprocess.Popen([sys.executable, "-m", "ninfer_serve.cli", "--host", host,
                               "--port", str(port), *serve_args])
    try:
        _wait_healthy(url, server)
        model = _call(f"{url}/v1/models")["data"][0]["id"]
        _show_answer(url, model)
        sys.exit(server.wait())  # the server ended by itself: pass its status on
    except KeyboardInterrupt:
        click.echo("\nstopping ninfer-serve")
    except DemoError as e:
        click.echo(f"demo: {e}", err=True)
        sys.exit(1)
    finally:
        _stop(server)


if __name__ == "__main__":
    main()
