"""Where an RL run generates, from its config: this process's engine on some of its devices
(`rl.placement`), or the `jaxrl serve` processes of `rl.generation.servers`; either way a
rollout fleet (jaxrl/rollout/fleet.py) and its weight publisher (jaxrl/rollout/publisher.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Callable

import jax

from jaxrl.config import ConfigError, RunConfig
from jaxrl.models import quant
from jaxrl.models.config import ModelConfig
from jaxrl.models.tokenizer import Tokenizer
from jaxrl.rollout.fleet import Fleet, Member, MemberState
from jaxrl.rollout.publisher import WeightPublisher
from jaxrl.rollout.registry import Registry
from serving.core.orchestrator import Orchestrator
from serving.fleet.client import RemoteGeneration
from serving.frontends.server import is_loopback
from serving.runner.constraints import Grammars
from serving.runner.engine import Engine, EngineConfig
from serving.runner.sampling import FEATURES
from sharding import mesh as shd


def placement(cfg: RunConfig, devices=None):
    """(trainer devices, engine devices); no engine devices when generation is remote."""
    devices = list(devices if devices is not None else jax.devices())
    if cfg.rl.generation.remote:
        return devices, []
    if cfg.rl.placement == "colocated":
        return devices, devices
    k = cfg.rl.engine_devices
    if k >= len(devices):
        raise ConfigError(f"rl.placement=split with rl.engine_devices={k} leaves no device to "
                          f"train on ({len(devices)} devices)")
    return devices[:-k], devices[-k:]


def engine_config(cfg: RunConfig, model_cfg: ModelConfig) -> EngineConfig:
    rl = cfg.rl
    if rl.sample_len > model_cfg.max_seq_len:
        raise ConfigError(f"{rl.sample_len_names} = {rl.sample_len} exceeds "
                          f"the model's max_seq_len={model_cfg.max_seq_len}")
    chunk = max(8, min(2 ** math.ceil(math.log2(rl.max_prompt_len)), 512))
    # Two prefill buckets (RL's prompts are of similar lengths; each bucket is a set of
    # programs compiled at start) and four prompts of the longest per prefill call.
    # The sampling programs hold what the run's own requests use (temperature; min_tokens for
    # answer-length completions); an agent's OpenAI requests may use any of it.
    features = (FEATURES if rl.agent.command else
                ("min_tokens",) if rl.completion_length == "answer" else ())
    return dataclasses.replace(rl.engine, max_len=rl.sample_len + 1,
                               max_prefill_length=rl.prefill_len, prefill_chunk=chunk,
                               min_bucket=max(8, chunk // 2), prefill_budget=max(64, 4 * chunk),
                               dtype=model_cfg.dtype, record_routes=bool(model_cfg.num_experts),
                               sampling_features=features)


@dataclasses.dataclass
class Generators:
    """The run's fleet and publisher, and its in-process orchestrator if it has one."""
    fleet: Fleet
    publisher: WeightPublisher
    local: Orchestrator | None
    registry: Registry | None = None      # where servers join (rl.generation.join)
    lender: Member | None = None          # the trainer's devices' engine (rl.multiplex)

    def close(self) -> None:
        if self.registry is not None:
            self.registry.close()
        self.publisher.close()
        self.fleet.close()
        if self.local is not None:
            self.local.stop()
        if self.lender is not None:
            self.lender.generation.stop()
        for m in self.fleet.members + self.fleet.departed:
            if m.remote:
                m.generation.close()


def rollout_model(model_cfg: ModelConfig, weights: str) -> ModelConfig:
    """The model the rollout engines hold (rl.generation.weights): the trainer's, or the same
    with its layer projections in 8 bits (int8 or fp8)."""
    return model_cfg if weights == "model" else dataclasses.replace(model_cfg, quantize=weights)


def rollout_weights(model_cfg: ModelConfig, weights: str) -> Callable | None:
    """What the publisher makes of the trainer's weights for the engines (a compiled
    quantization, on the trainer's devices), or None: the weights as they are."""
    if weights == "model":
        return None
    served = rollout_model(model_cfg, weights)
    return jax.jit(lambda params: quant.quantized(params, served))


