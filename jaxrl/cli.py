"""`jaxrl train | eval | serve | compile | bench`: parse, dispatch, print. The work lives in
jaxrl.commands."""

from __future__ import annotations

import argparse
import re
import sys
import textwrap

from jaxrl.errors import UserError


def _train(args) -> None:
    from jaxrl.config import load_run_config

    cfg = load_run_config(args.config, args.overrides)  # before the heavy imports: errors fast
    from jaxrl.rollout.local_servers import pin_trainer

    pin_trainer(cfg)              # rl.generation.cpus: before JAX sizes its thread pools
    from jaxrl.platform import use_compilation_cache
    from jaxrl.trainer import distributed

    use_compilation_cache()       # a second run of the same config starts in seconds
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    from jaxrl.commands.job import print_summary, run

    leader = distributed.is_leader()     # process 0 speaks for all of them
    summary = run(cfg, log=lambda m: print(m, flush=True) if leader else None)
    if leader:
        print_summary(summary)


def _eval(args) -> None:
    from jaxrl.eval.evaluate import evaluate_model
    from jaxrl.trainer.warmup import restore_for_eval

    model, task, tokenizer, step, cfg = restore_for_eval(args.checkpoint, args.step,
                                                         with_config=True)
    if args.samples:
        _eval_sampled(args, model, task, tokenizer, step, cfg)
        return
    result = evaluate_model(model, task, tokenizer, args.problems, args.max_new_tokens, cfg.rl)
    print(f"step {step}: held-out accuracy {result['accuracy']:.1%} on {result['problems']} "
          f"problems (e.g. {', '.join(result['examples'][:3])})")


def _eval_sampled(args, model, task, tokenizer, step, cfg) -> None:
    from jaxrl.eval.evaluate import task_engine
    from jaxrl.eval.sampled import sampled_eval
    from jaxrl.rl.env import is_multi_turn

    if is_multi_turn(task):
        raise UserError(f"--samples: task {task.name!r} runs multi-turn episodes; sampled "
                        f"metrics score single completions")
    problems = task.held_out(args.problems)
    with task_engine(model, task, tokenizer, problems, args.max_new_tokens, cfg.rl) as o:
        try:
            r = sampled_eval(o, task, tokenizer, problems, args.samples,
                             args.k or sorted({1, args.samples}), args.temperature,
                             args.max_new_tokens, cfg.rl)
        except ValueError as e:
            raise UserError(str(e)) from None
    print(f"step {step}: {r['problems']} held-out problems, {r['samples']} samples each at "
          f"temperature {r['temperature']}: " + ", ".join(
              f"{k} {v:.1%}" for k, v in r.items() if "@" in k))


# EngineConfig's fields as `jaxrl serve` users know them: the flag that sets one, or what it is.
_SERVE_NAMES = {"max_concurrent_decodes": "--slots", "max_len": "--max-len",
                "max_prefill_length": "--max-prefill-length", "prefill_chunk": "--prefill-chunk",
                "page_size": "--page-size", "num_pages": "--num-pages",
                "memory_fraction": "--memory-fraction",
                "min_bucket": "the engine's smallest prefill bucket,"}


def _serve(args) -> None:
    import logging

    from jaxrl.rollout.local_servers import parse_cpus, pin

    if args.cpus:
        pin(parse_cpus(args.cpus, "--cpus"), "--cpus")   # before JAX sizes its thread pools
    from jaxrl.commands.serve import read_tls, read_update_token, serve
    from jaxrl.platform import use_compilation_cache
    from serving.engine import EngineConfig

    use_compilation_cache()       # a restart of the same engine loads its programs

    def engine_config(context: int) -> EngineConfig:
        """The engine the flags ask for; --max-len 0 takes the model's context."""
        try:
            return EngineConfig(max_concurrent_decodes=args.slots,
                                max_len=args.max_len or context,
                                max_prefill_length=(args.max_prefill_length or
                                                    (args.max_len or context) - 1),
                                prefill_chunk=args.prefill_chunk, dtype=args.dtype,
                                page_size=args.page_size, num_pages=args.num_pages,
                                memory_fraction=args.memory_fraction,
                                attention=args.attention, score=args.score,
                                record_routes=args.record_routes)
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
    serve(model_dir=args.model, checkpoint_dir=args.checkpoint, host=args.host, port=args.port,
          engine_config=engine_config, update_token=token, log=lambda m: print(m, flush=True),
          tls=tls, allow_remote=args.allow_remote,
          max_concurrent_rpcs=args.max_concurrent_rpcs, max_queued=args.max_queued,
          tensor=args.tensor, replicas=args.replicas, http_port=args.http_port,
          lora_dir=args.lora)


