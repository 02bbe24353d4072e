"""`jaxrl serve`: a model (a Hugging Face folder, or the demo model from its newest checkpoint,
or freshly initialised) behind the gRPC server, until SIGTERM or SIGINT."""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config import RunConfig
from jaxrl.errors import UserError
from jaxrl.heap import frozen_heap
from jaxrl.models import (
    Transformer,
    abstract_model,
    from_hf,
    load_hf_config,
    lora,
    merge_params,
    quant,
    split_params,
)
from jaxrl.models.lora import LoraConfig
from jaxrl.models.peft_io import with_adapter
from jaxrl.models.tokenizer import CharTokenizer, HFTokenizer
from jaxrl.rl.tasks.arithmetic import ArithmeticTask
from jaxrl.train.checkpoint import has_checkpoint
from serving.core.orchestrator import Orchestrator
from serving.fleet.replicas import Replicas
from serving.frontends.server import Server, is_loopback
from serving.runner.constraints import Grammars
from serving.runner.engine import Engine, EngineConfig
from sharding.mesh import MeshConfig, make_mesh

SHUTDOWN_DEADLINE_S = 45.0   # from SIGTERM to exit, RPCs' grace and the engine's stop included


def load_model(model_dir: str | None, checkpoint_dir: str | Path, log: Callable[[str], None],
               place: Callable | None = None, lora_dir: str | None = None,
               adapters: LoraConfig | None = None):
    """(model, tokenizer, description). `place(model_cfg)`: the shardings (and dtype) to load a
    Hugging Face folder's tensors straight into: (dtype, pure dict of shardings). `lora_dir`:
    a PEFT LoRA folder merged into the weights loaded. `adapters`: LoRA adapters of this shape
    held apart from the weights (`hold_adapters`), for a trainer's adapter-only updates."""
    if lora_dir and adapters:
        raise UserError(f"--lora {lora_dir} merges an adapter into the weights and --lora-rank "
                        f"{adapters.rank} holds adapters apart for a trainer's updates: give "
                        f"one of them")
    model, tokenizer, what = _load_base(model_dir, checkpoint_dir, log, place)
    if lora_dir:
        try:
            model = with_adapter(model, lora_dir)
        except (OSError, ValueError) as e:
            raise UserError(f"--lora {lora_dir}: {e}") from None
        what += f", with the LoRA adapter in {lora_dir} merged"
    if adapters:
        model = hold_adapters(model, adapters)
        what += (f", holding LoRA adapters of rank {adapters.rank} on "
                 f"{','.join(model.cfg.lora.modules(bool(model.cfg.num_experts)))}")
    return model, tokenizer, what


def hold_adapters(model, adapters: LoraConfig):
    """`model` with LoRA adapters of shape `adapters` kept apart from its weights, so that a
    trainer's update may carry its adapters alone: a model without adapters gets zero ones (it
    serves as the base until the first update); one with adapters keeps them if they have
    that shape. UserError for adapters of another shape."""
    have = model.cfg.lora
    if have.enabled:
        if lora.same_shape(have, adapters):
            return model
        raise UserError(f"--lora-rank {adapters.rank} --lora-alpha {adapters.alpha:g} "
                        f"--lora-targets {','.join(adapters.targets)}: the checkpoint's model "
                        f"holds adapters of rank {have.rank}, alpha {have.alpha:g} on "
                        f"{','.join(have.targets)}; give those (or no --lora-rank)")
    cfg = dataclasses.replace(model.cfg, lora=dataclasses.replace(adapters, init_from=None))
    graphdef = split_params(abstract_model(cfg))[0]
    zeros = {"layers": {name: jnp.zeros(shape, jnp.float32)
                        for name, (shape, _) in lora.adapter_shapes(cfg).items()}}
    return merge_params(graphdef, lora.with_trainable(split_params(model)[1], zeros))


