"""Length-aware admission across processes (StreamRL's dispatch): `jaxrl serve --admission
longest_first` admits by the predicted_len a client sends over gRPC, a run whose rl.admission
needs it refuses a server that admits otherwise, and rl.admission=longest_first_oracle sends
each group's reference answer length."""

import numpy as np
import pytest

from jaxrl.config import ConfigError, load_run_config
from jaxrl.models.tokenizer import CharTokenizer
from jaxrl.recipe import build_task, model_config
from jaxrl.rollout.generation import check_server
from jaxrl.rollout.group import Group
from jaxrl.rollout.sources import Completions
from serving.core.orchestrator import Orchestrator
from serving.fleet.client import RemoteGeneration
from serving.frontends.server import Server
from serving.runner.engine import Engine
from serving.runner.sampling import SamplingParams
from tests.serving.common import CFG, ENGINE, prompts, until


def test_grpc_carries_each_groups_predicted_length_to_a_longest_first_server(params):
    o = Orchestrator(Engine(CFG, ENGINE), params, eos_id=1, longest_first=True).start()
    server = Server(o, port=0).start()
    remote = RemoteGeneration(server.address)
    try:
        assert remote.metrics()["admission"] == "longest_first"
        o.pause()                      # the groups queue where their order can be read
        sampling = SamplingParams(max_tokens=4, temperature=0.0)
        streams = [remote.submit(p, sampling, predicted_len=n)
                   for p, n in zip(prompts(5, 6, 7), (5.0, 50.0, None))]
        until(lambda: o.scheduler.queued() == 3)
        with o.scheduler._lock:
            told = {len(r.prompt): r.predicted_len for r in o.scheduler.waiting}
        assert told[5] == 5.0 and told[6] == 50.0
        assert told[7] == o.length_predictor.predict(prompts(7)[0])   # none sent: its own
        o.resume()
        assert all(len(s.result()[0].tokens) == 4 for s in streams)
    finally:
        remote.close()
        server.stop(0)


@pytest.mark.parametrize("admission,held,says", [
    ("longest_first", "fifo", r"admits groups by fifo; this run \(rl.admission=longest_first\) "
                              r"needs longest_first: start it with --admission longest_first"),
    ("longest_first_oracle", "fifo", "--admission longest_first"),
    ("fifo", "longest_first", "--admission fifo"),
    ("longest_first_oracle", "longest_first", None),
])
def test_a_server_admitting_otherwise_than_the_run_asks_is_refused(admission, held, says):
    cfg = load_run_config(None, [f"rl.admission={admission}"])
    tokenizer = CharTokenizer("0123456789+=")
    metrics = {"eos_id": tokenizer.eos_id, "vocab_size": cfg.model.vocab_size, "max_len": 999,
               "max_prefill_length": 999, "slots": 64, "admission": held}
    if says is None:
        check_server(cfg, tokenizer, "127.0.0.1:9", metrics)
    else:
        with pytest.raises(ConfigError, match=says):
            check_server(cfg, tokenizer, "127.0.0.1:9", metrics)


class Recording:
    def __init__(self):
        self.predicted = []

    def submit(self, prompt, sampling, *, predicted_len=None, carry=None, session=None):
        self.predicted.append((sampling.max_tokens, predicted_len))


@pytest.mark.parametrize("admission", ["longest_first_oracle", "longest_first"])
def test_the_oracle_sends_each_groups_answer_length(admission):
    cfg = load_run_config(None, [f"rl.admission={admission}", "rl.completion_length=answer"])
    task, tokenizer = build_task(cfg, model_config(cfg))
    generation = Recording()
    source = Completions(generation, task, tokenizer, cfg.rl)
    rng = np.random.default_rng(0)
    for i in range(4):
        problem = task.sample(rng)
        source.open(Group(i, problem, tokenizer.encode(problem.prompt), seed=i), None)
    for max_tokens, predicted in generation.predicted:
        # with completion_length=answer a sample is exactly its answer and an EOS
        assert predicted == (max_tokens if admission == "longest_first_oracle" else None)
