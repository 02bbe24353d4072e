"""`jaxrl tinker`: a Hugging Face model behind the Tinker API (jaxrl/tinker/), LoRA training
clients and their samplers on one copy of the base weights, until SIGTERM or SIGINT."""

from __future__ import annotations

import dataclasses
import os
import signal

import time
from pathlib import Path
from typing import Callable

from jaxrl.errors import UserError


@dataclasses.dataclass(frozen=True)
class TinkerOptions:
    model_dir: str
    name: str | None = None          # the base_model name clients give (default: the folder's)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None       # None: any key is taken
    max_len: int | None = None       # the context (default: the model's, at most 2048)
    max_lora_rank: int = 32
    max_adapters: int = 8            # adapter sets the engine holds: clients sampled at once
    slots: int = 32                  # the engine's decode batch
    state_dir: str = "tinker_state"  # save_state's Orbax checkpoints


def _print(line: str) -> None:
    print(line, flush=True)      # a supervisor reading the pipe sees the ready line at once


def start(o: TinkerOptions, log: Callable[[str], None] = _print):
    """(service, HTTP server, port bound), answering."""
    from jaxrl.commands.serve import hold_adapters
    from jaxrl.models import from_hf, split_params
    from jaxrl.models.tokenizer import HFTokenizer
    from jaxrl.tinker.app import make_app
    from jaxrl.tinker.sampler import Sampler, held_config
    from jaxrl.tinker.service import Service
    from jaxrl.tinker.training import Trainer
    from serving.core.orchestrator import Orchestrator
    from serving.frontends.http_server import start_http
    from serving.runner.engine import Engine, EngineConfig

    if not (Path(o.model_dir) / "config.json").exists():
        raise UserError(f"--model {o.model_dir}: not a Hugging Face folder (no config.json)")
    if o.api_key is not None and not o.api_key.startswith("tml-"):
        raise UserError("--api-key must start with 'tml-', as the tinker SDK requires of keys")
    model = from_hf(o.model_dir, "float32")
    tokenizer = HFTokenizer(o.model_dir)
    max_len = o.max_len or min(model.cfg.max_seq_len, 2048)
    if max_len > model.cfg.max_seq_len:
        raise UserError(f"--max-len {max_len} exceeds the model's context "
                        f"{model.cfg.max_seq_len}")
    trainer = Trainer(model, max_len)
    held = held_config(o.max_lora_rank, o.max_adapters)
    served = hold_adapters(model, held)
    engine = Engine(served.cfg, EngineConfig(max_concurrent_decodes=o.slots, max_len=max_len,
                                             max_prefill_length=max_len - 1,
                                             prefill_chunk=min(256, max_len // 2),
                                             prefill_budget=min(512, max_len), score=True))
    orchestrator = Orchestrator(engine, split_params(served)[1], eos_id=tokenizer.eos_id)
    t0 = time.perf_counter()
    orchestrator.start()
    log(f"jaxrl tinker: engine compiled in {time.perf_counter() - t0:.1f} s")
    name = o.name or Path(o.model_dir).name
    service = Service(trainer, Sampler(orchestrator, tokenizer, held), name,
                      str(Path(o.model_dir).absolute()), o.state_dir, o.max_lora_rank, log)
    try:
        http, port = start_http(make_app(service, o.api_key), o.host, o.port)
    except (OSError, RuntimeError) as e:
        service.stop()
        orchestrator.stop()
        raise UserError(f"cannot listen on {o.host}:{o.port}: {e}") from e
    log(f"jaxrl tinker: ready on http://{o.host}:{port} (TINKER_BASE_URL): {name} "
        f"({model.cfg.family}, context {max_len}), LoRA ranks up to {o.max_lora_rank}, "
        f"{o.max_adapters} adapter sets decoding together, "
        f"{'API key checked' if o.api_key else 'any API key taken'}")
    return service, http, port


def tinker(o: TinkerOptions, log: Callable[[str], None] = _print) -> None:
    from serving.frontends.http_server import stop_http

    service, http, _ = start(o, log)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stopping.append(signum))
    while not stopping:
        time.sleep(0.1)
    log("jaxrl tinker: shutting down")
    stop_http(http)
    service.stop()
    service.sampler.orchestrator.stop()
    log("jaxrl tinker: stopped")


def options(args) -> TinkerOptions:
    return TinkerOptions(model_dir=args.model, name=args.name, host=args.host, port=args.port,
                         api_key=args.api_key or os.environ.get("TINKER_API_KEY") or None,
                         max_len=args.max_len, max_lora_rank=args.max_lora_rank,
                         max_adapters=args.max_adapters,
                         slots=args.slots, state_dir=args.state_dir)



