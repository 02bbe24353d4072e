"""The real commands, as a user runs them, on a tiny budget."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.cli import build_parser, main
from jaxrl.commands import bench
from tests.xla import xla_flags

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.embed_dim=32", "model.num_layers=2", "model.mlp_dim=64", "train.steps=6",
        "train.batch_size=16", "train.log_every=3", "train.eval_problems=16",
        "checkpoint.every=3", "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=4",
        "rl.engine.max_concurrent_decodes=8", "rl.microbatch_rows=8", "log.progress=false"]


def _jaxrl(*args, cwd):
    env = {**os.environ, "XLA_FLAGS": xla_flags(8)}
    return subprocess.run([sys.executable, "-m", "jaxrl.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600)


@pytest.mark.parametrize("args, message", [
    (["train", "train.stepz=1"], "unknown config key 'train.stepz'"),
    (["train", "--config", "nope.yaml"], "config file 'nope.yaml' does not exist"),
    (["eval", "--checkpoint", "nowhere"], "no checkpoint directory at"),
])
def test_errors_are_one_line_and_exit_2(tmp_path, args, message):
    out = _jaxrl(*args, cwd=tmp_path)
    assert out.returncode == 2
    assert message in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_bad_checkpoint_dir_overwrites_nothing(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "thesis.tex").write_text("precious")
    out = _jaxrl("train", *TINY, f"checkpoint.dir={tmp_path / 'ckpt'}",
                 f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2
    assert "refusing to use" in out.stderr and "thesis.tex" in out.stderr
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["thesis.tex"]
    assert not (tmp_path / "run").exists()


COMMANDS = ["train", "eval", "serve", "tinker", "compile", "export", "bench"]  # DESIGN.md's,
# and export and tinker


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices


def _help(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit:
        main([*args, "--help"])
    assert exit.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # undo the line wrapping


def test_top_level_help_lists_every_command(capsys):
    out = _help(capsys)
    assert list(_subparsers(build_parser())) == COMMANDS
    for name in COMMANDS:
        assert f" {name} " in out


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_every_option_with_its_default(capsys, command):
    out = _help(capsys, command)
    actions = [a for a in _subparsers(build_parser())[command]._actions
               if not isinstance(a, argparse._HelpAction)]
    assert actions
    for action in actions:
        name = action.option_strings[0] if action.option_strings else action.metavar
        assert name in out and action.help, f"{command} {name}: no help"
        if action.required:
            continue
        if action.default is None:  # the help says in words what happens without it
            assert "(default: " in action.help, f"{command} {name}: default not stated"
        else:
            assert f"{action.help} (default: {action.default})" in out, f"{command} {name}"


def test_help_shows_the_defaults_a_user_relies_on(capsys):
    assert "--problems PROBLEMS held-out problems to score (default: 200)" in _help(capsys, "eval")
    serve = _help(capsys, "serve")
    assert "--port PORT port (0: any free port) (default: 9000)" in serve
    assert "(default: runs/demo/checkpoints)" in serve and "(default: None)" not in serve


def test_serve_s_engine_flags_default_to_engine_config_s_fields():
    """EngineConfig holds every engine default once; `jaxrl serve` cannot import it before
    --cpus pins the process, so its flags say the same, checked here: a flag whose default
    depends on the platform is None (EngineConfig.for_platform decides), the others hold the
    field's default."""
    import dataclasses

    from serving.runner.engine_config import ACCELERATOR_DEFAULTS, EngineConfig

    flags = {"slots": "max_concurrent_decodes", "prefill_chunk": "prefill_chunk",
             "page_size": "page_size", "num_pages": "num_pages",
             "memory_fraction": "memory_fraction", "attention": "attention", "dtype": "dtype",
             "kv_cache_dtype": "kv_cache_dtype", "score": "score",
             "record_routes": "record_routes", "speculative": "speculative",
             "speculative_tokens": "speculative_tokens"}
    args = build_parser().parse_args(["serve"])
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert {flag: getattr(args, flag) for flag in flags} == \
        {flag: None if field in ACCELERATOR_DEFAULTS else defaults[field]
         for flag, field in flags.items()}


