"""``python -m mlx_batched_decode.serve``: the flags, the model loaded, uvicorn run.

mlx_lm.server's flags where they apply, and one for every field of the engine's configs
(``decoding/config.py``: generated from them, checked by them). The
process listens on 127.0.0.1 unless ``--host`` says otherwise; SIGINT or SIGTERM stops it
cleanly: it accepts nothing more, lets the requests it holds end (at most
``--shutdown-timeout`` seconds), and exits with status 0. With ``--tensor-parallel`` under
``mlx.launch``, every rank loads its shard of the model; rank 0 serves HTTP and the others
follow its plans (``lockstep.py``) until it stops.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from ..decoding.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    add_flags,
    from_flags,
)

PROG = "python -m mlx_batched_decode.serve"
# The server's scheduler defaults: a batch of 8, and steps of 128 tokens (half the decoder's
# default, for half its longest gap between two tokens while prompts arrive).
SERVER_SCHEDULER = SchedulerConfig(max_step_tokens=128, max_batch_size=8)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "An OpenAI-compatible server on BatchedDecoder: every step carries the running "
            "requests' decode tokens and chunks of arriving prompts in one forward pass. "
            "--engine mlx-lm runs mlx_lm.server with the plug-in instead (its own flags)."
        ),
    )
    parser.add_argument("--engine", choices=["native", "mlx-lm"], default="native",
                        help="native (default): this server; mlx-lm: mlx_lm.server with the "
                        "plug-in, every other argument passed to it")
    parser.add_argument("--model", required=True,
                        help="the mlx-lm model to serve: a folder, or a Hugging Face repo id "
                        "found in the local Hugging Face cache")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (8080)")
    parser.add_argument("--chat-template", default=None,
                        help="a chat template (Jinja) replacing the tokenizer's")
    parser.add_argument("--chat-template-args", type=json.loads, default={},
                        help="JSON keywords for apply_chat_template, e.g. "
                        "'{\"enable_thinking\": false}'")
    parser.add_argument("--temp", type=float, default=0.0,
                        help="default sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="default top-p (1.0)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="default top-k (0: disables top-k)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="default min-p (0.0: disables min-p)")
    parser.add_argument("--allowed-origins", type=lambda x: x.split(","), default=["*"],
                        help="the origins CORS allows, comma-separated (default: *)")
    parser.add_argument("--keepalive-interval", type=float, default=5.0,
                        help="seconds a stream stays silent before a keep-alive comment (5)")
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="default max_tokens of a request (512)")
    parser.add_argument("--max-context-length", type=int, default=None,
                        help="the most positions a request may reach, prompt + max_tokens "
                        "(default: the model's max_position_embeddings, else its tokenizer's "
                        "model_max_length, else 131072)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    # The engine's flags come from its configs: their checks, defaults and help texts.
    engine = parser.add_argument_group("engine (scheduler, KV cache, speculative decoding)")
    add_flags(engine, SERVER_SCHEDULER)
    engine.add_argument("--max-queue", type=int, default=64,
                        help="the most accepted requests waiting beyond the batch (64); "
                        "more at once are answered 503")
    add_flags(engine, CacheConfig())
    engine.add_argument("--draft-model", default=None,
                        help="a draft model folder: decode speculatively")
    add_flags(engine, SpeculativeConfig())
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds a stop waits for the requests held to end (30)")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="under mlx.launch: shard the model over the ranks; rank 0 serves "
                        "HTTP, the others step in lockstep with it")
    return parser


def context_length(config: dict, tokenizer, flag: Optional[int]) -> int:
    """The flag, else the loaded config's ``max_position_embeddings``, else the tokenizer's
    ``model_max_length`` (transformers' "unset" is a huge number), else 131072."""
    if flag is not None:
        return flag
    for value in (config.get("max_position_embeddings"), getattr(tokenizer, "model_max_length",
                                                                  None)):
        if isinstance(value, int) and 0 < value < 10**9:
            return value
    return 131072


def _load(path: str, chat_template: Optional[str]):
    """The model, its tokenizer and its config: from a folder, or a repo id in the local
    Hugging Face cache (mlx-lm's ``load`` resolves it)."""
    from mlx_lm.utils import load

    config = {"chat_template": chat_template} if chat_template else None
    return load(path, tokenizer_config=config, return_config=True)


def fingerprint() -> str:
    """Which build answers: this package's version, MLX's, the platform."""
    from importlib.metadata import version

    import mlx.core as mx

    return f"mlx-batched-decode-{version('mlx-batched-decode')}-{mx.__version__}-" + (
        platform.platform()
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configs from the flags; ``SystemExit`` with the configs' one message for a
    bad value or combination."""
    try:
        return EngineConfig(
            from_flags(CacheConfig, args),
            from_flags(SchedulerConfig, args),
            from_flags(SpeculativeConfig, args),
            draft=args.draft_model is not None,
        )
    except ValueError as error:
        raise SystemExit(f"{PROG}: {error}") from error


def _grammar_compiler(model, tokenizer):
    """The compiler of structured output's grammars for ``tokenizer`` over the model's logits
    (measured by one token, before any sharding); ``None`` without llguidance or for a
    tokenizer it cannot read (the server serves all else)."""
    import mlx.core as mx

    from ..decoding.grammar import GrammarCompiler

    try:
        width = model(mx.zeros((1, 1), dtype=mx.int32)).shape[-1]
        return GrammarCompiler(tokenizer, width)
    except (ImportError, ValueError) as error:
        logging.warning("no structured output (requests for it are refused): %s", error)
        return None


def build_engine(args: argparse.Namespace, group=None):
    """Load the model (and draft), sharded over ``group`` if given; returns the engine core and
    the tokenizer."""
    from ..decoding.engine_core import EngineCore
    from ..integrations.tensor_parallel import shard

    if args.max_tokens < 1:
        raise SystemExit(f"{PROG}: --max-tokens must be >= 1")
    if args.max_queue < 0:
        raise SystemExit(f"{PROG}: --max-queue must be >= 0")
    if args.keepalive_interval <= 0:
        raise SystemExit(f"{PROG}: --keepalive-interval must be > 0")
    from ..decoding.sampling_params import SamplingParams

    try:
        # The sampling defaults, checked as a request's knobs are.
        SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                       min_p=args.min_p)
    except ValueError as error:
        raise SystemExit(f"{PROG}: {error}") from error
    config = engine_config(args)
    model, tokenizer, model_config = _load(args.model, args.chat_template)
    draft = None if args.draft_model is None else _load(args.draft_model, None)[0]
    grammars = _grammar_compiler(model, tokenizer)
    try:
        if group is not None:
            shard(model, group)
            if draft is not None:
                shard(draft, group)
        core = EngineCore(model, config, draft, grammar_compiler=grammars)
    except ValueError as error:
        # A model the engine cannot serve: said once, no traceback.
        raise SystemExit(f"{PROG}: {error}") from error
    return core, tokenizer, model_config


def build_state(args: argparse.Namespace, core, tokenizer, model_config: dict, lockstep=None):
    """The engine and the state the handlers share, around ``core`` (whose model's config is
    ``model_config``)."""
    from .app import ServerState
    from .engine import Engine
    from .metrics import ServerMetrics
    from .protocol import DEFAULT_MODEL, Defaults

    metrics = ServerMetrics()
    # A folder is named by its absolute path, a repo id as given.
    model_dir = Path(args.model)
    model_id = str(model_dir.resolve()) if model_dir.exists() else args.model
    return ServerState(
        engine=Engine(core, metrics, args.max_queue, lockstep),
        tokenizer=tokenizer,
        metrics=metrics,
        model_id=model_id,
        model_names={DEFAULT_MODEL, args.model, model_id},
        vocab_size=core.runner.target.vocab_size(),
        context_length=context_length(model_config, tokenizer, args.max_context_length),
        defaults=Defaults(args.max_tokens, args.temp, args.top_p, args.top_k, args.min_p),
        chat_template_args=args.chat_template_args,
        allowed_origins=args.allowed_origins,
        keepalive_s=args.keepalive_interval,
        fingerprint=fingerprint(),
        stop_timeout=args.shutdown_timeout,
        grammars=core.grammar_compiler,
    )


def _uvicorn_server(app, args: argparse.Namespace):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose SIGINT/SIGTERM stop ends the process with status 0 (uvicorn
        raises the signal again once it has shut down, which would kill it)."""

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            signals = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self._stop) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def _stop(self, sig, frame) -> None:
            # A second SIGINT forces the exit, as uvicorn's own handler does.
            self.force_exit = self.should_exit and sig == signal.SIGINT
            self.should_exit = True

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=args.shutdown_timeout,
        # Clients connecting all at once are queued by the kernel, not refused.
        backlog=max(2048, 2 * (args.max_batch_size + args.max_queue)),
    )
    return Server(config)


