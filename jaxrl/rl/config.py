"""Configuration of reinforcement learning: the algorithm (groups, advantages, loss, filters)
and how rollouts are produced and consumed (mode, placement, engine, pipeline)."""

from __future__ import annotations

import dataclasses
import functools
import typing
import warnings
from typing import Literal

from jaxrl.optim_config import OptimConfig
from serving.runner.engine_config import EngineConfig


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Where rollouts are generated: this process's engine (no servers: `rl.placement` says on
    which devices), or the `jaxrl serve` processes listed (jaxrl/rollout/fleet.py)."""

    # host:port of each generation server, e.g. "127.0.0.1:9001,127.0.0.1:9002"; empty: local.
    servers: tuple[str, ...] = ()
    # host:port where servers join this run while it runs (`jaxrl serve --join host:port`,
    # with the update token; port 0: any free port, logged) and leave it: an elastic fleet
    # (jaxrl/rollout/registry.py). Empty: the fleet is the servers listed above.
    join: str = ""
    # The servers' weight-update token: read from this file, else from $JAXRL_UPDATE_TOKEN.
    token_file: str = ""
    tls_ca: str = ""                 # PEM root certificates: talk TLS to the servers
    push_deadline_s: float = 60.0    # a weight push not done by then fails (member set aside)
    heartbeat_s: float = 5.0         # how often each server is asked for its counters ...
    heartbeat_timeout_s: float = 10.0  # ... and how long it may take to answer
    wait_s: float = 600.0            # the run fails if no server can take work for this long
    # How weights reach the servers: grpc (streamed in pieces over their gRPC port: portable),
    # jax (each server pulls them device to device from a jax.experimental.transfer server of
    # the trainer's process 0: serving/weights/transfer.py) or tcp (each pulls them over a plain TCP
    # connection into its host memory, the servers relaying them along a chain so the trainer
    # sends each byte once, and servers on one host sharing one copy: serving/weights/bulk.py);
    # auto: tcp for a server at a loopback address (those `launch` starts included), which reaches
    # the trainer on this host, grpc for any other. The pull paths bind transfer_host, which
    # the servers must reach, and have no authentication of their own beyond the offer's
    # random id: a trusted network only.
    transfer: Literal["auto", "grpc", "jax", "tcp"] = "auto"
    transfer_host: str = "127.0.0.1"
    # A server gathers each sample's tokens for up to this long and sends them in one message
    # (0: every token as it is drawn): the trainer's process reads a message per 50 ms per
    # sample rather than per token, which leaves its cores to the train step.
    stream_interval_ms: int = 50
    # Servers this run starts itself: `launch` `jaxrl serve` processes on 127.0.0.1 (instead of
    # listing servers), from the run's newest checkpoint, stopped with the run. cpus: the cores
    # they run on ("1", "2-3", "4-7,12"), split evenly among them; the trainer is pinned to the
    # machine's other cores. On a CPU host that is rl.placement=split done with processes: the
    # trainer and the engine on cores of their own (jaxrl/rollout/local_servers.py).
    launch: int = 0
    cpus: str = ""
    # This process's engine: as_needed compiles the programs of its largest batches and prefill
    # chunks before the first step and those of smaller ones beside generation once calls ask
    # for them (padded to a compiled size meanwhile: the soonest first step); all compiles
    # every program before it generates, as `jaxrl serve` does (serving/runner/programs.py).
    compile: Literal["as_needed", "all"] = "as_needed"
    # The rollout engine's weights: as the model holds them, or int8 / fp8 (float8_e4m3fn): each
    # layer projection in 8 bits with a float32 scale per output channel, quantized by the
    # trainer at every publish (decode reads and a push carries a quarter of float32's bytes,
    # half of bfloat16's; fp8 as vLLM's and verl's FP8 rollouts, int8 everywhere). The sampler's
    # log-probs then differ from the trainer's; the loss's ratio corrects for it (rl.loss=tis,
    # rl.rollout_correction) and each step logs the gap (logprob_abs_diff_*).
    weights: Literal["model", "int8", "fp8"] = "model"

    def __post_init__(self):
        for name in ("push_deadline_s", "heartbeat_s", "heartbeat_timeout_s", "wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rl.generation.{name}={getattr(self, name)} must be > 0")
        for address in self.servers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"rl.generation.servers: {address!r} is not host:port")
        if self.join:
            host, sep, port = self.join.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ValueError(f"rl.generation.join={self.join!r} is not host:port")
        if len(set(self.servers)) != len(self.servers):
            raise ValueError(f"rl.generation.servers lists a server twice: {self.servers}")
        if self.stream_interval_ms < 0:
            raise ValueError(f"rl.generation.stream_interval_ms={self.stream_interval_ms} must "
                             f"be >= 0")
        if self.launch < 0:
            raise ValueError(f"rl.generation.launch={self.launch} must be >= 0")
        if self.cpus and not self.launch:
            raise ValueError(f"rl.generation.cpus={self.cpus!r} pins launched servers; set "
                             f"rl.generation.launch too")

    @property
    def remote(self) -> bool:
        return bool(self.servers) or self.launch > 0 or bool(self.join)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """An external agent program that produces the rollouts instead of the task's own
    environment (jaxrl/rollout/agents.py): any program written against an OpenAI client, run as
    `workers` processes that take episodes as JSON lines on stdin and report their rewards on
    stdout. Held-out evaluation still uses the task's own environment."""

    command: tuple[str, ...] = ()     # the program and its arguments; empty: no agent
    workers: int = 1                  # agent processes
    episodes_per_worker: int = 8      # episodes a worker is given at once
    timeout_s: float = 300.0          # an episode not reported by then is dropped (counted)
    restarts: int = 3                 # a worker that exits is restarted; after this many exits
    #                                   in a row with no episode finished, the run stops

    def __post_init__(self):
        for name in ("workers", "episodes_per_worker"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl.agent.{name}={getattr(self, name)} must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError(f"rl.agent.timeout_s={self.timeout_s} must be > 0")
        if self.restarts < 0:
            raise ValueError(f"rl.agent.restarts={self.restarts} must be >= 0")
        if any(not isinstance(a, str) or not a for a in self.command):
            raise ValueError(f"rl.agent.command={list(self.command)} must be a list of "
                             f"non-empty strings (the program, then its arguments)")


# rl.engine's fields that the run sets from its other keys (jaxrl/rollout/generation.py), and
# what each follows from.
ENGINE_DERIVED = {
    "max_len": "rl.max_prompt_len + rl.max_new_tokens (an episode's tokens, multi-turn)",
    "max_prefill_length": "rl.max_prompt_len (an episode's tokens, multi-turn)",
    "prefill_chunk": "rl.max_prompt_len", "min_bucket": "rl.max_prompt_len",
    "prefill_budget": "rl.max_prompt_len", "dtype": "model.dtype",
    "record_routes": "the model (a mixture of experts records its routes)",
    "sampling_features": "the run's sampling (rl.completion_length, rl.agent)",
}


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """RL after the supervised warm-up (the first train.steps optimizer steps)."""

    # Keys of earlier releases: refused in config files and overrides with their new names,
    # taken from Python callers with a DeprecationWarning (_taking_renamed, below).
    RENAMED: typing.ClassVar[dict[str, str]] = {
        "slots": "engine.max_concurrent_decodes", "engine_attention": "engine.attention",
        "engine_kv_cache_dtype": "engine.kv_cache_dtype"}

    steps: int = 0                  # RL optimizer steps after the warm-up; 0: warm-up only
    # async: PipelineRL (the engine never stops; weights change in flight after every step).
    # sync: conventional RL (generate a batch with fixed weights, train on it, repeat).
    # partial: sync with partial rollouts (SeamlessFlow, APRIL): the engine is kept full and
    # generates until a batch is ready, then pauses while the trainer steps; unfinished
    # sequences keep their tokens and pages and continue under the new weights.
    mode: Literal["async", "sync", "partial"] = "async"
    # colocated: trainer and engine share the devices; split: the last `engine_devices`
    # devices serve, the others train.
    placement: Literal["colocated", "split"] = "colocated"
    engine_devices: int = 1
    # SeamlessFlow's spatiotemporal multiplexing: the trainer's devices are tagged to train and
    # to generate. While the trainer waits for a batch they run an engine of their own beside
    # the others (the servers, or rl.placement=split's engine devices), serving the newest
    # weights; once the batch is ready its unfinished groups continue on the others from the
    # tokens they reached, and the devices train (jaxrl/rollout/fleet.py: lend, withdraw).
    multiplex: bool = False
    prompts_per_step: int = 8       # groups per optimizer step
    group_size: int = 8             # samples per prompt (the advantage baseline's group)
    max_prompt_len: int = 16        # longer prompts are skipped (counted)
    max_new_tokens: int = 8         # completion budget per sample (per model turn)
    # free: a sample ends at its EOS (or max_new_tokens). answer: every sample of a single-turn
    # task is as long as its problem's reference answer in tokens, then one token more for its
    # EOS (min_tokens bans EOS until then; a sample without EOS there is cut): a workload whose
    # lengths follow the task's drawn distribution whatever the model has learned, the same in
    # every run and variant (bench/long_tail.py). Set filter_overlong=false with it.
    completion_length: Literal["free", "answer"] = "free"
    # Multi-turn tasks (jaxrl/rl/env.py): model turns per episode, and the tokens an episode
    # may add after its prompt (the model's and the environment's; 0: max_turns x
    # max_new_tokens). Single-turn tasks take max_turns=1.
    max_turns: int = 1
    max_episode_tokens: int = 0
    temperature: float = 1.0        # sampling temperature (the trainer's pi uses the same)
    # Which waiting group the engine admits next: fifo, or longest_first (StreamRL's
    # skewness-aware dispatch: predicted-long groups first, so the tail starts early; the
    # prediction is learned online from finished groups, serving/core/length_predictor.py), or
    # longest_first_oracle: the same by each problem's reference answer in tokens, the lengths
    # a predictor could at best know (exact with completion_length=answer): a measuring aid.
    # Generation servers must be started with --admission longest_first for either (those
    # rl.generation.launch starts are).
    admission: Literal["fifo", "longest_first", "longest_first_oracle"] = "fifo"
    # The rollout engine's settings, EngineConfig's own (serving/runner/engine_config.py, the
    # same as jaxrl serve's flags and defaults): max_concurrent_decodes (slots: concurrent
    # sequences), attention (over the KV pages: reference, loop, native, pallas, triton; auto:
    # native on CPU, reference on GPU and TPU), kv_cache_dtype (auto, or fp8: the sampler's
    # log-probs move a little from the trainer's, which the loss's ratio corrects for, and each
    # step logs the gap, logprob_abs_diff_*), page_size, page_buckets, num_pages,
    # memory_fraction, steps_per_dispatch. The lengths, prefill chunks, dtype, sampling
    # features and route recording follow from this run's other keys (ENGINE_DERIVED).
    engine: EngineConfig = EngineConfig()
    # Policy loss: tis = truncated importance sampling REINFORCE (PipelineRL's default),
    # ppo = PPO-clip, gspo = GSPO (sequence-level ratio).
    loss: Literal["tis", "ppo", "gspo"] = "tis"
    tis_cap: float = 2.0            # tis: importance weight min(pi/mu, tis_cap)
    # Rollout correction, a mask on top of any loss for tokens whose ratio r = pi/mu is out of
    # [correction_low, correction_high] (jaxrl/rl/losses.py): none; icepop (per token, as
    # IcePop); seq_mis (a sequence's product of ratios, verl's sequence rejection); geo_mis
    # (its geometric mean). Masked tokens get no gradient and leave the loss's mean.
    rollout_correction: Literal["none", "icepop", "seq_mis", "geo_mis"] = "none"
    correction_low: float = 0.5
    correction_high: float = 5.0
    # The behaviour log-prob mu of a token the trainer's own weights generated (lag 0): engine
    # (what the sampler reported: the ratio then also corrects sampler/trainer numerics, as in
    # truncated importance sampling) or trainer (its own recomputation, as verl recomputes
    # old log-probs: ratio exactly 1 on those tokens, the numeric gap ignored; no extra pass,
    # since the step's loss computes them anyway). Tokens of older weights keep the engine's.
    behaviour_logprobs: Literal["engine", "trainer"] = "engine"
    # A mixture-of-experts model's routing: the in-process engine records the experts it routed
    # each token to, and every step logs the share of lag-0 tokens whose experts the trainer's
    # routers choose differently (router_mismatch). own: the trainer routes with its own
    # routers; replay: it uses the engine's experts (weighted by its own routers, which still
    # learn), as verl's and prime-rl's routing replay, so sampler and trainer run the same
    # experts. `jaxrl serve` processes send it back when started with --record-routes (as
    # rl.generation.launch does for such a model); replay stops the run on a sample without.
    moe_routing: Literal["own", "replay"] = "own"
    clip_low: float = 0.2           # ppo/gspo: ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2          # the upper side (DAPO's clip-higher: above clip_low)
    kl_coef: float = 0.0            # k3 KL penalty to the frozen warm-up model; 0: none
    normalize_std: bool = False     # divide advantages by the group's reward std
    # Multi-turn episodes: every model token gets its episode's advantage (episode), or each
    # turn its own (per_turn): the discounted return from that turn on, less the mean of the
    # same over the group's other episodes that reached that turn (jaxrl/rl/advantages.py).
    turn_advantage: Literal["episode", "per_turn"] = "episode"
    turn_discount: float = 1.0      # per_turn: gamma from one turn's reward to the turn before
    filter_zero_advantage: bool = True  # drop groups whose rewards are all equal
    filter_overlong: bool = True    # drop samples cut off by max_new_tokens
    # When no sample has passed the filters for this long, the run stops with an error naming
    # the filter that dropped them (it also says which filters drop most, every few steps).
    filter_wait_s: float = 300.0
    # A reward that raises or takes longer than reward_timeout_s costs its group (dropped and
    # reported with the sample); after max_reward_failures groups in a row, the run stops.
    reward_timeout_s: float = 60.0
    max_reward_failures: int = 10
    # Drop samples more than this many optimizer steps behind the trainer's weights, judged
    # when the pipeline reads the sample (up to `prefetch` batches before the step that trains
    # on it, so the reported lag can exceed it by that much).
    max_lag: int = 4
    # A sample's lag, from the weights versions of its tokens: newest (the version its last
    # token was drawn under: how long it waited since it finished), oldest (its first token:
    # also how long it took to generate, so every sample that takes more than max_lag steps to
    # write is dropped, and long answers with it), or mean (token-weighted). Each token's own
    # lag is corrected by its importance weight either way; see docs/guides/rl.md.
    lag: Literal["newest", "oldest", "mean"] = "newest"
    pack_len: int = 64              # tokens per packed row
    microbatch_rows: int = 16       # packed rows per microbatch
    max_segments: int = 16          # most samples packed into one row
    prefetch: int = 2               # batches the pipeline prepares ahead
    eval_every: int = 0             # held-out evaluation every N RL steps; 0: start and end
    # RL's own optimizer, fresh at the start of RL: warm-up and cosine decay over rl.steps.
    optim: OptimConfig = OptimConfig(lr=3e-4, warmup_steps=50)
    generation: GenerationConfig = GenerationConfig()
    agent: AgentConfig = AgentConfig()

    def __post_init__(self):
        if not 0.0 < self.turn_discount <= 1.0:
            raise ValueError(f"rl.turn_discount={self.turn_discount} must be in (0, 1]")
        for name in ("prompts_per_step", "max_prompt_len", "max_new_tokens", "max_turns",
                     "pack_len", "microbatch_rows", "max_segments", "engine_devices"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl.{name}={getattr(self, name)} must be >= 1")
        for name in ("steps", "max_lag", "prefetch", "eval_every", "max_episode_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"rl.{name}={getattr(self, name)} must be >= 0")
        if self.group_size < 2:
            raise ValueError(f"rl.group_size={self.group_size} must be >= 2 (the advantage "
                             f"baseline is the mean of the other samples of the group)")
        default = EngineConfig()
        for name, source in ENGINE_DERIVED.items():
            if getattr(self.engine, name) != getattr(default, name):
                raise ValueError(f"rl.engine.{name} follows from {source}; leave it out")
        if self.group_size > self.engine.max_concurrent_decodes:
            raise ValueError(f"rl.group_size={self.group_size} exceeds "
                             f"rl.engine.max_concurrent_decodes="
                             f"{self.engine.max_concurrent_decodes}: "
                             f"a group's samples decode side by side")
        for name in ("filter_wait_s", "reward_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rl.{name}={getattr(self, name)} must be > 0")
        if self.max_reward_failures < 1:
            raise ValueError(f"rl.max_reward_failures={self.max_reward_failures} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"rl.temperature={self.temperature} must be > 0 (sampling)")
        if self.tis_cap < 1:
            raise ValueError(f"rl.tis_cap={self.tis_cap} must be >= 1")
        if not 0 <= self.correction_low < 1 < self.correction_high:
            raise ValueError(f"rl.correction_low={self.correction_low} and rl.correction_high="
                             f"{self.correction_high} must satisfy 0 <= low < 1 < high")
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ValueError(f"rl.clip_low={self.clip_low} must be in (0, 1) and "
                             f"rl.clip_high={self.clip_high} > 0")
        if self.kl_coef < 0:
            raise ValueError(f"rl.kl_coef={self.kl_coef} must be >= 0")
        if self.agent.command and self.generation.remote:
            raise ValueError("rl.agent runs its agents against this process's engine (an "
                             "OpenAI endpoint on 127.0.0.1); it cannot be combined with "
                             "rl.generation.servers")
        if self.completion_length == "answer" and self.max_turns > 1:
            raise ValueError("rl.completion_length=answer fixes a single completion's length; "
                             f"rl.max_turns={self.max_turns} episodes have no one answer")
        if 0 < self.max_episode_tokens < self.max_new_tokens:
            raise ValueError(f"rl.max_episode_tokens={self.max_episode_tokens} is below one "
                             f"turn's rl.max_new_tokens={self.max_new_tokens}")
        if self.sample_len > self.pack_len:
            raise ValueError(f"rl.pack_len={self.pack_len} cannot hold one sample of "
                             f"{self.sample_len_names} = {self.sample_len} tokens")

    @property
    def batch_size(self) -> int:
        """Samples per optimizer step."""
        return self.prompts_per_step * self.group_size

    @property
    def episode_tokens(self) -> int:
        """Most tokens after the prompt: one completion, or a multi-turn episode's budget."""
        if self.max_turns == 1:
            return self.max_new_tokens
        return self.max_episode_tokens or self.max_turns * self.max_new_tokens

    @property
    def sample_len(self) -> int:
        """Most tokens a sample can have: its prompt (with BOS) and completion (or episode)."""
        return self.max_prompt_len + self.episode_tokens

    @property
    def prefill_len(self) -> int:
        """The longest prompt the engine is given: a multi-turn episode's later turns are
        prompted with its history (only what the kept pages lack is prefilled)."""
        if self.max_turns == 1 and not self.agent.command:
            return self.max_prompt_len
        return self.sample_len - 1      # an agent's later turns are prompted with its history

    @property
    def sample_len_names(self) -> str:
        """The settings `sample_len` adds up, for messages."""
        if self.max_turns == 1:
            return "rl.max_prompt_len + rl.max_new_tokens"
        return "rl.max_prompt_len + " + ("rl.max_episode_tokens" if self.max_episode_tokens
                                         else "rl.max_turns x rl.max_new_tokens")

    @property
    def max_microbatches(self) -> int:
        """Microbatches a step's samples can need in the worst case (every sample as long as
        possible). Packing first-fit, a row that refuses a sample already holds
        min(pack_len // sample_len, max_segments) samples, so this many rows always suffice."""
        per_row = min(self.pack_len // self.sample_len, self.max_segments)
        rows = -(-self.batch_size // per_row)
        return -(-rows // self.microbatch_rows)


def _taking_renamed(init):
    """RLConfig's __init__, also taking the previous release's names of rl.engine's fields
    from Python callers (RENAMED) for a release, with a DeprecationWarning naming the new one;
    config files and overrides are refused with the new name instead (jaxrl/config.py)."""

    @functools.wraps(init)
    def taking(self, *args, **kwargs):
        moved = {}
        for old, new in RLConfig.RENAMED.items():
            if old in kwargs:
                warnings.warn(f"RLConfig({old}=...) is deprecated: pass rl.{new} "
                              f"(RLConfig(engine=EngineConfig(...)))", DeprecationWarning,
                              stacklevel=2)
                moved[new.removeprefix("engine.")] = kwargs.pop(old)
        if moved:
            kwargs["engine"] = dataclasses.replace(kwargs.get("engine", EngineConfig()), **moved)
        init(self, *args, **kwargs)

    return taking


RLConfig.__init__ = _taking_renamed(RLConfig.__init__)
