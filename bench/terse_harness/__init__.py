"""terse's benchmark harness: the workloads the benchmarks and tests train, beside bench/.

- :mod:`terse_harness.models`: the model zoo, following models.json, the one definition of each
  model's layer shapes (``terse plan --model`` embeds the same file);
- :mod:`terse_harness.data`: Fashion-MNIST, the language model's text (Debian's fortunes) and
  the synthetic data sets;
- :mod:`terse_harness.launch`: the one launcher: N ranks over loopback (``terse run``) or on
  emulated hosts (scripts/cluster.sh);
- :mod:`terse_harness.training`: data-parallel training runs (DDP, PyTorch's hooks, terse's
  hook, FSDP, the backend) and what they measure (bench/train.py);
- :mod:`terse_harness.lm`: the language model's batches, validation loss and AdamW schedule;
- :mod:`terse_harness.pipeline`: the pipeline benchmark's runs (bench/pipeline_grid.py) and
  the calibration behind ``terse plan-pipeline --model`` (:mod:`terse_harness.plan_pipeline`).

It depends on the installed package ``terse`` only; nothing in ``terse`` imports it. Scripts in
bench/ find it beside themselves; elsewhere put bench/ on PYTHONPATH.
"""