def start(cfg: RunConfig, model_cfg: ModelConfig, tokenizer: Tokenizer, params, version: int,
          engine_devices, log: Callable[[str], None], trainer_devices=()) -> Generators:
    """Starts generation serving `params` as weights `version`. Remote servers are brought to
    them before they take work; those that cannot be reached yet join when they answer. With
    rl.multiplex, an engine on `trainer_devices` joins the fleet resting (the trainer lends it
    while it waits for data)."""
    served = rollout_weights(model_cfg, cfg.rl.generation.weights)   # one compiled quantizer
    gens = _local(cfg, model_cfg, tokenizer, params, version, engine_devices, served, log) \
        if not cfg.rl.generation.remote else \
        _remote(cfg, model_cfg, tokenizer, params, version, served, log)
    if cfg.rl.multiplex:
        try:
            gens.lender = _lender(cfg, model_cfg, tokenizer, served(params) if served else params,
                                  version, trainer_devices)
        except BaseException:
            gens.close()
            raise
        gens.fleet.join(gens.lender)
        log(f"multiplexing: the trainer's {len(trainer_devices)} device(s) generate while it "
            f"waits for data ({gens.lender.slots} slots)")
    return gens


def _orchestrator(cfg: RunConfig, model_cfg: ModelConfig, tokenizer: Tokenizer, weights,
                  version: int, devices) -> Orchestrator:
    """An in-process engine on `devices` serving `weights` (already the rollout weights:
    `rollout_weights`) as `version`, started."""
    g = cfg.rl.generation
    served_cfg = rollout_model(model_cfg, g.weights)
    engine = Engine(served_cfg, engine_config(cfg, served_cfg),
                    mesh=shd.make_mesh(shd.MeshConfig(fsdp=1, tensor=-1), devices))
    return Orchestrator(engine, weights, version=version,
                        eos_id=tokenizer.eos_id, max_queued=4 * cfg.rl.batch_size,
                        longest_first=server_admission(cfg.rl.admission) == "longest_first",
                        grammars=Grammars(tokenizer, model_cfg.vocab_size)
                        ).start(compile_later=g.compile == "as_needed")


def _lender(cfg: RunConfig, model_cfg: ModelConfig, tokenizer: Tokenizer, weights, version: int,
            trainer_devices) -> Member:
    """The trainer's devices as a fleet member tagged to train and to generate, resting (paused)
    until the trainer first waits for data. The publisher updates it like any in-process
    engine: a copy of the weights on the same devices (the trainer donates its own to each
    step), no push over a wire."""
    local = _orchestrator(cfg, model_cfg, tokenizer, weights, version, trainer_devices)
    local.pause()
    return Member("trainer", local, local.scheduler.num_slots, remote=False, version=version,
                  state=MemberState.RESTING, tags=frozenset({"train", "generate"}))


def _local(cfg: RunConfig, model_cfg: ModelConfig, tokenizer: Tokenizer, params, version: int,
           engine_devices, served: Callable | None, log: Callable[[str], None]) -> Generators:
    """This process's engine on `engine_devices`, the fleet's one member; `served` makes the
    rollout weights of the trainer's (rollout_weights)."""
    g = cfg.rl.generation
    local = _orchestrator(cfg, model_cfg, tokenizer, served(params) if served else params,
                          version, engine_devices)
    if local.compiled_at_start:
        log(f"engine: compiled {local.compiled_at_start} programs in {local.compile_s:.1f} s "
            + ("(its largest batches' and chunks'; smaller ones compile beside generation "
               "once it needs them, padded to a compiled size meanwhile)"
               if g.compile == "as_needed" else
               "(every shape it can run; none is compiled while it generates)"))
    members = [Member("local", local, cfg.rl.engine.max_concurrent_decodes, remote=False,
                      version=version, state=MemberState.READY)]
    fleet = Fleet(members, eos_id=tokenizer.eos_id, wait_s=g.wait_s, warn=log)
    return Generators(fleet, WeightPublisher(fleet, served=served, warn=log), local)


def transfer_for(transfer: str, address: str) -> str:
    """The weight transfer of the server at `address` (rl.generation.transfer): `auto` is tcp
    for a server at a loopback address, on this host (its pulls reach the trainer's bulk server
    and share memory with the servers beside it), and the gRPC stream for any other (which may
    not reach the trainer's bulk port)."""
    if transfer != "auto":
        return transfer
    return "tcp" if is_loopback(address.rsplit(":", 1)[0]) else "grpc"


