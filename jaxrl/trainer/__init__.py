"""The runs that loop over train steps: the supervised warm-up (`warmup`, its stop rule in
`warmup_stop`) and RL (`rl`: the loop that takes rollouts, trains and publishes weights;
`rl_trainer`: the RL trainer's state, step and checkpoints), and what makes them run on
several processes (`distributed`: who leads; `lockstep`: the leader's decisions shared with
the others in one collective order).

`jaxrl.train` (below this) is one step's mathematics (loss, gradients, optimizer, checkpoint
format); this package is the runs built from it.

May import: jaxrl.eval, jaxrl.rollout, jaxrl.telemetry and everything below them
(tests/test_layering.py); never a command."""