def test_engine_defaults_follow_the_platform():
    """On CPU a config left alone is EngineConfig's defaults; on GPU/TPU it is sized as vLLM
    sizes one (ACCELERATOR_DEFAULTS), what the user gives always winning, and chunks within
    the longest prompt."""
    from serving.runner.engine_config import EngineConfig

    assert EngineConfig.for_platform("cpu", max_len=4096, max_prefill_length=4095) == \
        EngineConfig(max_len=4096, max_prefill_length=4095)
    gpu = EngineConfig.for_platform("gpu", max_len=4096, max_prefill_length=4095)
    assert (gpu.memory_fraction, gpu.max_concurrent_decodes, gpu.dtype, gpu.prefill_chunk,
            gpu.prefill_budget) == (0.9, 0, "bfloat16", 512, 2048)
    short = EngineConfig.for_platform("tpu", max_len=128, max_prefill_length=100)
    assert short.prefill_chunk == 128
    pages = EngineConfig.for_platform("gpu", max_len=4096, max_prefill_length=4095,
                                      num_pages=1000, max_concurrent_decodes=8, dtype="float32")
    assert (pages.memory_fraction, pages.max_concurrent_decodes, pages.dtype) == \
        (0.0, 8, "float32")
    assert pages.with_pool(1000) is pages
    # slots from the pool: a 4,095-token prompt takes 256 pages of 16
    assert gpu.with_pool(1 + 256 * 10 + 5).max_concurrent_decodes == 10
    assert gpu.with_pool(10**7).max_concurrent_decodes == 256
    with pytest.raises(ValueError, match=r"max_concurrent_decodes=0 \(as many slots as the "
                                         r"pool holds\) needs memory_fraction"):
        EngineConfig(max_concurrent_decodes=0)


@pytest.mark.parametrize("args, message", [
    (["train", "foo=1"], "unknown config key 'foo'; the top level allows: run_dir, hf_path, "),
    (["train", "rl.mode=fast"], "rl.mode='fast' is not allowed; choose one of: 'async', 'sync'"),
    (["train", "--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
    (["compile", "--topology", "v9:2x2"], "topology 'v9:2x2' is not of the form GEN:AxB[xC] "
                                          "with GEN one of v4, v5e, v5p, v6e"),
    (["eval", "--checkpoint", "/nonexistent"], "no checkpoint directory at '/nonexistent'"),
    (["serve", "--max-len", "8", "--max-prefill-length", "32"],
     "--max-prefill-length 32 must be below --max-len 8"),
    (["serve", "--prefill-chunk", "4"],
     "--prefill-chunk 4 is below the engine's smallest prefill bucket, 8"),
    (["serve", "--update-token-file", "no-token"],
     "--update-token-file 'no-token': no such file or directory"),
    (["serve", "--host", "0.0.0.0"],
     "--host 0.0.0.0 is reachable from other machines; add --allow-remote"),
    (["serve", "--tls-key", "key.pem"], "--tls-cert and --tls-key go together"),
    (["serve", "--cpus", "0-x"], "--cpus='0-x': '0-x' is not a core or a range of cores"),
    (["serve", "--cpus", "4096"], "--cpus: cannot run on cores [4096]"),
    (["bench", "nope"], "unknown benchmark 'nope'; choose one of: async_vs_sync, calibrate, "
                        "compile_stress, constrained, engine"),
])
def test_user_errors_name_the_value_and_what_is_allowed(tmp_path, monkeypatch, capsys, args,
                                                        message):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxrl {args[0]}: error: ") and message in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["serve", "--port", "70000"], "argument --port: must be a TCP port, 0 to 65535, got 70000"),
    (["serve", "--port", "-5"], "argument --port: must be >= 0, got -5"),
    (["serve", "--slots", "0"], "argument --slots: must be >= 1, got 0"),
    (["eval", "--checkpoint", "c", "--problems", "many"],
     "argument --problems: expected an integer, got 'many'"),
    (["eval", "--checkpoint", "c", "--step", "-1"], "argument --step: must be >= 0, got -1"),
    (["eval", "--checkpoint", "c", "--samples", "4", "--k", "0"],
     "argument --k: must be >= 1, got 0"),
    (["eval"], "the following arguments are required: --checkpoint"),
    (["frob"], "invalid choice: 'frob' (choose from 'train', 'eval', 'serve', 'tinker', "
               "'compile', 'export', 'bench')"),
])
def test_bad_flags_are_refused_before_any_work(capsys, args, message):
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_lists_the_benchmarks_with_their_summaries(capsys):
    summaries = {name: (ROOT / "bench" / f"{name}.py").read_text().splitlines()[0].strip('"')
                 for name in ("async_vs_sync", "calibrate", "compile_stress", "constrained",
                              "engine", "fleet", "gpu", "long_tail", "lora_decode", "lora_rl",
                              "lora_step", "multiplex",
                              "paged_attention", "paged_decode", "parity", "peers",
                              "pipeline_step", "products", "rollout_weights", "simulate", "soak",
                              "speculative", "tinker", "tpu_memory")}
    assert main(["bench"]) == 0
    listed = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[0] for line in listed] == list(summaries)
    for line, (name, summary) in zip(listed, summaries.items()):
        assert " ".join(line.split()) == f"{name} {' '.join(summary.split())}"
    help_text = _help(capsys, "bench")
    assert all(f"{name} {' '.join(s.split())}" in help_text for name, s in summaries.items())


