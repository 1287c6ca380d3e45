"""The device executor: a step's padded inputs (built once, for every kind of step), the jitted programs that run
them, and the device state they thread (weights, KV cache).

  inputs.py     StepPlan + requests -> StepInputs: every step's padded device inputs in one place
  runner.py     ModelRunner: weights and KV cache on device; `execute(inputs) -> StepResult`
  programs.py   the bounded cache of compiled step programs, stand-ins and background compiles
  shapes.py     bucket shapes of a step's program; the shapes warm-up compiles
  invariant.py  batch-invariant mode: one program shape for every step
  weights.py    update_weights / sleep / wake of a runner
"""