def quantized_model(model, kind: str = "int8"):
    """`model` with its layer projections in 8 bits (`kind`: int8 or fp8) and a scale per
    output channel (model.quantize; one already quantized as it is)."""
    if model.cfg.quantize not in ("none", kind):
        raise UserError(f"--quantize {kind}: the model's projections are {model.cfg.quantize} "
                        f"already")
    cfg = dataclasses.replace(model.cfg, quantize=kind)
    graphdef = split_params(abstract_model(cfg))[0]
    return merge_params(graphdef, quant.quantized(split_params(model)[1], cfg))


def _load_base(model_dir, checkpoint_dir, log, place):
    if model_dir:
        dtype, shardings = place(load_hf_config(model_dir)) if place else ("float32", None)
        model = from_hf(model_dir, dtype, shardings=shardings)
        return model, HFTokenizer(model_dir), f"{model.cfg.family} from {model_dir}"
    if has_checkpoint(checkpoint_dir):
        from jaxrl.trainer.warmup import restore_for_eval
        model, _, tokenizer, step = restore_for_eval(checkpoint_dir)
        return model, tokenizer, f"the demo model, step {step} of {checkpoint_dir}"
    cfg = RunConfig()
    log(f"no checkpoint in {checkpoint_dir}: serving a freshly initialised demo model")
    model = Transformer(cfg.model, rngs=nnx.Rngs(cfg.train.seed))
    return model, CharTokenizer(ArithmeticTask.alphabet), "the demo model (random weights)"


def serving_meshes(tensor: int, replicas: int, devices=None) -> list:
    """One mesh of `tensor` devices per replica, from this process's devices in order."""
    devices = list(devices if devices is not None else jax.local_devices())
    if tensor * replicas > len(devices):
        raise UserError(f"--tensor {tensor} x --replicas {replicas} needs {tensor * replicas} "
                        f"devices; this process has {len(devices)}")
    return [make_mesh(MeshConfig(fsdp=1, tensor=tensor), devices[i * tensor:(i + 1) * tensor])
            for i in range(replicas)]


def check_tensor(model_cfg, tensor: int, devices: int) -> None:
    """Refuses a tensor axis that does not divide the KV heads: the KV cache, the engine's
    largest buffer, would then be held whole on every device of the replica."""
    kv = model_cfg.num_kv_heads
    if kv % tensor or model_cfg.num_heads % tensor:
        fits = [t for t in range(1, devices + 1) if kv % t == 0 and model_cfg.num_heads % t == 0]
        raise UserError(f"--tensor {tensor} does not divide the model's {kv} KV heads (and "
                        f"{model_cfg.num_heads} query heads): every device would hold the whole "
                        f"KV cache. Use --tensor in {fits} and --replicas for the other "
                        f"devices (e.g. --tensor {max(fits)} --replicas "
                        f"{max(devices // max(fits), 1)})")


def _load_engines(opts: "ServeOptions", engine_config: Callable[[int], EngineConfig], meshes,
                  log: Callable[[str], None]) -> tuple[list[Engine], dict, object, str]:
    """One engine per mesh and the weights they serve (a Hugging Face folder loads straight
    onto the first engine's mesh, unless quantized after loading), the tokenizer, and what was
    loaded, in words."""
    tensor, adapters = opts.tensor, opts.adapters

    def first_engine(model_cfg) -> Engine:
        check_tensor(model_cfg, tensor, tensor * len(meshes))
        engine_cfg = engine_config(model_cfg.max_seq_len)
        if engine_cfg.max_len > model_cfg.max_seq_len:
            raise UserError(f"--max-len {engine_cfg.max_len} exceeds the model's max_seq_len "
                            f"{model_cfg.max_seq_len}")
        try:
            return Engine(model_cfg, engine_cfg, mesh=meshes[0])
        except ValueError as e:     # e.g. --attention pallas on a GPU
            raise UserError(str(e).replace("attention=", "--attention ").replace(
                "record_routes", "--record-routes")) from None

    engines: list[Engine] = []

    def place(model_cfg):
        if adapters:
            model_cfg = dataclasses.replace(model_cfg, lora=adapters)
        engines.append(first_engine(model_cfg))
        return engines[0].cfg.dtype, jax.tree.map(lambda a: a.sharding,
                                                  lora.frozen(engines[0].param_target))

    model, tokenizer, what = load_model(opts.model_dir, opts.checkpoint_dir, log,
                                        place if opts.quantize == "none" else None,
                                        opts.lora_dir, adapters)
    if opts.quantize != "none":
        model = quantized_model(model, opts.quantize)
        what += f", its layer projections {opts.quantize}"
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise UserError(f"tokenizer has {tokenizer.vocab_size} ids, model only "
                        f"{model.cfg.vocab_size}")
    if not engines:
        engines.append(first_engine(model.cfg))
    engines += [Engine(model.cfg, engines[0].cfg, mesh=mesh) for mesh in meshes[1:]]
    return engines, split_params(model)[1], tokenizer, what


