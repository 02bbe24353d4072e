"""`jaxrl train | eval | serve`: parse, dispatch, print. The work lives in jaxrl.run."""

from __future__ import annotations

import argparse
import sys

from jaxrl.errors import UserError


def _train(args) -> None:
    from jaxrl.config import load_run_config
    from jaxrl.run.job import print_summary, run

    cfg = load_run_config(args.config, args.overrides)
    print_summary(run(cfg, log=lambda m: print(m, flush=True)))


def _eval(args) -> None:
    from jaxrl.run.evaluate import evaluate
    from jaxrl.run.warmup import restore_for_eval

    model, task, tokenizer, step = restore_for_eval(args.checkpoint, args.step)
    result = evaluate(model, task, tokenizer, args.problems)
    print(f"step {step}: held-out accuracy {result['accuracy']:.1%} on {result['problems']} "
          f"problems (e.g. {', '.join(result['examples'][:3])})")


def _serve(args) -> None:
    import logging

    from jaxrl.run.serve import read_update_token, serve
    from serving.engine import EngineConfig

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logging.getLogger("jaxrl").addHandler(handler)
    logging.getLogger("jaxrl").setLevel(logging.INFO)
    try:
        engine_cfg = EngineConfig(max_concurrent_decodes=args.slots, max_len=args.max_len,
                                  max_prefill_length=args.max_prefill_length,
                                  prefill_chunk=args.prefill_chunk, dtype=args.dtype)
    except ValueError as e:
        raise UserError(str(e)) from e
    serve(model_dir=args.model, checkpoint_dir=args.checkpoint, host=args.host, port=args.port,
          engine_cfg=engine_cfg, update_token=read_update_token(args.update_token_file),
          log=lambda m: print(m, flush=True))


def _compile(args) -> None:
    import json

    from jaxrl.config import load_run_config
    from jaxrl.run.compile import compile_train_step

    cfg = load_run_config(args.config, args.overrides)
    try:
        memory = compile_train_step(cfg, args.topology)
    except ValueError as e:
        raise UserError(str(e)) from e
    print(f"train step compiled for {args.topology} (remat={cfg.train.remat}), per device:")
    for key in ("argument_bytes", "device_temp_bytes", "host_temp_bytes", "output_bytes"):
        print(f"  {key:<18} {memory[key] / 2**20:10.1f} MiB")
    print(f"  fits in HBM: {memory['fits']}")
    print(json.dumps({k: memory[k] for k in ("device_temp_bytes", "host_temp_bytes",
                                            "argument_bytes", "fits")}))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter

    p = sub.add_parser("train", formatter_class=fmt,
                       help="train a model: supervised warm-up, then RL (async or sync)")
    p.add_argument("--config", default=None, help="YAML run config (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="override a config value, e.g. train.steps=100")
    p.set_defaults(run=_train)

    p = sub.add_parser("eval", formatter_class=fmt,
                       help="held-out accuracy of a checkpoint written by `jaxrl train`")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (CheckpointManager)")
    p.add_argument("--step", type=int, default=None, help="step to restore (default: latest)")
    p.add_argument("--problems", type=int, default=200, help="held-out problems to score")
    p.set_defaults(run=_eval)

    p = sub.add_parser("serve", formatter_class=fmt,
                       help="serve a model over gRPC (JetStream's protocol + weight updates)")
    p.add_argument("--model", default=None,
                   help="Hugging Face folder to serve; default: the demo model")
    p.add_argument("--checkpoint", default="runs/demo/checkpoints",
                   help="without --model: serve the newest checkpoint here if there is one")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=9000, help="port (0: any free port)")
    p.add_argument("--slots", type=int, default=32, help="concurrent decodes")
    p.add_argument("--max-len", type=int, default=64, help="prompt + generated tokens per slot")
    p.add_argument("--max-prefill-length", type=int, default=32, help="longest prompt")
    p.add_argument("--prefill-chunk", type=int, default=16, help="prefill chunk size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="serving dtype of weights and KV cache")
    p.add_argument("--update-token-file", default=None,
                   help="file holding the shared secret for weight updates (or set "
                        "JAXRL_UPDATE_TOKEN); without one, updates are refused")
    p.set_defaults(run=_serve)

    p = sub.add_parser("compile", formatter_class=fmt,
                       help="compile the train step ahead of time for a TPU slice (needs "
                            "libtpu, not a TPU) and print its per-device memory")
    p.add_argument("--topology", default="v5e:2x4", help="TPU slice, e.g. v5e:2x4")
    p.add_argument("--config", default=None, help="YAML run config (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="override a config value, e.g. train.remat=offload")
    p.set_defaults(run=_compile)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except UserError as e:
        print(f"jaxrl {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
