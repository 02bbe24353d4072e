"""`jaxrl serve`: a model (a Hugging Face folder, or the demo model from its newest checkpoint,
or freshly initialised) behind the gRPC server, until SIGTERM or SIGINT."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Callable

from flax import nnx

from jaxrl.config import RunConfig
from jaxrl.errors import UserError
from jaxrl.models import Transformer, from_hf, split_params
from jaxrl.models.tokenizer import CharTokenizer, HFTokenizer
from jaxrl.rl.tasks.arithmetic import ArithmeticTask
from jaxrl.train.checkpoint import has_checkpoint
from serving.engine import Engine, EngineConfig
from serving.orchestrator import Orchestrator
from serving.server import Server, is_loopback


def load_model(model_dir: str | None, checkpoint_dir: str | Path, log: Callable[[str], None]):
    """(model, tokenizer, description)."""
    if model_dir:
        model = from_hf(model_dir)
        return model, HFTokenizer(model_dir), f"{model.cfg.family} from {model_dir}"
    if has_checkpoint(checkpoint_dir):
        from jaxrl.run.warmup import restore_for_eval
        model, _, tokenizer, step = restore_for_eval(checkpoint_dir)
        return model, tokenizer, f"the demo model, step {step} of {checkpoint_dir}"
    cfg = RunConfig()
    log(f"no checkpoint in {checkpoint_dir}: serving a freshly initialised demo model")
    model = Transformer(cfg.model, rngs=nnx.Rngs(cfg.train.seed))
    return model, CharTokenizer(ArithmeticTask.alphabet), "the demo model (random weights)"


def serve(*, model_dir: str | None, checkpoint_dir: str, host: str, port: int,
          engine_config: Callable[[int], EngineConfig], update_token: str | None,
          log: Callable[[str], None] = print, ready: threading.Event | None = None,
          tls: tuple[bytes, bytes] | None = None, allow_remote: bool = False,
          max_concurrent_rpcs: int = 1024, max_queued: int = 1024) -> None:
    """`engine_config(context)`: the engine's sizes, given the model's context length.
    `max_queued`: requests waiting for a slot; more get RESOURCE_EXHAUSTED."""
    if not is_loopback(host) and not allow_remote:
        raise UserError(f"--host {host} is reachable from other machines; add --allow-remote "
                        f"to bind it (and --tls-cert/--tls-key, or the weight-update token "
                        f"crosses the network in clear)")
    model, tokenizer, what = load_model(model_dir, checkpoint_dir, log)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise UserError(f"tokenizer has {tokenizer.vocab_size} ids, model only "
                        f"{model.cfg.vocab_size}")
    engine_cfg = engine_config(model.cfg.max_seq_len)
    if engine_cfg.max_len > model.cfg.max_seq_len:
        raise UserError(f"--max-len {engine_cfg.max_len} exceeds the model's max_seq_len "
                        f"{model.cfg.max_seq_len}")
    engine = Engine(model.cfg, engine_cfg)
    # Version -1: the weights it was started with, no trainer's; a trainer's first push (any
    # version >= 0) replaces them.
    engine.load_params(split_params(model)[1], version=-1)
    del model   # the engine holds its own copy of the weights, in the serving dtype
    orchestrator = Orchestrator(engine, eos_id=tokenizer.eos_id, max_queued=max_queued).start()
    try:
        server = Server(orchestrator, tokenizer, host=host, port=port,
                        update_token=update_token, tls=tls, allow_remote=allow_remote,
                        max_concurrent_rpcs=max_concurrent_rpcs).start()
    except (OSError, RuntimeError) as e:
        orchestrator.stop()
        raise UserError(f"cannot listen on {host}:{port}: {e}") from e
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log(f"jaxrl serve: ready on {server.address}{' (TLS)' if tls else ''}: {what}; "
        f"{engine_cfg.max_concurrent_decodes} "
        f"slots, max_len {engine_cfg.max_len}, {engine.num_pages - 1} KV pages of "
        f"{engine_cfg.page_size} tokens; weight updates "
        f"{'enabled' if update_token else 'disabled (no update token)'}")
    if ready is not None:
        ready.set()
    stop.wait()
    log("jaxrl serve: shutting down")
    server.stop(grace=5.0)
    log("jaxrl serve: stopped")


def read_tls(cert: str | None, key: str | None) -> tuple[bytes, bytes] | None:
    """(certificate chain, private key) PEM bytes from --tls-cert and --tls-key, or None."""
    if (cert is None) != (key is None):
        raise UserError("--tls-cert and --tls-key go together: give both or neither")
    if cert is None:
        return None
    out = []
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise UserError(f"{flag} {path!r}: {(e.strerror or str(e)).lower()}") from None
        if b"-----BEGIN" not in data:
            raise UserError(f"{flag} {path!r} is not a PEM file")
        out.append(data)
    return out[0], out[1]


def read_update_token(path: str | None) -> str | None:
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise UserError(f"update token file {path!r} is empty")
        return token
    return os.environ.get("JAXRL_UPDATE_TOKEN") or None
