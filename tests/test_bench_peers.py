"""bench/peers.py's bookkeeping, with real runner processes: a stack whose runner fails (a peer
out of memory at a shape) is reported by its error and the other stacks still are; Tunix's
micro batch is counted in prompts; jaxrl's own runner runs the smallest job."""

import json
import sys
from pathlib import Path

import pytest

# appended, not put first: bench/tinker.py must not hide the installed tinker SDK
sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
import peers  # noqa: E402
from job import Job, result, write_model  # noqa: E402

OOM = "RESOURCE_EXHAUSTED: Out of memory allocating 60761770180 bytes."


def _runner(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_failed_stack_is_named_with_its_error_and_the_others_are_reported(capsys):
    job = Job(steps=4)
    steps = [{"wall_s": w, "train_s": w / 2, "cpu_s": 2 * w, "samples": job.samples_per_step,
              "generated_tokens": 1000} for w in (9.0, 5.0, 4.0, 2.0)]
    line = "RESULT " + json.dumps(result(job, "TRL", steps, 9.0))
    good = peers.run(_runner(f"print({line!r})"))
    bad = peers.run(_runner(f"import sys; print('Traceback ...', file=sys.stderr); "
                            f"raise RuntimeError({OOM!r})"))
    silent = peers.run(_runner("import sys; sys.exit(3)"))
    assert bad == f"RuntimeError: {OOM}"
    assert silent == "exit status 3, no RESULT line"
    assert "RuntimeError" in capsys.readouterr().err        # the runner's stderr, for the log

    peers.report(job, 3_900_000, [peers.combine([peers.summarize(good)])], {"tunix": bad})
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.strip().startswith("TRL"))
    # Steps 3..4 (4.0 s and 2.0 s): the median step 3.0 s, the median of 128 / 4.0 and
    # 128 / 2.0 samples/s; TRL is the only peer measured, so the best one.
    assert row.split()[1:3] == ["3.00", "48.0"] and row.endswith("1.00x")
    assert f"tunix        failed: RuntimeError: {OOM}" in out


def test_tunix_trains_in_the_same_microbatches_counted_in_prompts():
    assert Job().tunix_microbatch_prompts == 2                       # 16 samples = 2 groups of 8
    assert Job(microbatch=32).tunix_microbatch_prompts == 4
    # Not a whole number of groups: Tunix cannot split a group, so it trains the whole step.
    assert Job(microbatch=4).tunix_microbatch_prompts == Job().prompts_per_step


@pytest.mark.slow
def test_jaxrl_s_own_runner_runs_the_job_at_its_smallest(tmp_path):
    """bench/peers/run_jaxrl.py, the runner behind the headline's peer figures, as peers.py
    starts it, on the smallest job: two steps of two groups of two, four new tokens."""
    job = Job(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=4, prompt_words=4,
              microbatch=4)
    write_model(job, tmp_path / "model")
    root = Path(__file__).resolve().parents[1]
    r = peers.run([sys.executable, str(root / "bench" / "peers" / "run_jaxrl.py"), job.to_json(),
                   str(tmp_path / "model"), str(tmp_path / "work"), "sync"])
    assert isinstance(r, dict), r
    assert r["stack"] == "jaxrl sync" and len(r["steps"]) == job.steps
    assert all(s["samples"] == 4 and s["wall_s"] > 0 for s in r["steps"])
