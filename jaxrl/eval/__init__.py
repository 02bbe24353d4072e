"""Evaluation: scoring a model on held-out problems (`evaluate`: greedy or sampled completions
through an engine, graded by the task's reward).

May import: jaxrl.rollout (episodes), jaxrl.config, jaxrl.rl, serving, jaxrl.models and below
(tests/test_layering.py); never the trainer or a command."""
