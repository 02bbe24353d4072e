"""The cluster launch recipes in launch/: every `jaxrl` command they run parses with the real
CLI and its config overrides load; the trainer is pointed at exactly the servers the recipe
starts, with the update token they read; the trainer's rows divide over its devices.

The SLURM script runs for real here, with stand-ins for `srun` and `scontrol` that record what
they were asked to start. The GKE manifests are read as Kubernetes would read them."""

import os
import shlex
import stat
import subprocess
from pathlib import Path

import yaml

from jaxrl import cli
from jaxrl.config import load_run_config

ROOT = Path(__file__).resolve().parents[1]
NODES = ["gpu-a", "gpu-b", "gpu-c", "gpu-d", "gpu-e"]


def parse(argv: list[str]):
    """(argparse namespace, RunConfig or None) of one `jaxrl ...` command line."""
    assert Path(argv[0]).name == "jaxrl", argv
    args = cli.parse(argv[1:])
    cfg = None
    if args.command == "train":
        cfg = load_run_config(ROOT / args.config, args.overrides)
    return args, cfg


def _stand_in(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_the_slurm_script_starts_servers_on_the_spare_nodes_and_the_trainer_on_the_rest(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "srun.log"
    bin_dir.mkdir()
    _stand_in(bin_dir / "scontrol", 'printf "%s\\n" ' + " ".join(NODES) + "\n")
    # Each srun appends its command line as one write. The trainer's srun stands in for a long
    # run: it waits (bounded) for the servers' lines, since the script kills them when it ends.
    _stand_in(bin_dir / "srun", f'line=$(printf "%q " "$@"); echo "$line" >> {log}\n'
              f'if [[ " $* " == *" train "* ]]; then\n'
              f'  for _ in $(seq 100); do (( $(grep -c " serve " {log}) >= 3 )) && break; sleep 0.1; done\n'
              f'fi\n')
    run_dir = tmp_path / "run"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "x",
           "SLURM_JOB_NAME": "jaxrl-rl", "SLURM_JOB_ID": "7", "TRAIN_NODES": "2",
           "MODEL": "/models/qwen", "RUN_DIR": str(run_dir), "VENV": "/venv"}
    out = subprocess.run(["bash", str(ROOT / "launch/slurm/rl.sbatch"), "rl.steps=10"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    steps = [shlex.split(line) for line in log.read_text().splitlines()]
    serves = [s for s in steps if "serve" in s]
    trains = [s for s in steps if "train" in s]
    assert len(serves) == 3 and len(trains) == 1, steps
    addresses = []
    for step in serves:
        node = next(a.split("=", 1)[1] for a in step if a.startswith("--nodelist="))
        serve_args, _ = parse(step[step.index("/venv/bin/jaxrl"):])
        assert serve_args.host == "0.0.0.0" and serve_args.allow_remote
        assert serve_args.model == "/models/qwen"
        assert Path(serve_args.update_token_file).read_text().strip()   # a secret was made
        addresses.append(f"{node}:{serve_args.port}")
    addresses.sort(key=lambda a: NODES.index(a.split(":")[0]))   # started in the background
    assert [a.split(":")[0] for a in addresses] == NODES[2:]
    train = trains[0]
    assert "--nodes=2" in train and "--nodelist=gpu-a,gpu-b" in train
    args, cfg = parse(train[train.index("/venv/bin/jaxrl"):])
    assert list(cfg.rl.generation.servers) == addresses
    assert cfg.rl.generation.token_file == serve_args.update_token_file
    assert cfg.hf_path == "/models/qwen" and cfg.checkpoint.resume and cfg.rl.steps == 10
    assert cfg.rl.microbatch_rows % (2 * 8) == 0       # fsdp over 2 nodes x 8 GPUs
    assert (run_dir / "update-token").stat().st_mode & 0o077 == 0   # readable by its owner only
    # Each server holds the run's prompts and samples (the trainer checks this when it connects).
    assert serve_args.max_prefill_length >= cfg.rl.max_prompt_len
    assert serve_args.max_len >= cfg.rl.sample_len + 1
    assert serve_args.slots >= cfg.rl.group_size


def _containers(docs):
    for doc in docs:
        spec = doc.get("spec", {})
        pods = [spec["template"]["spec"]] if doc["kind"] == "StatefulSet" else [
            job["template"]["spec"]["template"]["spec"] for job in spec.get("replicatedJobs", [])]
        for pod in pods:
            for c in pod["containers"]:
                yield doc, pod, c


def test_the_gke_trainer_drives_the_statefulset_s_servers():
    docs = [d for f in ("generation.yaml", "trainer-jobset.yaml")
            for d in yaml.safe_load_all((ROOT / "launch/gke" / f).read_text())]
    service = next(d for d in docs if d["kind"] == "Service")
    servers = next(d for d in docs if d["kind"] == "StatefulSet")
    jobset = next(d for d in docs if d["kind"] == "JobSet")
    commands = {c["command"][1]: (doc, pod, c) for doc, pod, c in _containers(docs)}
    _, serve_pod, serve = commands["serve"]
    serve_args, _ = parse(serve["command"])
    _, train_pod, train = commands["train"]
    _, cfg = parse(train["command"])
    # Stable pod names: <statefulset>-<i>.<headless service>, on the port the servers bind.
    assert service["spec"]["clusterIP"] == "None"
    assert servers["spec"]["serviceName"] == service["metadata"]["name"]
    want = [f"{servers['metadata']['name']}-{i}.{service['metadata']['name']}:{serve_args.port}"
            for i in range(servers["spec"]["replicas"])]
    assert list(cfg.rl.generation.servers) == want
    assert service["spec"]["ports"][0]["port"] == serve_args.port
    # Kubernetes' gRPC probes call the servers' grpc.health.v1 service on the port they bind.
    assert all(serve[probe]["grpc"]["port"] == serve_args.port
               for probe in ("startupProbe", "readinessProbe", "livenessProbe"))
    # One pod per host of the slice, each with the host's chips; rows divide over all chips.
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    chips_per_pod = train["resources"]["limits"]["google.com/tpu"]
    x, y = map(int, train_pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x"))
    assert job["parallelism"] == job["completions"] == x * y // chips_per_pod
    assert cfg.rl.microbatch_rows % (x * y) == 0
    assert cfg.checkpoint.resume                       # a restarted JobSet resumes
    # The servers' engines: one per chip, holding the run's samples; the token both read.
    sx, sy = map(int, serve_pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x"))
    assert serve_args.tensor * serve_args.replicas == sx * sy
    assert serve["resources"]["limits"]["google.com/tpu"] == sx * sy
    assert serve_args.max_len >= cfg.rl.sample_len + 1
    assert serve_args.max_prefill_length >= cfg.rl.max_prompt_len
    assert serve_args.dtype == cfg.model.dtype
    assert Path(serve_args.update_token_file).parent == Path(cfg.rl.generation.token_file).parent
    secrets = {v["name"]: v["secret"]["secretName"] for pod in (serve_pod, train_pod)
               for v in pod["volumes"] if "secret" in v}
    assert len(set(secrets.values())) == 1
