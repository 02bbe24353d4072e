"""`jaxrl tinker` driven by the official `tinker` SDK, as a researcher's loop drives it: a real
service process, the SDK's own clients, futures and error types. The references are
independent: transformers' forward of the same folder, plain Orbax, the SDK's documented loss
formulas computed here from the logprobs it returns."""

import contextlib
import os
import signal
import subprocess
import sys
import threading

import httpx
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tinker
import torch
import transformers
from tinker import types

from tests.tiny_hf import tiny_qwen_bpe

pytestmark = pytest.mark.slow

KEY = "tml-test-key"
TEXTS = ["one two three four five six seven eight nine ten", "the cat sat on the mat",
         "12+34=46 and 5+6=11"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tinker-model")
    tiny_qwen_bpe(path, TEXTS)
    return path


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    return tmp_path_factory.mktemp("tinker-state")


@pytest.fixture(scope="module")
def url(folder, state):
    """A `jaxrl tinker` subprocess, ready; SIGTERM afterwards, which must stop it cleanly."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "tinker", "--model", str(folder), "--port", "0",
         "--api-key", KEY, "--max-len", "64", "--slots", "8", "--max-lora-rank", "8",
         "--max-adapters", "3",
         "--state-dir", str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            if "ready on " in line:
                break
        else:
            raise AssertionError("jaxrl tinker did not start:\n" + "".join(output)[-3000:])
        threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
        yield line.split("ready on ")[1].split(" ")[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0, "".join(output)[-3000:]
        finally:
            proc.kill()


@pytest.fixture(scope="module")
def service(url):
    """The SDK's client; closed (its heartbeat thread with it) before the service stops."""
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    yield client
    client.close("success").result()


def _datum(ids, weights=None):
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:],
                                       "weights": weights or [1.0] * (len(ids) - 1)})


