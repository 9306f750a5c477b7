"""`lm-train plan`: a run's memory per device, its verdict and its speed, from the config alone (traced, never
compiled), for hardware named by a device spec.

Modules, in the order data flows: `devices` (specs) -> `shards` and `trace` (one device's step as a program of
`program`) -> `liveness` (its peak under the XLA-like `rules`) -> `estimate` -> `plan` and `suggest` -> `report`;
`xla_check` compiles the step for the cross-check, `setup` wires the CLI's inputs. `memory_limit` reads what the
devices really have, `loss_blocks` scores the loss in blocks where the logits would not fit, and `estimate_cache`
keeps a run's estimate for its reruns (`lm_train.run.memory_guard` checks a run with them).
"""