def main(argv: Optional[list[str]] = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--engine", default="native")
    known, rest = engine.parse_known_args(argv)
    if known.engine == "mlx-lm":
        from ..integrations.mlx_lm.server import main as mlx_lm_main

        mlx_lm_main(rest)
        return
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    from .app import create_app
    from .lockstep import Lockstep, follow

    group = lockstep = None
    if args.tensor_parallel:
        import mlx.core as mx

        group = mx.distributed.init()
        if group.size() < 2:
            raise SystemExit(
                f"{PROG}: --tensor-parallel needs several processes: start it under mlx.launch, "
                f"e.g. mlx.launch -n 2 --backend ring --python \"$(which python)\" -- -m "
                "mlx_batched_decode.serve --tensor-parallel --model DIR"
            )
        lockstep = Lockstep(group)
    core, tokenizer, model_config = build_engine(args, group)
    if group is not None and group.rank() != 0:
        # Rank 0 owns the stop: a follower ends when its plans say so.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        follow(core.runner, lockstep)
        return
    state = build_state(args, core, tokenizer, model_config, lockstep)
    logging.info(
        "serving %s on http://%s:%d (max batch %d, queue %d, %d tokens a step)",
        state.model_id, args.host, args.port, args.max_batch_size, args.max_queue,
        args.max_step_tokens,
    )
    _uvicorn_server(create_app(state), args).run()
