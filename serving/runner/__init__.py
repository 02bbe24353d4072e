"""What runs on the device (the ModelRunner role of nano-vllm and vLLM): `engine.py` the Engine
(JetStream's Engine API: prefill, insert, generate, update_params) with its sizes in
`engine_config.py`; `programs.py` every compiled program, built before serving; `steps.py`
what fixes a program (Spec), the decode state and what each program computes; `slot_batch.py` an
insert's per-slot arrays; `sampling.py` per-slot sampling; `constraints.py` grammars as token
masks; `paged_kv.py` the paged KV cache with its page-table arithmetic and attention choice,
read by the kernels of `paged_attention.py` (TPU), `paged_attention_gpu.py` and `native/` (CPU).

Imports: jaxrl.models, sharding and serving.proto; nothing else of serving.
"""