def _remote(cfg: RunConfig, model_cfg: ModelConfig, tokenizer: Tokenizer, params, version: int,
            served: Callable | None, log: Callable[[str], None]) -> Generators:
    """The fleet of `jaxrl serve` processes: those listed (one that does not answer yet joins
    when it does) and, with rl.generation.join, those that offer themselves during the run."""
    g = cfg.rl.generation
    token, tls_ca = update_token(g.token_file), _read(g.tls_ca, "rl.generation.tls_ca")

    def reach(address: str) -> RemoteGeneration:
        return RemoteGeneration(address, token=token, tls_ca=tls_ca,
                                rpc_timeout_s=g.heartbeat_timeout_s,
                                transfer=transfer_for(g.transfer, address),
                                transfer_host=g.transfer_host,
                                stream_interval_ms=g.stream_interval_ms)

    def admit(address: str) -> Member:
        """A server that answers and serves this run's model, as a joining member."""
        remote = reach(address)
        try:
            metrics = remote.metrics()
            check_server(cfg, tokenizer, address, metrics)
        except BaseException:
            remote.close()
            raise
        return Member(address, remote, int(metrics["slots"]), remote=True, last_metrics=metrics)

    members = []
    for address in g.servers:
        try:
            members.append(admit(address))
        except ConnectionError as e:
            log(f"generation: {address} does not answer yet ({e}); it joins when it does")
            members.append(Member(address, reach(address), cfg.rl.group_size, remote=True,
                                  state=MemberState.SET_ASIDE, why_down="not reached yet"))
    fleet = Fleet(members, eos_id=tokenizer.eos_id, heartbeat_s=g.heartbeat_s,
                  heartbeat_timeout_s=g.heartbeat_timeout_s, wait_s=g.wait_s, warn=log)
    publisher = WeightPublisher(fleet, deadline_s=g.push_deadline_s, wire_dtype=model_cfg.dtype,
                                served=served, elastic=bool(g.join), warn=log)
    publisher.publish(params, version)
    registry = None
    if g.join:
        registry = Registry(fleet, publisher, admit, token, g.join)
        log(f"generation: servers join this run at {registry.address} "
            f"(jaxrl serve --join {registry.address})")
    return Generators(fleet, publisher, None, registry)


def server_admission(admission: str) -> str:
    """What an engine admits by for rl.admission (an oracle's lengths come with each group)."""
    return "fifo" if admission == "fifo" else "longest_first"


def check_server(cfg: RunConfig, tokenizer: Tokenizer, address: str, metrics: dict) -> None:
    """A server that cannot serve this run's groups is a configuration error, said up front."""
    rl = cfg.rl
    wants = {"eos_id": tokenizer.eos_id, "vocab_size": cfg.model.vocab_size}
    for key, value in wants.items():
        if metrics.get(key) != value:
            raise ConfigError(f"generation server {address} has {key}={metrics.get(key)}; "
                              f"this run needs {value} (is it serving the same model?)")
    if metrics["max_len"] < rl.sample_len + 1 or metrics["max_prefill_length"] < rl.prefill_len:
        raise ConfigError(f"generation server {address} takes prompts of up to "
                          f"{metrics['max_prefill_length']} tokens and sequences of up to "
                          f"{metrics['max_len']}; this run needs {rl.prefill_len} and "
                          f"{rl.sample_len + 1} (jaxrl serve --max-prefill-length, --max-len)")
    held = metrics.get("quantize", "none")
    wanted = rollout_model(cfg.model, rl.generation.weights).quantize
    if held != wanted:
        raise ConfigError(f"generation server {address} holds {held} weights (model.quantize); "
                          f"this run (rl.generation.weights={rl.generation.weights}, "
                          f"model.quantize={cfg.model.quantize}) needs "
                          + (f"{wanted} ones: start it with jaxrl serve --quantize {wanted}"
                             if wanted != "none" else "the model's own: start it without "
                             f"--quantize, or set rl.generation.weights={held}"))
    wanted_admission = server_admission(rl.admission)
    if metrics.get("admission", "fifo") != wanted_admission:
        raise ConfigError(f"generation server {address} admits groups by "
                          f"{metrics.get('admission', 'fifo')}; this run (rl.admission="
                          f"{rl.admission}) needs {wanted_admission}: start it with "
                          f"--admission {wanted_admission}")
    if metrics["slots"] < rl.group_size:
        raise ConfigError(f"generation server {address} has {metrics['slots']} slots; a group "
                          f"needs rl.group_size={rl.group_size}")


def update_token(path: str) -> str | None:
    """The servers' weight-update token: from `path`, else $JAXRL_UPDATE_TOKEN."""
    if path:
        token = _read(path, "rl.generation.token_file").decode().strip()
        if not token:
            raise ConfigError(f"rl.generation.token_file {path!r} is empty")
        return token
    return os.environ.get("JAXRL_UPDATE_TOKEN") or None


def _read(path: str, key: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{key} {path!r}: {(e.strerror or str(e)).lower()}") from None
