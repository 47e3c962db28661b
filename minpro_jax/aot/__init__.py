"""Compile-only sharding sweeps: a run config's learner and sampler programs compiled for a TPU slice (or N
virtual CPU devices) on this machine, with their per-device memory, FLOPs, roofline estimate and collectives.

    python -m minpro_jax.aot --config=configs/paper/qwen3_8b.py --topology=v5p-64 \\
        --mesh=fsdp=-1 --mesh=data=2,fsdp=-1 --programs=update,score --out=reports/qwen3_8b_v5p64.json

Modules: `topologies` (slice names -> devices and chip figures), `abstract` (sharded abstract parameters),
`programs` (the run's update / score / prefill / decode at its real shapes), `analysis` (memory, FLOPs,
collectives), `sweep` (the loop and the report), `__main__` (the command line). The step budget
(`python -m minpro_jax.aot --budget`): `budget` and `step_rows` (one global step's parts), `hlo_cost` and `hlo_text`
(per-loop-iteration costs of an optimized HLO: the roofline), `schedule`, `paged_schedule`, `lengths`, `packed`
(trip counts from a length draw, and the bound), `forecast`, `links` and `efficiency` (the forecast band: per-op
efficiencies and floors, collectives on the slice's links, every constant sourced), `split_step` (the overlapped
step), `budget_cli` (its command line and table). docs/aot.md is the guide.
"""
