"""A training run's parts, by role: the config checked and turned into typed parts (`run_config`,
`config_checks`, `config_domains`, `sampler_setup`), everything built before the first step (`run_setup`), the
trainer's loop (`trainer`, `step_runner`, `mipu_step`), what it writes and reads back (`checkpoint`, `resume_check`,
`run_load`, `run_progress`, `metrics_log`, `run_watch`) and the held-out evaluation (`heldout`).
The entry points that drive a run are the package root's `train`, `evaluate` and `export`."""