def _open_http(orchestrator, tokenizer, model_dir: str | None, max_len: int, host: str,
               http_port: int, server: Server, log: Callable[[str], None]):
    """The OpenAI-compatible HTTP API beside the gRPC server; both stop if it cannot listen."""
    from serving.frontends import prometheus
    from serving.frontends.openai_api import OpenAIApp, start_http

    name = Path(model_dir).name if model_dir else "jaxrl-demo"
    app = OpenAIApp(orchestrator, tokenizer, name, max_len).app
    prometheus.mount(app, orchestrator)
    try:
        http, bound = start_http(app, host, http_port)
    except (OSError, RuntimeError) as e:
        server.stop(grace=0)
        orchestrator.stop()
        raise UserError(f"cannot listen on {host}:{http_port} (--http-port): {e}") from e
    log(f"jaxrl serve: OpenAI-compatible API on http://{host}:{bound}/v1 (model {name!r}; "
        f"plain HTTP{', reachable from other machines' if not is_loopback(host) else ''}), "
        f"Prometheus metrics on http://{host}:{bound}/metrics")
    return http


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What `jaxrl serve` serves and how it listens (its flags). `lora_dir`: a PEFT LoRA folder
    merged into the served weights; `adapters`: hold LoRA adapters of this shape apart from the
    weights, for a trainer's adapter-only updates. `tls`: (certificate chain, private key) PEM.
    `max_queued`: requests waiting for a slot; more get RESOURCE_EXHAUSTED. `tensor`,
    `replicas`: `replicas` engines, each tensor-parallel over `tensor` devices. `http_port`:
    also the OpenAI-compatible HTTP API (serving/frontends/openai_api.py) and /metrics there.
    `join`: a trainer's address to offer this server to (serving/fleet/join.py), as `advertise`."""

    model_dir: str | None = None
    checkpoint_dir: str = "runs/demo/checkpoints"
    host: str = "127.0.0.1"
    port: int = 9000
    update_token: str | None = None
    tls: tuple[bytes, bytes] | None = None
    allow_remote: bool = False
    max_concurrent_rpcs: int = 1024
    max_queued: int = 1024
    admission: str = "fifo"          # or longest_first: predicted-long groups first (StreamRL)
    tensor: int = 1
    replicas: int = 1
    http_port: int | None = None
    lora_dir: str | None = None
    adapters: LoraConfig | None = None
    quantize: str = "none"           # int8 or fp8: the layer projections held in 8 bits
    join: str | None = None          # a trainer's rl.generation.join to offer this server to
    advertise: str | None = None     # where that trainer reaches it (default: host and port)


def serve(opts: ServeOptions, engine_config: Callable[[int], EngineConfig],
          log: Callable[[str], None] = print, ready: threading.Event | None = None) -> None:
    """Serves until SIGTERM or SIGINT. `engine_config(context)`: the engine's sizes, given the
    model's context length. `ready` is set once the server answers."""
    if opts.join and opts.update_token is None:
        raise UserError("--join needs the update token (--update-token-file or "
                        "$JAXRL_UPDATE_TOKEN): the trainer checks it, and pushes weights with it")
    server, http = _start(opts, engine_config, log)
    with frozen_heap():     # the model, the engine's programs, the server: alive until the end
        _serve_until_stopped(opts, server, http, log, ready)


