"""Rollouts: everything that turns prompts and weights into scored samples for the trainer.

Owns the generation fleet (`fleet`: in-process engines and `jaxrl serve` processes, which
member takes which group), the weight publisher that brings each trained version to them
(`publisher`), the set-up of both for a run (`generation`), servers a run starts on its own
cores (`local_servers`), and the producers of samples: the
actor (`actor`: groups of n, scoring, filters, the rollout stream's state), multi-turn episodes
(`episodes`) and external agent programs (`agents`).

May import: jaxrl.telemetry, jaxrl.config, jaxrl.train, jaxrl.data, jaxrl.rl, serving,
sharding, jaxrl.models and below (tests/test_layering.py); never the trainer or a command."""
