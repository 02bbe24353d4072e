"""The host side of the engine (nano-vllm's engine/ without its model runner): `sequence.py`
the units passed around (Request, Prefill, Sequence) and `stream.py` what a caller receives;
`scheduler.py` who runs next (chunked prefill under a token budget, preemption) over
`page_pool.py`'s pages and `sessions.py`' kept turns; `length_predictor.py` for tail-aware
admission; `engine_loop.py` the one thread that owns the device, fed by `inbox.py`;
`orchestrator.py` its public face, with requests checked by `requests.py` and carried ones
replayed by `carry.py`; `threads.py` owned threads.

Imports: serving.runner and below (jaxrl.models, sharding); never weights, frontends or fleet.
"""