def _compile(args) -> None:
    from jaxrl.commands.compile import report
    from jaxrl.config import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    try:
        report(cfg, args.topology, explain_memory=args.explain_memory)
    except ValueError as e:
        raise UserError(str(e)) from e


def _export(args) -> None:
    from jaxrl.commands.export import export

    export(args.checkpoint, args.out, args.format, args.step)


def _bench(args) -> int:
    from jaxrl.commands.bench import benchmarks, listing, run_benchmark

    if args.name is None:
        print(f"benchmarks (jaxrl bench NAME [args...]; NAME --help for a benchmark's own):\n"
              f"{listing(benchmarks())}")
        return 0
    return run_benchmark(args.name, args.args)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
    """Shows every default, except None: an option without one says what happens in words."""

    def _get_help_string(self, action):
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl", formatter_class=_HelpFormatter,
        description=textwrap.fill("On-policy RL for language models in JAX: train, evaluate, "
                                  "serve, compile for a TPU slice, benchmark.", 79),
        epilog="`jaxrl COMMAND --help` lists a command's options and their defaults.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_train_arguments, _eval_arguments, _serve_arguments, _compile_arguments,
                _export_arguments, _bench_arguments):
        add(sub)
    return parser


def _command(sub, name: str, summary: str, **kwargs) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=summary, formatter_class=_HelpFormatter,
                          description=textwrap.fill(summary[0].upper() + summary[1:] + ".", 79),
                          **kwargs)