def _serve_until_stopped(opts: ServeOptions, server, http, log, ready) -> None:
    joiner = None
    if opts.join:
        from serving.fleet.join import Joiner

        joiner = Joiner(opts.join, opts.advertise or server.address, opts.update_token).start()
        log(f"jaxrl serve: joining the run at {opts.join} as {opts.advertise or server.address}")
    # The handler only appends to a list: a handler that takes a lock (Event.set) deadlocks
    # when the signal lands while the main thread holds that lock.
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stopping.append(signum))
    if ready is not None:
        ready.set()
    while not stopping:
        time.sleep(0.1)
    log("jaxrl serve: shutting down")
    # A shutdown that sticks (an RPC that never ends, a device call that never returns) prints
    # every thread's stack to stderr and exits with status 1 instead of hanging on; it stays
    # armed through interpreter exit, which runs JAX's and gRPC's own clean-up.
    faulthandler.dump_traceback_later(SHUTDOWN_DEADLINE_S, exit=True)
    if joiner is not None:
        joiner.stop(leave=True)         # the trainer moves this server's groups elsewhere
    if http is not None:
        from serving.frontends.openai_api import stop_http

        stop_http(http)
    server.stop(grace=5.0)
    log("jaxrl serve: stopped")


def _start(opts: ServeOptions, engine_config, log):
    """(the gRPC server, the HTTP server or None), both answering; logs the ready line."""
    o = opts
    if not is_loopback(o.host) and not o.allow_remote:
        raise UserError(f"--host {o.host} is reachable from other machines; add --allow-remote "
                        f"to bind it (and --tls-cert/--tls-key, or the weight-update token "
                        f"crosses the network in clear)")
    engines, params, tokenizer, what = _load_engines(
        o, engine_config, serving_meshes(o.tensor, o.replicas), log)
    engine_cfg = engines[0].cfg
    # Version -1: the weights it was started with, no trainer's; a trainer's first push (any
    # version >= 0) replaces them.
    grammars = Grammars(tokenizer, engines[0].model_cfg.vocab_size)
    orchestrators = [Orchestrator(e, params, version=-1, eos_id=tokenizer.eos_id,
                                  max_queued=o.max_queued, grammars=grammars,
                                  longest_first=o.admission == "longest_first")
                     for e in engines]
    del params
    per_replica = " per replica" if o.replicas > 1 else ""
    log(f"jaxrl serve: compiling the engine's programs ({len(engines[0].programs.shapes())} "
        f"shapes{per_replica})")
    orchestrator = (orchestrators[0] if o.replicas == 1 else Replicas(orchestrators)).start()
    log(f"jaxrl serve: compiled {sum(x.compiled_at_start for x in orchestrators)} programs in "
        f"{sum(x.compile_s for x in orchestrators):.1f} s; none is compiled while serving")
    try:
        server = Server(orchestrator, tokenizer, host=o.host, port=o.port,
                        update_token=o.update_token, tls=o.tls, allow_remote=o.allow_remote,
                        max_concurrent_rpcs=o.max_concurrent_rpcs).start()
    except (OSError, RuntimeError) as e:
        orchestrator.stop()
        raise UserError(f"cannot listen on {o.host}:{o.port}: {e}") from e
    http = None
    if o.http_port is not None:
        http = _open_http(orchestrator, tokenizer, o.model_dir, engine_cfg.max_len, o.host,
                          o.http_port, server, log)
    layout = f"; {o.replicas} replica(s) x tensor {o.tensor}" if o.tensor * o.replicas > 1 \
        else ""
    log(f"jaxrl serve: ready on {server.address}{' (TLS)' if o.tls else ''}: {what}{layout}; "
        f"{engine_cfg.max_concurrent_decodes * o.replicas} "
        f"slots, max_len {engine_cfg.max_len}, {engines[0].num_pages - 1} KV pages of "
        f"{engine_cfg.page_size} tokens{per_replica}; weight updates "
        f"{'enabled' if o.update_token else 'disabled (no update token)'}; CPU cores "
        f"{sorted(os.sched_getaffinity(0))}")
    return server, http


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