def _hf_logprobs(folder, ids):
    """log p(ids[1:] | prefix) under transformers' forward of the folder."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids[:-1]])).logits[0]
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1),
                                         torch.tensor(ids[1:])].numpy()


def test_an_sft_loop_trains_and_samples_what_it_learnt(service, folder):
    """The SDK's SFT loop: the first forward's logprobs are transformers' (the adapters start
    as the identity), cross_entropy's loss:sum is -sum(weights * logprobs), the loss falls over
    optim_steps, and the sampler the trainer hands over (in flight, no reload) scores its greedy
    tokens as the trainer does."""
    tc = service.create_lora_training_client(base_model=folder.name, rank=4, seed=0).result()
    tok = tc.get_tokenizer()
    ids = tok.encode(TEXTS[0])
    datum = _datum(ids)
    first = tc.forward([datum], "cross_entropy").result()
    logprobs = np.asarray(first.loss_fn_outputs[0]["logprobs"].data)
    np.testing.assert_allclose(logprobs, _hf_logprobs(folder, ids), atol=1e-4)
    assert first.metrics["loss:sum"] == pytest.approx(-logprobs.sum(), rel=1e-5)

    losses = []
    for _ in range(24):
        fb = tc.forward_backward([datum], "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    assert losses[0] == pytest.approx(first.metrics["loss:sum"], rel=1e-5)
    assert losses[-1] < 0.2 * losses[0], losses

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = ids[:3]
    out = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=6, temperature=0.0)
                         ).result()
    assert [s.tokens for s in out.sequences] == [out.sequences[0].tokens] * 2
    seq = out.sequences[0]
    trained = tc.forward([_datum(prompt + list(seq.tokens))], "cross_entropy").result()
    np.testing.assert_allclose(seq.logprobs, trained.loss_fn_outputs[0]["logprobs"].data[2:],
                               atol=1e-4)
    assert list(seq.tokens)[:4] == ids[3:7], tok.decode(seq.tokens)   # it learnt the sentence


def test_an_rl_loop_with_importance_sampling(service, folder):
    """Sample a group, reward it, importance_sampling forward_backward on the sampler's own
    logprobs: on policy the ratio is 1, so loss:sum is -sum(advantages) exactly as the SDK's
    documentation defines it; after optim_step the rewarded sample is likelier."""
    tc = service.create_lora_training_client(base_model=folder.name, rank=4, seed=1).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tc.get_tokenizer().encode("the cat")
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0,
                                                              seed=3)).result()
    rewards = np.array([float(i == 0) for i in range(4)])
    adv = rewards - rewards.mean()
    data = []
    for a, s in zip(adv, res.sequences):
        full = prompt + list(s.tokens)
        n = len(full) - 1
        zeros = [0.0] * (len(prompt) - 1)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:],
                            "logprobs": zeros + list(s.logprobs),
                            "advantages": zeros + [float(a)] * (n - len(zeros))}))
    fb = tc.forward_backward(data, "importance_sampling").result()
    want = -sum(float(a) * len(s.tokens) for a, s in zip(adv, res.sequences))
    assert fb.metrics["loss:sum"] == pytest.approx(want, abs=1e-3)
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = tc.forward(data[:1], "importance_sampling").result()
    before_lp = np.asarray(fb.loss_fn_outputs[0]["logprobs"].data)[len(prompt) - 1:].sum()
    after_lp = np.asarray(after.loss_fn_outputs[0]["logprobs"].data)[len(prompt) - 1:].sum()
    assert after_lp > before_lp


def test_state_round_trips_through_orbax(service, folder, state):
    """save_state writes an Orbax checkpoint plain Orbax reads; a client created from it
    computes what the saved one does."""
    tc = service.create_lora_training_client(base_model=folder.name, rank=4, seed=2).result()
    ids = tc.get_tokenizer().encode(TEXTS[1])
    tc.forward_backward([_datum(ids)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("first").result().path
    assert path == f"tinker://{tc.model_id}/weights/first"
    want = tc.forward([_datum(ids)], "cross_entropy").result().metrics["loss:sum"]
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    got = restored.forward([_datum(ids)], "cross_entropy").result().metrics["loss:sum"]
    assert got == pytest.approx(want, rel=1e-6)
    tree = ocp.StandardCheckpointer().restore(state / tc.model_id / "weights" / "first" / "state")
    assert tree["step"] == 1 and set(tree["adapters"]["layers"]) >= {"q_proj_lora_a"}


def test_bad_requests_get_the_sdks_errors_and_lose_nothing(service, folder, url):
    """A bad key, an unknown base model, a datum longer than the context, loss inputs of the
    wrong length or missing, an unknown future: each gets the SDK's error type (never a 500),
    and a client's state is untouched by its own or anyone's bad request."""
    tc = service.create_lora_training_client(base_model=folder.name, rank=4, seed=3).result()
    ids = tc.get_tokenizer().encode(TEXTS[2])
    before = tc.forward([_datum(ids)], "cross_entropy").result().metrics["loss:sum"]

    with pytest.raises(tinker.AuthenticationError):
        with tinker.ServiceClient(base_url=url, api_key="tml-wrong") as wrong:
            wrong.create_lora_training_client(base_model=folder.name, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="this service trains"):
        service.create_lora_training_client(base_model="no/such-model", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="up to rank 8"):
        service.create_lora_training_client(base_model=folder.name, rank=64).result()
    bad = [(_datum(list(range(5, 75))), "cross_entropy", "context is 64"),
           (types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0, 1.0]}),
            "cross_entropy", "has shape"),
           (_datum(ids), "importance_sampling", "needs loss_fn_inputs"),
           (_datum(ids), "dro", "not computed by jaxrl")]
    for datum, loss_fn, message in bad:
        with pytest.raises(tinker.RequestFailedError, match=message):
            tc.forward_backward([datum], loss_fn).result()
    response = httpx.post(f"{url}/api/v1/retrieve_future", headers={"X-API-Key": KEY},
                          json={"request_id": "req-none"})
    assert response.status_code == 404 and "no future" in response.text
    response = httpx.post(f"{url}/api/v1/forward_backward", content=b"\xff\xff not protobuf",
                          headers={"X-API-Key": KEY, "Content-Type": "application/x-protobuf"})
    assert response.status_code == 400
    after = tc.forward([_datum(ids)], "cross_entropy").result().metrics["loss:sum"]
    assert after == before
    tc.forward_backward([_datum(ids)], "cross_entropy").result()     # it still trains


def test_clients_sharing_the_base_equal_each_alone(service, folder):
    """Four clients on one base, their requests in flight together (the service batches
    training requests that meet, and samplers decode in one batch on the engine's adapter
    sets, 3 of them for 4 clients: one waits for a set to free): each one's losses and
    samples equal those of the same client (same seed, same data) run by itself."""
    ids = [transformers.AutoTokenizer.from_pretrained(folder).encode(t) for t in TEXTS]
    data = [[_datum(ids[i % 3])] for i in range(4)]

    def run(clients, data):
        fbs = [c.forward_backward(d, "cross_entropy") for c, d in zip(clients, data)]
        steps = [c.optim_step(types.AdamParams(learning_rate=1e-2)) for c in clients]
        losses = [f.result().metrics["loss:sum"] for f in fbs]
        [s.result() for s in steps]
        fwd = [c.forward(d, "cross_entropy") for c, d in zip(clients, data)]
        samplers = [c.save_weights_and_get_sampling_client().result() for c in clients]
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
        samples = [s.sample(types.ModelInput.from_ints(d[0].model_input.to_ints()[:4]),
                            num_samples=1, sampling_params=greedy)
                   for s, d in zip(samplers, data)]
        return (losses + [f.result().metrics["loss:sum"] for f in fwd],
                [(list(r.result().sequences[0].tokens), list(r.result().sequences[0].logprobs))
                 for r in samples])

    def make(seed):
        return service.create_lora_training_client(base_model=folder.name, rank=4,
                                                   seed=seed).result()

    (together, sampled) = run([make(10 + i) for i in range(4)], data)
    alone = [run([make(10 + i)], [data[i]]) for i in range(4)]
    for i, (losses, [(tokens, logprobs)]) in enumerate(alone):
        assert together[i] == pytest.approx(losses[0], rel=1e-5)
        assert together[4 + i] == pytest.approx(losses[1], rel=1e-5)
        assert sampled[i][0] == tokens
        np.testing.assert_allclose(sampled[i][1], logprobs, atol=1e-5)
    assert len({tuple(t) for t, _ in sampled}) > 1       # the clients' adapters differ


def test_a_closed_session_frees_its_clients(url, folder):
    """ServiceClient.close finishes the session: its training clients are gone (404), the
    service goes on serving others."""
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    model_id = client.create_lora_training_client(base_model=folder.name, rank=2).result().model_id
    client.close("success").result()
    response = httpx.post(f"{url}/api/v1/get_info", headers={"X-API-Key": KEY},
                          json={"model_id": model_id})
    assert response.status_code == 404 and model_id in response.text


def test_sdks_before_protobuf_are_answered_in_json(service, folder, url):
    """The tinker SDK before 0.18 sends forward and forward_backward as JSON (forward on its own
    route) and reads JSON results: the same request as the current SDK's protobuf one gives the
    same loss and logprobs."""
    tc = service.create_lora_training_client(base_model=folder.name, rank=2, seed=4).result()
    ids = tc.get_tokenizer().encode(TEXTS[1])
    want = tc.forward([_datum(ids)], "cross_entropy").result()
    body = {"model_id": tc.model_id, "forward_backward_input": {
        "loss_fn": "cross_entropy",
        "data": [{"model_input": {"chunks": [{"tokens": ids[:-1]}]},
                  "loss_fn_inputs": {"target_tokens": {"data": ids[1:], "dtype": "int64",
                                                       "shape": [len(ids) - 1]},
                                     "weights": {"data": [1.0] * (len(ids) - 1),
                                                 "dtype": "float32"}}}]}}
    headers = {"X-API-Key": KEY}
    request_id = httpx.post(f"{url}/api/v1/forward", json=body,
                            headers=headers).json()["request_id"]
    got = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": request_id},
                     headers=headers, timeout=60).json()
    assert got["metrics"]["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
    np.testing.assert_allclose(got["loss_fn_outputs"][0]["logprobs"]["data"],
                               want.loss_fn_outputs[0]["logprobs"].data, atol=1e-6)