def _config_arguments(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("--config", default=None,
                   help="YAML run config, e.g. configs/demo_cpu.yaml (default: none, the "
                        "dataclass defaults)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="override a config value (the dataclasses give the defaults, "
                        "--config overrides them, these override both), e.g. " + example)


def _train_arguments(sub) -> None:
    p = _command(sub, "train", "train a model: supervised warm-up, then RL (async or sync)")
    _config_arguments(p, "train.steps=100")
    hosts = p.add_argument_group(
        "several hosts (jax.distributed; detected on TPU slices, SLURM and GKE without these)")
    hosts.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="process 0's address, the same for every process (default: none: "
                            "one process, or the cluster's own when detected)")
    hosts.add_argument("--num-processes", type=_int_at_least(1), default=None,
                       help="processes in the run, one per host (default: none)")
    hosts.add_argument("--process-id", type=_int_at_least(0), default=None,
                       help="this process's index, 0 .. num-processes - 1 (default: none)")
    p.set_defaults(run=_train)


def _eval_arguments(sub) -> None:
    p = _command(sub, "eval", "held-out accuracy of a checkpoint written by `jaxrl train`")
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory written by `jaxrl train` (CheckpointManager "
                        "layout), e.g. runs/demo/checkpoints")
    p.add_argument("--step", type=_int_at_least(0), default=None,
                   help="step to restore (default: the newest)")
    p.add_argument("--problems", type=_int_at_least(1), default=200,
                   help="held-out problems to score")
    p.add_argument("--max-new-tokens", type=_int_at_least(1), default=8,
                   help="completion budget per sample")
    p.add_argument("--samples", type=_int_at_least(1), default=None, metavar="N",
                   help="sample N completions per problem and report pass@k, avg@N and maj@N "
                        "(default: greedy accuracy)")
    p.add_argument("--k", type=_int_at_least(1), nargs="+", default=None,
                   help="with --samples: the k of pass@k (default: 1 and N)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="with --samples: the sampling temperature")
    p.set_defaults(run=_eval)


def _serve_arguments(sub) -> None:
    p = _command(sub, "serve", "serve a model over gRPC (JetStream's protocol + weight updates)")
    p.add_argument("--model", default=None,
                   help="Hugging Face folder to serve (default: the demo model)")
    p.add_argument("--checkpoint", default="runs/demo/checkpoints",
                   help="without --model: serve the newest checkpoint here if there is one")
    p.add_argument("--lora", default=None, metavar="ADAPTER",
                   help="a PEFT LoRA adapter folder, merged into the model's weights "
                        "(default: none)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; one reachable from other machines needs "
                        "--allow-remote")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --host (logs a warning, louder without TLS)")
    p.add_argument("--tls-cert", default=None,
                   help="PEM certificate chain: serve over TLS (default: none, plaintext)")
    p.add_argument("--tls-key", default=None,
                   help="PEM private key of --tls-cert (default: none, plaintext)")
    p.add_argument("--max-concurrent-rpcs", type=_int_at_least(1), default=1024,
                   help="RPCs in progress at once; more get RESOURCE_EXHAUSTED")
    p.add_argument("--max-queued", type=_int_at_least(1), default=1024,
                   help="requests waiting for a decode slot; more get RESOURCE_EXHAUSTED")
    p.add_argument("--port", type=_port, default=9000, help="port (0: any free port)")
    p.add_argument("--slots", type=_int_at_least(1), default=32,
                   help="concurrent decodes (per replica)")
    p.add_argument("--tensor", type=_int_at_least(1), default=1,
                   help="devices each replica's engine is tensor-parallel over (must divide "
                        "the model's KV heads)")
    p.add_argument("--replicas", type=_int_at_least(1), default=1,
                   help="data-parallel engines, each on --tensor devices of its own; groups go "
                        "to the least loaded")
    p.add_argument("--max-len", type=_int_at_least(0), default=0,
                   help="longest sequence, prompt + generated tokens (0: the model's context); "
                        "KV memory is taken page by page as sequences grow, not reserved")
    p.add_argument("--page-size", type=_int_at_least(1), default=16,
                   help="tokens per KV cache page")
    p.add_argument("--num-pages", type=_int_at_least(0), default=0,
                   help="KV pages in the pool (0: --memory-fraction if set, else enough for "
                        "every slot at --max-len)")
    p.add_argument("--memory-fraction", type=float, default=0.0,
                   help="GPU/TPU: size the KV pool to this fraction of the device memory free "
                        "after the weights are loaded")
    p.add_argument("--attention", default="auto",
                   choices=["auto", "reference", "loop", "native", "pallas"],
                   help="decode attention over the KV pages: reference (gather + XLA, one "
                        "program per table width), loop (pages read in a loop up to the "
                        "longest row, one program), native (the same in a C++ kernel: CPU), "
                        "pallas (the Pallas paged-attention kernel: TPU); auto: native on CPU "
                        "(loop without a C++ compiler), reference on GPU and TPU")
    p.add_argument("--score", action="store_true",
                   help="compile the score programs (one per power-of-two length up to "
                        "--max-len): prompt log-probs (echo with logprobs, lm-evaluation-"
                        "harness's loglikelihood tasks) and top_logprobs on the HTTP API")
    p.add_argument("--record-routes", action="store_true",
                   help="a mixture-of-experts model: send back with each sample the experts "
                        "every token was routed to (a trainer's rl.moe_routing replays them)")
    p.add_argument("--max-prefill-length", type=_int_at_least(0), default=0,
                   help="longest prompt; 0: up to --max-len less one token (a prompt is "
                        "prefilled in chunks of --prefill-chunk whatever its length)")
    p.add_argument("--prefill-chunk", type=_int_at_least(1), default=16,
                   help="prefill chunk size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="serving dtype of weights and KV cache")
    p.add_argument("--http-port", type=_int_at_least(0), default=None,
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
    p.set_defaults(run=_serve)


def _compile_arguments(sub) -> None:
    p = _command(sub, "compile", "compile the train step and the engine's generate step ahead of "
                            "time for a TPU slice (needs libtpu, not a TPU) and print their "
                            "per-device memory")
    p.add_argument("--topology", default="v5e:2x4", help="TPU slice, GEN:AxB[xC]")
    p.add_argument("--explain-memory", action="store_true",
                   help="also list the train step's largest device buffers at its memory peak, "
                        "by the JAX operation that made each (from the compiler's dumps)")
    _config_arguments(p, "train.remat=offload")
    p.set_defaults(run=_compile)


def _export_arguments(sub) -> None:
    p = _command(sub, "export", "write a checkpoint as a Hugging Face folder, adapters merged, "
                            "or as a base folder plus a PEFT LoRA adapter folder")
    p.add_argument("--checkpoint", required=True, help="a run's checkpoint directory")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--format", default="merged", choices=("merged", "peft"),
                   help="merged: OUT is a Hugging Face folder; peft: OUT/base and OUT/adapter")
    p.add_argument("--step", type=_int_at_least(0), default=None,
                   help="the checkpoint's step (default: its newest)")
    p.set_defaults(run=_export)


def _bench_arguments(sub) -> None:
    from jaxrl.commands.bench import listing

    p = _command(sub, "bench", "run a benchmark from the repository's bench/ folder; each prints "
                         "ratios measured side by side", epilog=f"benchmarks:\n{listing()}")
    p.add_argument("name", nargs="?", default=None, metavar="NAME",
                   help="benchmark to run (default: list them)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="...",
                   help="passed to the benchmark; `jaxrl bench NAME --help` shows its options")
    p.set_defaults(run=_bench)


def parse(argv=None) -> argparse.Namespace:
    """The command line, parsed. Overrides may also follow the flags (`jaxrl train --config C
    --process-id 1 rl.steps=4`), which argparse alone refuses once it has passed the
    positionals."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all(
            "=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv=None) -> int:
    from jaxrl.platform import choose_platforms

    choose_platforms()      # before JAX is imported: no TPU backend on a machine without TPU
    args = parse(argv)
    try:
        return args.run(args) or 0
    except UserError as e:
        print(f"jaxrl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
