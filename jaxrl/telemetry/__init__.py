"""Telemetry: what a run writes about itself, and nothing it acts on.

Owns the metrics file (`metrics.jsonl`, TensorBoard, optional W&B: `metrics`), the RL step's
derived figures (`rl_metrics`), the run's plots (`plots`) and the progress bar (`progress`).

May import: jaxrl.data, jaxrl.rl, jaxrl.errors and below (tests/test_layering.py). Nothing
here imports a rollout, trainer or command module."""