def test_bench_runs_the_script_with_the_remaining_args(tmp_path, monkeypatch, capfd):
    (tmp_path / "echo.py").write_text(
        '"""Echo: prints its arguments."""\nimport sys\nprint(sys.argv[1:])\nsys.exit(3)\n')
    (tmp_path / "_shared.py").write_text("")  # a helper module, not a benchmark
    monkeypatch.setattr(bench, "BENCH_DIR", tmp_path)
    assert main(["bench", "echo", "--help", "x=1", "-n", "2"]) == 3  # its exit status
    assert capfd.readouterr().out == "['--help', 'x=1', '-n', '2']\n"
    assert main(["bench"]) == 0
    assert capfd.readouterr().out.splitlines()[1:] == ["  echo  Echo: prints its arguments."]


def test_bench_without_the_repository_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "BENCH_DIR", tmp_path / "site-packages" / "bench")
    for args in (["bench"], ["bench", "engine"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"no bench/ folder at {tmp_path / 'site-packages' / 'bench'}" in err
        assert "pip install -e ." in err
    assert "no bench/ folder at" in _help(capsys, "bench")  # the help still works


@pytest.mark.slow
@pytest.mark.parametrize("name, option", [("engine", "--batch BATCH"),
                                          ("async_vs_sync", "--rl-steps RL_STEPS")])
def test_real_benchmark_help_through_jaxrl_bench(tmp_path, name, option):
    out = _jaxrl("bench", name, "--help", cwd=tmp_path)  # imports it: torch, jax, the RL loop
    assert out.returncode == 0, out.stderr[-2000:]
    assert option in out.stdout and "(default: " in out.stdout


@pytest.mark.slow
def test_serve_answers_and_stops_on_sigterm(tmp_path):
    import signal

    import grpc

    from serving.proto import jetstream_pb2 as js
    from serving.proto import jetstream_pb2_grpc as js_grpc

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "serve", "--port", "0",
                             "--checkpoint", str(tmp_path / "none"), "--slots", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "ready on" in line:
                break
        assert any("freshly initialised" in s for s in seen), seen
        address = line.split("ready on ")[1].split(": ")[0]
        with grpc.insecure_channel(address) as ch:
            stub = js_grpc.OrchestratorStub(ch)
            assert stub.HealthCheck(js.HealthCheckRequest(), timeout=30).is_live
            out = list(stub.Decode(js.DecodeRequest(
                max_tokens=3, text_content=js.DecodeRequest.TextContent(text="12+34=")),
                timeout=60))
            assert 0 < len(out) <= 3
        proc.send_signal(signal.SIGTERM)
        try:   # the server's own deadline (45 s) dumps every thread's stack before this one
            stdout, stderr = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            raise AssertionError(f"no exit 90 s after SIGTERM:\n{stdout[-2000:]}\n"
                                 f"{stderr[-6000:]}") from None
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-6000:]
    assert "jaxrl serve: stopped" in stdout
