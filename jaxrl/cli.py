"""`jaxrl train | eval | serve | tinker | compile | export | bench`: parse, dispatch, print. The work lives in
jaxrl.commands."""

from __future__ import annotations

import argparse
import sys
import textwrap

from jaxrl.commands.arg_types import int_at_least
from jaxrl.commands.serve_cli import serve_arguments
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
    from serving.runner.sampling import SamplingParams

    if is_multi_turn(task):
        raise UserError(f"--samples: task {task.name!r} runs multi-turn episodes; sampled "
                        f"metrics score single completions")
    problems = task.held_out(args.problems)
    with task_engine(model, task, tokenizer, problems, args.max_new_tokens, cfg.rl) as o:
        try:
            sampling = SamplingParams(temperature=args.temperature, n=args.samples,
                                      max_tokens=args.max_new_tokens)
            r = sampled_eval(o, task, tokenizer, problems, sampling,
                             args.k or sorted({1, args.samples}), cfg.rl)
        except ValueError as e:
            raise UserError(str(e)) from None
    print(f"step {step}: {r['problems']} held-out problems, {r['samples']} samples each at "
          f"temperature {r['temperature']}: " + ", ".join(
              f"{k} {v:.1%}" for k, v in r.items() if "@" in k))


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


def _tinker(args) -> None:
    from jaxrl.commands.tinker import options, tinker
    from jaxrl.platform import use_compilation_cache

    use_compilation_cache()       # a restart loads the engine's and the trainer's programs
    tinker(options(args))


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl", formatter_class=_HelpFormatter,
        description=textwrap.fill("On-policy RL for language models in JAX: train, evaluate, "
                                  "serve, compile for a TPU slice, benchmark.", 79),
        epilog="`jaxrl COMMAND --help` lists a command's options and their defaults.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_train_arguments, _eval_arguments, _serve_arguments, _tinker_arguments,
                _compile_arguments, _export_arguments, _bench_arguments):
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
    hosts.add_argument("--num-processes", type=int_at_least(1), default=None,
                       help="processes in the run, one per host (default: none)")
    hosts.add_argument("--process-id", type=int_at_least(0), default=None,
                       help="this process's index, 0 .. num-processes - 1 (default: none)")
    p.set_defaults(run=_train)


def _eval_arguments(sub) -> None:
    p = _command(sub, "eval", "held-out accuracy of a checkpoint written by `jaxrl train`")
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory written by `jaxrl train` (CheckpointManager "
                        "layout), e.g. runs/demo/checkpoints")
    p.add_argument("--step", type=int_at_least(0), default=None,
                   help="step to restore (default: the newest)")
    p.add_argument("--problems", type=int_at_least(1), default=200,
                   help="held-out problems to score")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=8,
                   help="completion budget per sample")
    p.add_argument("--samples", type=int_at_least(1), default=None, metavar="N",
                   help="sample N completions per problem and report pass@k, avg@N and maj@N "
                        "(default: greedy accuracy)")
    p.add_argument("--k", type=int_at_least(1), nargs="+", default=None,
                   help="with --samples: the k of pass@k (default: 1 and N)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="with --samples: the sampling temperature")
    p.set_defaults(run=_eval)


def _serve_arguments(sub) -> None:
    serve_arguments(_command(sub, "serve", "serve a model over gRPC (JetStream's protocol + "
                                           "weight updates)"))


def _tinker_arguments(sub) -> None:
    p = _command(sub, "tinker", "serve a Hugging Face model behind the Tinker API: LoRA "
                           "training clients and their samplers, for the `tinker` SDK")
    p.add_argument("--model", required=True, help="the base model: a Hugging Face folder")
    p.add_argument("--name", default=None,
                   help="the base_model name clients give (default: the folder's name; its "
                        "path is also taken)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_at_least(0), default=8000,
                   help="port to listen on (0: any free one, printed)")
    p.add_argument("--api-key", default=None,
                   help="the key clients must send (X-API-Key), tml-...; also from "
                        "$TINKER_API_KEY (default: none: any key is taken)")
    p.add_argument("--max-len", type=int_at_least(2), default=None,
                   help="context length for training and sampling (default: the model's, at "
                        "most 2048)")
    p.add_argument("--max-lora-rank", type=int_at_least(1), default=32,
                   help="the largest LoRA rank a training client may ask for")
    p.add_argument("--max-adapters", type=int_at_least(1), default=8,
                   help="LoRA adapter sets the engine holds at once: samplers of that many "
                        "clients (or weight versions) decode in one batch")
    p.add_argument("--slots", type=int_at_least(1), default=32,
                   help="sequences the engine decodes at once")
    p.add_argument("--state-dir", default="tinker_state",
                   help="where save_state writes its Orbax checkpoints")
    p.set_defaults(run=_tinker)


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
    p.add_argument("--step", type=int_at_least(0), default=None,
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
    from jaxrl.heap import collect_less
    from jaxrl.platform import choose_platforms

    collect_less()          # before the imports' churn (jaxrl/heap.py)
    choose_platforms()      # before JAX is imported: no TPU backend on a machine without TPU
    args = parse(argv)
    try:
        return args.run(args) or 0
    except UserError as e:
        print(f"jaxrl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
