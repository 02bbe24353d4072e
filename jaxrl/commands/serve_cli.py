"""`jaxrl serve`'s command line: its flags and how they become the server's settings (the
server itself: jaxrl/commands/serve.py)."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from jaxrl.commands.arg_types import int_at_least, port
from jaxrl.errors import UserError

if TYPE_CHECKING:       # JAX is imported only once --cpus has pinned the process
    from jaxrl.models.lora import LoraConfig


# EngineConfig's fields as `jaxrl serve` users know them: the flag that sets one, or what it is.
_SERVE_NAMES = {"max_concurrent_decodes": "--slots", "max_len": "--max-len",
                "max_prefill_length": "--max-prefill-length", "prefill_chunk": "--prefill-chunk",
                "page_size": "--page-size", "num_pages": "--num-pages",
                "memory_fraction": "--memory-fraction", "speculative": "--speculative",
                "speculative_tokens": "--speculative-tokens",
                "min_bucket": "the engine's smallest prefill bucket,"}


def run(args) -> None:
    import logging

    from jaxrl.rollout.local_servers import parse_cpus, pin

    if args.cpus:
        pin(parse_cpus(args.cpus, "--cpus"), "--cpus")   # before JAX sizes its thread pools
    from jaxrl.commands.serve import ServeOptions, read_tls, read_update_token, serve
    from jaxrl.platform import use_compilation_cache
    from serving.runner.engine import EngineConfig

    use_compilation_cache()       # a restart of the same engine loads its programs

    import jax

    platform = jax.default_backend()

    def engine_config(context: int) -> EngineConfig:
        """The engine the flags ask for; --max-len 0 takes the model's context, a flag left
        out its default on this platform (EngineConfig.for_platform)."""
        max_len = args.max_len or context
        given = dict(max_concurrent_decodes=args.slots, max_len=max_len,
                     max_prefill_length=args.max_prefill_length or max_len - 1,
                     prefill_chunk=args.prefill_chunk, dtype=args.dtype,
                     kv_cache_dtype=args.kv_cache_dtype, page_size=args.page_size,
                     num_pages=args.num_pages, memory_fraction=args.memory_fraction,
                     attention=args.attention, score=args.score,
                     record_routes=args.record_routes, speculative=args.speculative,
                     speculative_tokens=args.speculative_tokens)
        try:
            return EngineConfig.for_platform(
                platform, **{k: v for k, v in given.items() if v is not None})
        except ValueError as e:  # name the flags the user gave, not EngineConfig's fields
            raise UserError(re.sub(r"\b(\w+)=", lambda m: f"{_SERVE_NAMES[m[1]]} "
                                   if m[1] in _SERVE_NAMES else m[0], str(e))) from None

    if args.max_len:
        engine_config(args.max_len)   # refuse bad flags before loading anything
    try:
        token = read_update_token(args.update_token_file)
    except OSError as e:
        raise UserError(f"--update-token-file {args.update_token_file!r}: "
                        f"{e.strerror.lower()}") from None
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logger = logging.getLogger("jaxrl")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False    # a library's root handler (absl's) would print every line again
    tls = read_tls(args.tls_cert, args.tls_key)
    serve(ServeOptions(model_dir=args.model, checkpoint_dir=args.checkpoint, host=args.host,
                       port=args.port, update_token=token, tls=tls,
                       allow_remote=args.allow_remote,
                       max_concurrent_rpcs=args.max_concurrent_rpcs,
                       max_queued=args.max_queued, admission=args.admission,
                       tensor=args.tensor, replicas=args.replicas,
                       http_port=args.http_port, lora_dir=args.lora, adapters=_adapters(args),
                       quantize=args.quantize,
                       join=args.join, advertise=args.advertise),
          engine_config, log=lambda m: print(m, flush=True))


def _adapters(args) -> LoraConfig | None:
    """The LoRA adapters --lora-rank asks the server to hold, or None."""
    from jaxrl.models.lora import LoraConfig

    if not args.lora_rank:
        return None
    try:
        return LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha,
                          targets=args.lora_targets, use_rslora=args.lora_rslora)
    except ValueError as e:
        raise UserError(str(e).replace("model.lora.", "--lora-")) from None


def serve_arguments(p: argparse.ArgumentParser) -> None:
    """`jaxrl serve`'s flags, on its subcommand's parser `p`."""
    _served_and_listening(p)
    _engine_arguments(p)
    p.set_defaults(run=run)


def _served_and_listening(p: argparse.ArgumentParser) -> None:
    """What the server serves (a model, adapters) and how it listens."""
    p.add_argument("--model", default=None,
                   help="Hugging Face folder to serve (default: the demo model)")
    p.add_argument("--checkpoint", default="runs/demo/checkpoints",
                   help="without --model: serve the newest checkpoint here if there is one")
    p.add_argument("--lora", default=None, metavar="ADAPTER",
                   help="a PEFT LoRA adapter folder, merged into the model's weights "
                        "(default: none)")
    p.add_argument("--lora-rank", type=int_at_least(0), default=0,
                   help="hold LoRA adapters of this rank apart from the weights (zero until a "
                        "trainer's update; a LoRA run's checkpoint keeps its own), so a "
                        "trainer training adapters pushes them alone (default: 0, none)")
    p.add_argument("--lora-alpha", type=float, default=16.0,
                   help="with --lora-rank: the adapters' alpha (model.lora.alpha)")
    p.add_argument("--lora-targets", default="all-linear",
                   help="with --lora-rank: the projections adapted, separated by commas "
                        "(model.lora.targets)")
    p.add_argument("--lora-rslora", action="store_true",
                   help="with --lora-rank: scale by alpha/sqrt(rank) (model.lora.use_rslora)")
    p.add_argument("--quantize", choices=("none", "int8", "fp8"), default="none",
                   help="int8 or fp8: hold the layer projections in 8 bits with a scale per "
                        "output channel (the weights a trainer with rl.generation.weights=int8 "
                        "or fp8 pushes) (default: none)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; one reachable from other machines needs "
                        "--allow-remote")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --host (logs a warning, louder without TLS)")
    p.add_argument("--tls-cert", default=None,
                   help="PEM certificate chain: serve over TLS (default: none, plaintext)")
    p.add_argument("--tls-key", default=None,
                   help="PEM private key of --tls-cert (default: none, plaintext)")
    p.add_argument("--max-concurrent-rpcs", type=int_at_least(1), default=1024,
                   help="RPCs in progress at once; more get RESOURCE_EXHAUSTED")
    p.add_argument("--max-queued", type=int_at_least(1), default=1024,
                   help="requests waiting for a decode slot; more get RESOURCE_EXHAUSTED")
    p.add_argument("--admission", choices=("fifo", "longest_first"), default="fifo",
                   help="which waiting group takes a free slot: the oldest, or the one "
                        "predicted to write the most tokens (StreamRL: the tail starts first; "
                        "the client's predicted_len, else a predictor learned from finished "
                        "groups)")
    p.add_argument("--port", type=port, default=9000, help="port (0: any free port)")
    p.add_argument("--join", default=None, metavar="TRAINER",
                   help="offer this server to the RL run listening at TRAINER (host:port, its "
                        "rl.generation.join), with the update token; joined again every few "
                        "seconds while the run is not reachable, left at shutdown (default: "
                        "none)")
    p.add_argument("--advertise", default=None, metavar="HOST:PORT",
                   help="with --join: where the trainer reaches this server (default: --host "
                        "and the bound port)")


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's sizes and programs, and where it runs."""
    p.add_argument("--slots", type=int_at_least(1), default=None,
                   help="concurrent decodes, per replica (default: 32 on CPU; on GPU/TPU as "
                        "many as the KV pool holds prompts, up to 256)")
    p.add_argument("--tensor", type=int_at_least(1), default=1,
                   help="devices each replica's engine is tensor-parallel over (must divide "
                        "the model's KV heads)")
    p.add_argument("--replicas", type=int_at_least(1), default=1,
                   help="data-parallel engines, each on --tensor devices of its own; groups go "
                        "to the least loaded")
    p.add_argument("--max-len", type=int_at_least(0), default=0,
                   help="longest sequence, prompt + generated tokens (0: the model's context); "
                        "KV memory is taken page by page as sequences grow, not reserved")
    _pool_arguments(p)
    p.add_argument("--attention", default="auto",
                   choices=["auto", "reference", "loop", "native", "pallas", "triton"],
                   help="decode attention over the KV pages: reference (gather + XLA, one "
                        "program per table width), loop (pages read in a loop up to the "
                        "longest row, one program), native (the same in a C++ kernel: CPU), "
                        "pallas (the Pallas paged-attention kernel: TPU), triton (the Pallas "
                        "GPU kernel, flash decoding: GPU); auto: native on CPU "
                        "(loop without a C++ compiler), reference on GPU and TPU")
    p.add_argument("--score", action="store_true",
                   help="compile the score programs (one per power-of-two length up to "
                        "--max-len): prompt log-probs (echo with logprobs, lm-evaluation-"
                        "harness's loglikelihood tasks) and top_logprobs on the HTTP API")
    p.add_argument("--speculative", default="off", choices=["off", "suffix", "ngram"],
                   help="speculative decoding of the tail, drafts verified so that the "
                        "sampled distribution is exactly the model's: suffix (drafts from the "
                        "prompt's other samples and earlier rollouts), ngram (from the sequence "
                        "itself, prompt lookup), off; drafting stops when the batch is too "
                        "full for it to pay, by the engine's own timings")
    p.add_argument("--speculative-tokens", type=int_at_least(1), default=4,
                   help="the most draft tokens a row verifies in one step")
    p.add_argument("--record-routes", action="store_true",
                   help="a mixture-of-experts model: send back with each sample the experts "
                        "every token was routed to (a trainer's rl.moe_routing replays them)")
    p.add_argument("--max-prefill-length", type=int_at_least(0), default=0,
                   help="longest prompt; 0: up to --max-len less one token (a prompt is "
                        "prefilled in chunks of --prefill-chunk whatever its length)")
    p.add_argument("--prefill-chunk", type=int_at_least(1), default=None,
                   help="prefill chunk size (default: 16 on CPU; on GPU/TPU 512, within 2,048 "
                        "prompt tokens between two decode steps, as vLLM's and Sarathi-Serve's "
                        "token budgets; at most the longest prompt)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="serving dtype of weights and KV cache (default: float32 on CPU, "
                        "bfloat16 on GPU/TPU)")
    p.add_argument("--http-port", type=int_at_least(0), default=None,
                   help="also serve the OpenAI-compatible API (/v1/completions, "
                        "/v1/chat/completions) on this port, 0 for any free one (default: "
                        "none)")
    p.add_argument("--update-token-file", default=None,
                   help="file holding the shared secret for weight updates (default: the "
                        "JAXRL_UPDATE_TOKEN environment variable; with neither, updates are "
                        "refused)")
    p.add_argument("--cpus", default=None, metavar="CORES",
                   help="run on these CPU cores only ('1', '2-3', '0,4-7'), pinned before JAX "
                        "starts (its CPU thread pools size to them) (default: the cores it was "
                        "started on)")


def _pool_arguments(p: argparse.ArgumentParser) -> None:
    """The KV pool: its pages, their number, their storage."""
    p.add_argument("--page-size", type=int_at_least(1), default=16,
                   help="tokens per KV cache page")
    p.add_argument("--num-pages", type=int_at_least(0), default=0,
                   help="KV pages in the pool (0: from device memory on GPU/TPU, see "
                        "--memory-fraction; on CPU enough for every slot at --max-len)")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="GPU/TPU: the weights, the KV pool and the activations within this "
                        "fraction of each device's memory, the pool taking what is left, as "
                        "vLLM's --gpu-memory-utilization (default: 0.9 on GPU/TPU unless "
                        "--num-pages is given; unused on CPU)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the KV cache's storage: auto (--dtype) or fp8 (float8 e4m3, no scale: "
                        "twice the pages in the same memory, half the bytes a decode step "
                        "reads; attention computes in --dtype), as vLLM's --kv-cache-dtype")
